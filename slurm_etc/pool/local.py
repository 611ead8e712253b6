"""A pool of local worker processes that run one function on every worker, many times.

Starting a worker costs seconds (importing torch and megatron-core takes about 5 s on two
cores), so :class:`LocalWorkers` starts its processes once and serves many calls::

    with LocalWorkers(4, preload=("megatron.core",)) as workers:
        results = workers.run(w_phase, cfg)   # [result of worker 0, of worker 1, ...]

The workers are joined by a rendezvous store the parent hosts on 127.0.0.1
(:class:`~slurm_etc.protocol.store.StoreServer`, CURVE with a secret drawn per pool and
handed to the workers through their spawn pipe), as a job's processes are by its
coordinator: another user on the machine can neither read nor forge what the workers act
on (the trainer's step agreement, a resize's state). Two calling conventions:

* by default ``w_phase(ctx, *args, **kwargs)`` gets a :class:`WorkerContext` (index, size,
  the store, live objects kept between calls) and starts the process groups it needs from
  the store (:meth:`WorkerContext.init_group`);
* with ``default_group=True`` every worker joins one ``gloo`` default group over all workers
  before anything runs and keeps it between calls; ``func(rank, world, *args, **kwargs)``
  gets its rank (its worker index) and the world size (the multi-process tests).

Functions are pickled by reference (define them at module level); the workers import their
module by name, with the parent's ``sys.path``. Arguments and results must pickle.

Failures are loud and leave no processes behind:

* a worker exception is re-raised in the parent as :class:`WorkerError`, with the worker
  index and the remote traceback; an unpicklable result is reported the same way;
* a call that does not finish within its timeout raises :class:`WorkerTimeout` naming the
  workers that did not answer; those first dump their Python stacks to stderr (faulthandler);
  a dead worker raises :class:`WorkerDied`; all are :class:`WorkerFailed`;
* a function or arguments that do not pickle are refused before any worker starts the call;
* after a timeout, a worker death, or an exception on some workers while others hang in a
  collective, the workers are stopped and the next call starts new ones; when every worker
  answered, the same workers keep serving;
* workers exit when the parent process goes away (a watchdog thread), and
  :meth:`LocalWorkers.close` stops them by PID (ask, terminate, then kill).

Workers are forked from multiprocessing's ``forkserver``, a server process that imported
torch and megatron-core once (:mod:`slurm_etc.pool.preload`): each worker is a fresh process
(no inherited locks or torch state: the server only imported) that starts in a fraction of a
second instead of a cold import's seconds. Each gets the parent's environment, working
directory, ``sys.path`` and stderr as they are at its start, as a spawned one would. ``cold=True``
spawns instead, for what measures a cold start (a checkpoint-restart's real cost). Workers
are not daemonic, because megatron's ``dist_checkpointing.save`` starts a multiprocessing
Manager inside them; a worker stops its own child processes before it exits.
"""
from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, NoReturn, Self

from ..errors import InternalError
from ..protocol.gpus import gpu_env, gpus_present

if TYPE_CHECKING:
    from slurm_etc.protocol.store import StoreServer

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
# Start-up is bounded by the larger of this and the call timeout: a cold import of
# megatron-core on a loaded two-core machine takes tens of seconds.
START_TIMEOUT_S = 120.0
START_ATTEMPTS = 3
# After one worker fails, the others get this long to finish before the workers are stopped
# (they are usually blocked in a collective waiting for the failed one).
FAILURE_GRACE_S = 10.0
# Ask-then-wait bound of a graceful close (a worker stops megatron's writer Manager first).
CLOSE_WAIT_S = 30.0
WORKER_ENV = {"OMP_NUM_THREADS": "1"}
DEFAULT_GROUP_TAG = "default"


class WorkerFailed(InternalError, RuntimeError):
    """A worker raised, died or did not answer."""


class WorkerError(WorkerFailed):
    """A worker raised: carries its index and the remote traceback."""

    def __init__(self, index: int, func: str, remote_traceback: str, others: str = "") -> None:
        self.index = index
        self.remote_traceback = remote_traceback
        super().__init__(f"worker {index} raised in {func}{others}\n"
                         f"--- remote traceback (worker {index}) ---\n{remote_traceback}")


class WorkerTimeout(WorkerFailed):
    """Some workers did not answer within the timeout."""


class WorkerDied(WorkerFailed):
    """A worker process exited while the pool expected an answer."""


@dataclass
class WorkerContext:
    """What a worker keeps between calls: its index, the shared store, live objects.

    ``objects`` holds whatever the called functions keep between calls (the harness's phases
    keep their live megatron training states there).
    """

    index: int
    size: int
    store: Any
    timeout_s: float
    objects: dict = field(default_factory=dict)

    def init_group(self, tag: str, rank: int, world: int) -> None:
        """Start a default group (destroying the current one) from the shared store: gloo,
        and NCCL for CUDA tensors on a GPU (:mod:`slurm_etc.migrate.device`)."""
        import torch.distributed as dist

        from slurm_etc.migrate.device import current

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(current().world_backend, store=dist.PrefixStore(tag, self.store),
                                rank=rank, world_size=world,
                                timeout=timedelta(seconds=self.timeout_s))

    def drop(self) -> None:
        """Drop the live objects and megatron's groups, then the default group."""
        import gc

        import torch.distributed as dist

        had_objects = bool(self.objects)
        self.objects.clear()
        gc.collect()
        if had_objects:
            # the objects are megatron training states: its model parallel groups go with them
            from slurm_etc.megatron import build

            build.teardown()
        if dist.is_initialized():
            dist.destroy_process_group()


# -- worker side ----------------------------------------------------------------------------

def _watch_parent(parent_pid: int) -> None:
    """Exit this worker when its parent is gone (no orphans after a killed run). A worker
    forked from the forkserver is the server's child: the server ends with the parent, so
    either its own parent changing or the pool's parent going away means the pool is gone."""
    started_under = os.getppid()
    while True:
        try:
            os.kill(parent_pid, 0)
            gone = os.getppid() != started_under
        except ProcessLookupError:
            gone = True
        if gone:
            _stop_children()
            os._exit(3)
        time.sleep(1.0)


class _ParentStderr:
    """The parent's stderr, handed to a worker as a file descriptor when it starts (forked
    from the forkserver, a worker would otherwise write to the server's stderr: under pytest,
    the capture file of whichever test started the server). Pickled only while a process is
    started (``reduction.DupFd`` passes the descriptor with the start)."""

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        try:
            os.fstat(2)
        except OSError:  # no stderr to hand on
            return _adopt_stderr, (None,)
        return _adopt_stderr, (reduction.DupFd(2),)


def _adopt_stderr(dup: Any) -> None:
    """In the worker: make the parent's stderr this process's fd 2."""
    if dup is None:
        return
    fd = dup.detach()
    if fd != 2:
        os.dup2(fd, 2)
        os.close(fd)


def _context(cold: bool) -> Any:
    """The multiprocessing context workers start in: ``spawn`` for a cold start, else the
    ``forkserver`` (started on first use with :mod:`slurm_etc.pool.preload`)."""
    if cold:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["slurm_etc.pool.preload"])  # no effect once it runs
    return ctx


def _stop_children() -> None:
    """Stop this worker's own child processes, by PID: megatron's checkpoint writer starts a
    multiprocessing Manager per process that would otherwise outlive the worker (and keep
    its stdout open)."""
    for child in multiprocessing.active_children():
        child.terminate()
    for child in multiprocessing.active_children():
        child.join(5.0)
        if child.is_alive():
            child.kill()
            child.join(5.0)


def _on_sigterm(signum: int, frame: Any) -> None:
    _stop_children()
    os._exit(128 + signum)


def _configure_logging(index: int, log_level: int) -> None:
    logging.basicConfig(level=log_level, format=f"[worker {index}] %(levelname)s %(name)s: "
                                                 "%(message)s")
    if log_level > logging.INFO:
        import warnings

        warnings.simplefilter("ignore")
        # megatron-core warns on every checkpoint (e.g. when a directory is reused); the
        # callers report their own outcome
        logging.getLogger("megatron").setLevel(logging.ERROR)


def _worker_main(index: int, size: int, port: int, conn: Connection, parent_pid: int,
                 preload: Sequence[str], timeout_s: float, log_level: int,
                 default_group: bool, secret: bytes, parent: tuple[dict, str, list, None]) -> None:
    """Entry point of one worker: import, join the store, then serve calls until told to stop.
    ``parent``: the parent's environment, working directory, ``sys.path`` and stderr at the
    start (a worker forked from the forkserver would otherwise have the server's)."""
    environ, cwd, path, _stderr = parent  # _stderr: fd 2 is the parent's (unpickling did it)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(WORKER_ENV)
    os.environ.update(gpu_env(environ, index, gpus=gpus_present()))  # worker i: GPU i
    os.chdir(cwd)
    sys.path[:] = path
    # Ctrl-C reaches the whole process group: let the parent decide when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    _configure_logging(index, log_level)
    import importlib

    import torch

    from slurm_etc.migrate import device
    from slurm_etc.protocol.store import StoreClient

    torch.set_num_threads(1)
    device.use(device.select())
    for module in preload:
        importlib.import_module(module)
    store = StoreClient("127.0.0.1", port, secret, timeout=timedelta(seconds=timeout_s))
    ctx = WorkerContext(index, size, store, timeout_s)
    if default_group:
        ctx.init_group(DEFAULT_GROUP_TAG, index, size)
    conn.send(("ready", os.getpid()))
    try:
        while True:
            message = conn.recv()
            if message is None:
                # Asked to stop: exit as a job's processes do when it ends, without tearing
                # anything down (the checkpoint baseline times this).
                _stop_children()
                conn.close()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            func, args, kwargs = message
            try:
                result = (func(index, size, *args, **kwargs) if default_group
                          else func(ctx, *args, **kwargs))
                # Pickle here, so an unpicklable result is reported like any other error.
                reply = ForkingPickler.dumps(("ok", result))
            except BaseException:  # noqa: BLE001 - everything goes back to the parent
                reply = ForkingPickler.dumps(("error", traceback.format_exc()))
            conn.send_bytes(reply)
    finally:
        try:
            ctx.drop()
        finally:
            _stop_children()
            conn.close()


# -- parent side ----------------------------------------------------------------------------

def _func_name(func: Callable) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


class LocalWorkers:
    """``size`` worker processes on this machine, reused for many calls.

    Args:
        size: number of workers; worker ``i`` plays device ``i``.
        preload: modules each worker imports at start-up (the cost of a cold start is paid
            there, not inside the first call).
        timeout_s: default bound of each call, and of the workers' process groups.
        log_level: logging level inside the workers (warnings are silenced above INFO).
        default_group: join every worker into one gloo default group at start-up, kept
            between calls, and call ``func(rank, world, ...)`` instead of ``func(ctx, ...)``.
        cold: spawn the workers (each pays a cold import) instead of forking them from the
            preloaded forkserver: for measuring what a fresh job's start costs.
    """

    def __init__(self, size: int, *, preload: Sequence[str] = (),
                 timeout_s: float = DEFAULT_TIMEOUT_S, log_level: int = logging.WARNING,
                 default_group: bool = False, cold: bool = False) -> None:
        if size < 1:
            raise ValueError(f"need at least one worker, got {size}")
        self.size = size
        self.preload = tuple(preload)
        self.timeout_s = timeout_s
        self.log_level = log_level
        self.default_group = default_group
        self.cold = cold
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._store: StoreServer | None = None
        self.start_seconds: float | None = None
        self.start_seconds_each: list[float] = []

    @property
    def pids(self) -> list[int]:
        """PIDs of the live workers, in worker order."""
        return [proc.pid for proc in self._procs if proc.pid is not None]

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, *, one_at_a_time: bool = False) -> float:
        """Start the workers; returns seconds until every one has imported and joined.

        ``one_at_a_time`` starts each worker only after the previous one is ready, so each
        cold start runs alone on the machine, as it would on a node with a core per
        process (the checkpoint baseline of ``bench migrate``). Either way
        ``start_seconds_each[i]`` is worker ``i``'s own time from its spawn to its ready
        message.

        A start-up in which a worker dies is retried (``START_ATTEMPTS`` in all), so one
        flaky start does not fail everything that follows; the seconds are the last
        attempt's.
        """
        if self._procs:
            raise RuntimeError(f"the {self.size} workers are already started")
        attempt = 1
        while True:
            try:
                self.start_seconds = self._spawn(one_at_a_time)
                return self.start_seconds
            except WorkerDied as exc:
                if attempt == START_ATTEMPTS:
                    raise
                attempt += 1
                logger.warning("%s; retrying the start-up (attempt %d of %d)", exc, attempt,
                               START_ATTEMPTS)

    def _spawn(self, one_at_a_time: bool = False) -> float:
        import secrets

        from slurm_etc.protocol.store import StoreServer

        t0 = time.perf_counter()
        secret = secrets.token_bytes(32)
        if self._store is not None:
            self._store.close()
        store = self._store = StoreServer(secret, "127.0.0.1", job="pool")
        mp = _context(self.cold)
        parent = (dict(os.environ), os.getcwd(), list(sys.path), _ParentStderr())
        spawned: list[float] = []
        ready: dict[int, float] = {}
        bound = max(self.timeout_s, START_TIMEOUT_S)
        try:
            for index in range(self.size):
                parent_conn, child_conn = mp.Pipe(duplex=True)
                proc = mp.Process(target=_worker_main, name=f"slurm-etc-worker-{index}",
                                  args=(index, self.size, store.port, child_conn,
                                        os.getpid(), self.preload, self.timeout_s,
                                        self.log_level, self.default_group, secret,
                                        parent))
                spawned.append(time.perf_counter())
                proc.start()
                child_conn.close()
                self._procs.append(proc)
                self._conns.append(parent_conn)
                if one_at_a_time:
                    self._collect("start-up", time.monotonic() + bound, indices=[index],
                                  arrived=ready)
            if not one_at_a_time:
                self._collect("start-up", time.monotonic() + bound, arrived=ready)
        except BaseException:
            self.close(graceful=False)
            raise
        seconds = time.perf_counter() - t0
        self.start_seconds_each = [ready[i] - spawned[i] for i in range(self.size)]
        logger.info("started %d workers in %.1f s%s", self.size, seconds,
                    " (one at a time)" if one_at_a_time else "")
        return seconds

    def close(self, graceful: bool = True) -> float:
        """Stop the workers: ask them to exit (if ``graceful``), then terminate, then kill,
        each by its PID; returns seconds.

        ``graceful=False`` skips the request, for workers that are stuck and would not read it.
        """
        t0 = time.perf_counter()
        if graceful:
            for conn in self._conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
            deadline = time.monotonic() + CLOSE_WAIT_S
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._store is not None:
            self._store.close()
        self._store = None
        return time.perf_counter() - t0

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(graceful=exc[0] is None)

    # -- calls -----------------------------------------------------------------------------

    def run(self, func: Callable, *args: Any, timeout_s: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``func`` on every worker; results in worker order.

        ``func(ctx, *args, **kwargs)``, or ``func(rank, world, *args, **kwargs)`` with
        ``default_group``. Starts the workers first if they are not running (first use, or
        stopped after a failure).

        Raises:
            TypeError: ``func`` or the arguments do not pickle (no worker was sent anything).
            WorkerError: a worker raised (the lowest failing index, with its traceback).
            WorkerTimeout: workers did not answer within ``timeout_s``.
            WorkerDied: a worker process exited.
        """
        if not self._procs:
            self.start()
        what = _func_name(func)
        # Pickle once, before sending anything: if it fails, no worker starts the call alone.
        try:
            message = ForkingPickler.dumps((func, args, kwargs))
        except Exception as exc:
            raise TypeError(f"cannot send {what} to the workers: {exc} (functions must be "
                            "defined at module level; arguments must pickle)") from exc
        for index, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:
                self._died(index, what)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return self._collect(what, time.monotonic() + timeout)

    def _collect(self, what: str, deadline: float, *, indices: Sequence[int] | None = None,
                 arrived: dict[int, float] | None = None) -> list[Any]:
        """Answers of ``indices`` (default: every worker), in that order; ``arrived`` gets
        each answer's arrival (``time.perf_counter()``)."""
        indices = list(range(len(self._conns))) if indices is None else list(indices)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = {self._conns[index]: index for index in indices}
        sentinels = {self._procs[index].sentinel: index for index in indices}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for obj in wait(list(pending) + list(sentinels), timeout=remaining):
                if obj in pending:
                    index = pending.pop(obj)
                    try:
                        status, payload = obj.recv()
                    except EOFError:
                        self._died(index, what)
                    if arrived is not None:
                        arrived[index] = time.perf_counter()
                    if status == "error":
                        errors[index] = payload
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                    else:
                        results[index] = payload
                elif obj in sentinels:
                    index = sentinels.pop(obj)
                    if index in pending.values():
                        self._died(index, what)
        missing = sorted(pending.values())
        if errors:
            index = min(errors)
            others = ""
            if missing:
                others = (f"; workers {missing} did not finish within {FAILURE_GRACE_S:.0f} s "
                          "after it")
                self._fail(dump=missing)
            elif len(errors) > 1:
                others = f"; workers {sorted(errors)} raised"
            raise WorkerError(index, what, errors[index], others)
        if missing:
            answered = sorted(results)
            self._fail(dump=missing)
            raise WorkerTimeout(f"workers {missing} did not answer {what} in time (answered: "
                                f"{answered}); their stacks are dumped on stderr above")
        return [results[index] for index in indices]

    def _died(self, index: int, what: str) -> NoReturn:
        proc = self._procs[index]
        proc.join(1.0)
        pid, code = proc.pid, proc.exitcode
        self._fail()
        raise WorkerDied(f"worker {index} (pid {pid}) exited with code {code} during {what}")

    def _fail(self, dump: Sequence[int] = ()) -> None:
        """Dump the stacks of stuck workers, then stop all; the next call starts new ones."""
        for index in dump:
            proc = self._procs[index]
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        if dump:
            time.sleep(1.0)
        logger.warning("stopping the %d workers after a failure; the next call starts new ones",
                       self.size)
        self.close(graceful=False)

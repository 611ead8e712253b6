"""A pool of gloo worker processes that tests reuse: start once, run many functions on all ranks.

Starting a worker costs seconds (importing torch and megatron-core takes about 5 s on two
cores), so a test module starts one :class:`WorkerPool` per world size (see
:func:`pool_fixture`) and runs each case as a function on every rank::

    from tests.dist.harness import pool_fixture

    pool4 = pool_fixture(4, preload=("megatron.core",))

    def _case(rank, world, cfg):          # module level, so it pickles by reference
        ...
        return {"loss": loss}

    def test_case(pool4):
        results = pool4.run(_case, cfg)   # [result of rank 0, result of rank 1, ...]

The workers import the function's module by name, with the parent's ``sys.path``: under
``python -m pytest`` from the repository root, ``tests.dist.<module>`` works.

Each worker has called ``torch.distributed.init_process_group("gloo")`` with the pool's world
size before it runs anything, and keeps that process group between calls. The function gets
``rank`` and ``world`` first, then the arguments given to :meth:`WorkerPool.run`; arguments and
results must pickle.

Failures are loud and leave no processes behind:

* a worker exception is re-raised in the test as :class:`WorkerError`, with the rank and the
  remote traceback;
* a call that does not finish within its timeout raises :class:`WorkerTimeout` naming the
  ranks that did not answer; those workers first dump their Python stacks to stderr
  (faulthandler), then the pool is shut down; a dead worker raises :class:`WorkerDied`;
* a function or arguments that do not pickle are refused before any rank starts;
* after a timeout, a worker death, or an exception on some ranks while others hang in a
  collective, the pool restarts its workers on the next call, so later tests still run;
* workers exit when the parent process goes away (a watchdog thread), and
  :meth:`WorkerPool.close` stops them by PID (terminate, then kill).

Workers are started with the ``spawn`` method (no inherited locks or torch state) and are not
daemonic, because ``dist_checkpointing.save`` starts a multiprocessing Manager inside them.
"""
from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn

import pytest

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
START_TIMEOUT_S = 120.0
START_ATTEMPTS = 3
# After one rank fails, the others get this long to finish before the pool is declared broken
# (they are usually blocked in a collective waiting for the failed rank).
FAILURE_GRACE_S = 5.0


class HarnessError(RuntimeError):
    """Base class of the errors the pool raises in the parent."""


class WorkerError(HarnessError):
    """A worker raised: carries the rank and the remote traceback."""

    def __init__(self, rank: int, func: str, remote_traceback: str, others: str = "") -> None:
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} raised in {func}{others}\n"
                         f"--- remote traceback (rank {rank}) ---\n{remote_traceback}")


class WorkerTimeout(HarnessError):
    """Some ranks did not answer within the timeout."""


class WorkerDied(HarnessError):
    """A worker process exited while the pool expected an answer."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _func_name(func: Callable) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker when its parent is gone (no orphans after a killed test run)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(1.0)


def _worker_main(rank: int, world: int, port: int, conn: Connection, parent_pid: int,
                 preload: Sequence[str], env: dict[str, str], timeout_s: float) -> None:
    """Entry point of one worker: init gloo, then serve calls until told to stop."""
    os.environ.update(env)
    # Ctrl-C reaches the whole process group: let the parent decide when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    for module in preload:
        importlib.import_module(module)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    conn.send(("ready", os.getpid()))
    try:
        while True:
            message = conn.recv()
            if message is None:
                break
            func, args, kwargs = message
            try:
                # Pickle here, so an unpicklable result is reported like any other error.
                reply = ForkingPickler.dumps(("ok", func(rank, world, *args, **kwargs)))
            except BaseException:  # noqa: BLE001 - everything goes back to the parent
                reply = ForkingPickler.dumps(("error", traceback.format_exc()))
            conn.send_bytes(reply)
    finally:
        dist.destroy_process_group()
        conn.close()


class WorkerPool:
    """``world`` worker processes in one gloo process group, reused across calls.

    Args:
        world: number of ranks (``init_process_group`` world size).
        preload: modules each worker imports at start-up (so the cost is paid once).
        env: extra environment variables of the workers.
        timeout_s: default per-call timeout.
    """

    def __init__(self, world: int, *, preload: Sequence[str] = (),
                 env: dict[str, str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.world = world
        self.preload = tuple(preload)
        self.env = {"OMP_NUM_THREADS": "1", **(env or {})}
        self.timeout_s = timeout_s
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._broken = True

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers and wait until every rank has joined the gloo group.

        The rendezvous port is picked free just before the start; if another process takes it
        meanwhile the workers die at start-up, so that is retried with a new port.
        """
        if self._procs:
            raise RuntimeError(f"the pool of {self.world} workers is already started")
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._spawn()
                return
            except WorkerDied:
                if attempt == START_ATTEMPTS:
                    raise
                logger.warning("gloo workers died at start-up (attempt %d of %d); retrying",
                               attempt, START_ATTEMPTS)

    def _spawn(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        for rank in range(self.world):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker_main, name=f"gloo-worker-{rank}",
                               args=(rank, self.world, port, child_conn, os.getpid(),
                                     self.preload, self.env, self.timeout_s))
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        started = time.monotonic()
        self._collect("start-up", started + START_TIMEOUT_S)
        self._broken = False
        logger.info("started %d gloo workers in %.1f s", self.world, time.monotonic() - started)

    def close(self, graceful: bool = True) -> None:
        """Stop the workers: ask them to exit (if ``graceful``), then terminate, then kill.

        Each worker is stopped by its PID; ``graceful=False`` skips the request, for workers
        that are stuck and would not read it.
        """
        if graceful:
            for conn in self._conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
            deadline = time.monotonic() + 10.0
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
        self._broken = True

    def __enter__(self) -> WorkerPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """PIDs of the live workers, in rank order."""
        return [proc.pid for proc in self._procs]

    # -- calls -----------------------------------------------------------------------------

    def run(self, func: Callable, *args: Any, timeout_s: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``func(rank, world, *args, **kwargs)`` on every rank; results in rank order.

        Raises:
            WorkerError: a rank raised (the first one to report, with its traceback).
            WorkerTimeout: ranks did not answer within ``timeout_s``.
            WorkerDied: a worker process exited.
        """
        if self._broken:
            self.start()
        what = _func_name(func)
        # Pickle once, before sending anything: if it fails, no rank starts the call alone.
        try:
            message = ForkingPickler.dumps((func, args, kwargs))
        except Exception as exc:
            raise TypeError(f"cannot send {what} to the workers: {exc} (functions must be "
                            "defined at module level; arguments must pickle)") from exc
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:
                self._died(rank, what)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return self._collect(what, time.monotonic() + timeout)

    def _collect(self, what: str, deadline: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = wait(list(pending) + list(sentinels), timeout=remaining)
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        status, payload = obj.recv()
                    except EOFError:
                        self._died(rank, what)
                    if status == "error":
                        errors[rank] = payload
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                    else:
                        results[rank] = payload
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    if rank in pending.values():
                        self._died(rank, what)
        missing = sorted(pending.values())
        if errors:
            rank = min(errors)
            others = ""
            if missing:
                others = f"; ranks {missing} did not finish within {FAILURE_GRACE_S:.0f} s after it"
                self._fail(dump=missing)
            elif len(errors) > 1:
                others = f"; ranks {sorted(errors)} raised"
            raise WorkerError(rank, what, errors[rank], others)
        if missing:
            answered = sorted(results)
            self._fail(dump=missing)
            raise WorkerTimeout(f"ranks {missing} did not answer {what} in time (answered: "
                                f"{answered}); their stacks are dumped on stderr above")
        return [results[rank] for rank in range(self.world)]

    def _died(self, rank: int, what: str) -> NoReturn:
        proc = self._procs[rank]
        proc.join(1.0)
        pid, code = proc.pid, proc.exitcode
        self._fail()
        raise WorkerDied(f"rank {rank} (pid {pid}) exited with code {code} during {what}")

    def _fail(self, dump: Sequence[int] = ()) -> None:
        """Dump the stacks of stuck ranks, then stop all workers; the next call restarts."""
        for rank in dump:
            proc = self._procs[rank]
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        if dump:
            time.sleep(1.0)
        logger.warning("stopping the %d gloo workers after a failure; the next call starts "
                       "new ones", self.world)
        self.close(graceful=False)


def pool_fixture(world: int, *, preload: Sequence[str] = (), timeout_s: float = DEFAULT_TIMEOUT_S,
                 name: str | None = None) -> Callable[..., Iterator[WorkerPool]]:
    """A module-scoped pytest fixture yielding a started :class:`WorkerPool` of ``world`` ranks.

    Assign it at module level, e.g. ``pool4 = pool_fixture(4)``; the fixture's name is the
    variable's name unless ``name`` is given.
    """

    @pytest.fixture(scope="module", name=name)
    def _pool() -> Iterator[WorkerPool]:
        pool = WorkerPool(world, preload=preload, timeout_s=timeout_s)
        try:
            pool.start()
            yield pool
        finally:
            pool.close()

    return _pool

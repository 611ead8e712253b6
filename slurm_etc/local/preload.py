"""Worker processes forked from a process that imported torch and megatron-core once.

A worker's cold start is mostly imports (torch, megatron-core: 4-6 s of CPU each, 10-25 s
for the joiners of a grow on a busy 2-core machine). The local backend starts one
*preloader* beside the coordinator (``python -m slurm_etc.local.preload``): it imports
:data:`PRELOAD`, collects and freezes its heap, and then forks one child per launch that
runs the worker command as ``python`` would (``-m module`` or a script path, ``sys.argv``,
the environment, the working directory, stdout and stderr to the worker's log, a session of
its own). The preloader reaps its children and reports each exit status; the coordinator
sees each as a :class:`ForkedProcess` (the subset of ``Popen`` the backend uses). A child's
process title (``ps``, ``top``) is its worker command (``setproctitle``); its
``/proc/<pid>/environ`` is the preloader's, without the job's ``SLURM_ETC_*`` variables,
which the child has in ``os.environ``.

A command is forked only when a fresh interpreter would start it the same way: the same
``python`` as the preloader's, no interpreter options, and the same start-up environment
(``PYTHON*``, ``LD_*``, the thread counts, ...); anything else is started with ``Popen``.
The coordinator and its preloader speak over a socket pair (``multiprocessing``'s
framing, msgpack messages; nothing is unpickled). When the coordinator dies the preloader
exits and leaves its children running (a restarted coordinator adopts them, as it adopts
any worker it did not start).

Not the test pool's ``forkserver`` (:mod:`slurm_etc.pool.preload`): that one runs Python
functions through multiprocessing (pickled), and pins one thread per process at import; a
worker here is the user's command line, with the job's environment.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection, wait

import msgspec

from ..coordinator.processes import PolledProcess

logger = logging.getLogger(__name__)

# What a worker imports before it trains (the warm-up's list too, worker/resizing.py).
PRELOAD: tuple[str, ...] = (
    "torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
    "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.pipeline_parallel",
    "megatron.core.optimizer_param_scheduler", "slurm_etc.worker.entry",
    "slurm_etc.worker.trainer", "slurm_etc.worker.gpt",
    "slurm_etc.megatron.resize", "slurm_etc.megatron.world", "slurm_etc.migrate.executor",
    "slurm_etc.migrate.group", "slurm_etc.migrate.program")
# Environment read when an interpreter (or a library it loads) starts: a launch forks only
# where these equal the preloader's.
STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "MALLOC_",
                    "CUDA_", "VIRTUAL_ENV")
# How long a launch waits for the preloader's imports before it starts a process of its own.
READY_WAIT_S = 60.0


class Ready(msgspec.Struct, tag=True):
    pid: int
    seconds: float


class Unusable(msgspec.Struct, tag=True):
    why: str


class Launch(msgspec.Struct, tag=True):
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log: str | None


class Launched(msgspec.Struct, tag=True):
    pid: int


class Failed(msgspec.Struct, tag=True):
    why: str


class Ended(msgspec.Struct, tag=True):
    pid: int
    code: int


_Message = Ready | Unusable | Launch | Launched | Failed | Ended
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Message)


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


def forkable(argv: Sequence[str], env: Mapping[str, str], preloaded_env: Mapping[str, str]
             ) -> bool:
    """Whether ``argv`` run with ``env`` starts as a child of the preloader would: this
    ``python``, then ``-m module`` or a script path, and the same start-up environment."""
    if len(argv) < 2 or not this_python(argv[0], env.get("PATH")):
        return False
    if argv[1] == "-m":
        if len(argv) < 3 or not argv[2] or argv[2].startswith("-"):
            return False
    elif argv[1].startswith("-") or not argv[1].endswith(".py"):
        return False
    return startup_env(env) == startup_env(preloaded_env)


def this_python(program: str, path: str | None = None) -> bool:
    """Whether ``program`` (a path, or a name looked up in ``path``) starts this interpreter
    with this environment: ``sys.executable`` itself, or another name for it in the same
    directory (a venv's ``bin/python`` beside the ``bin/python3.11`` its console scripts
    name). Another directory is another environment (a venv's site-packages come from where
    the interpreter was started, not from the file it links to)."""
    found = program if os.sep in program else shutil.which(program, path=path)
    if not found:
        return False
    mine, theirs = os.path.abspath(sys.executable), os.path.abspath(found)
    return theirs == mine or (os.path.dirname(theirs) == os.path.dirname(mine)
                              and os.path.realpath(theirs) == os.path.realpath(mine))


class ForkedProcess(PolledProcess):
    """A worker forked by the preloader; its exit status comes from the preloader, which
    reaped it (its process group killed first, as for a child)."""

    def __init__(self, pid: int, preloader: Preloader) -> None:
        super().__init__(pid)
        self._preloader = preloader

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._preloader.exit_code(self.pid)
        return self.returncode


class Preloader:
    """The coordinator's side: starts the preloader with ``env`` (the workers' common
    environment), forks workers through it, and learns their exit statuses."""

    def __init__(self, env: Mapping[str, str], log: str | None = None) -> None:
        # none of the job's own variables (a child's /proc/<pid>/environ is this one's)
        self.env = {k: v for k, v in env.items() if not k.startswith("SLURM_ETC_")}
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        self._ready: bool | None = None
        self._ended: dict[int, int] = {}
        self._pending: list[_Message] = []
        fd = theirs.fileno()
        out = (os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
                       | os.O_CLOEXEC, 0o600) if log is not None else subprocess.DEVNULL)
        # a worker launched without a log of its own writes where a cold one would: to
        # this process's stdout and stderr (their copies travel to the preloader for that)
        stdio = () if log is not None else (os.dup(1), os.dup(2))
        argv = [sys.executable, "-m", "slurm_etc.local.preload", str(fd)]
        if stdio:
            argv.append(",".join(map(str, stdio)))
        try:  # its own output (the imports' warnings) to its log, not the coordinator's
            self._proc = subprocess.Popen(
                argv, env=self.env,
                pass_fds=(fd, *stdio), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            theirs.close()
            for std in stdio:
                os.close(std)
            if log is not None:
                os.close(out)

    def _receive(self, timeout_s: float) -> bool:
        """Take one message (waiting up to ``timeout_s``); False on none or a closed pipe."""
        try:
            if not wait([self._conn], timeout_s):
                return False
            msg = _DECODER.decode(self._conn.recv_bytes())
        except (EOFError, OSError, msgspec.DecodeError):
            self._ready = False
            return False
        if isinstance(msg, Ended):
            self._ended[msg.pid] = msg.code
        elif isinstance(msg, Ready):
            self._ready = True
            logger.info("[local] workers fork from a preloaded process (pid %d, imports %.1f "
                        "s once)", msg.pid, msg.seconds)
        elif isinstance(msg, Unusable):
            self._ready = False
            logger.info("[local] workers start on their own: %s", msg.why)
        else:
            self._pending.append(msg)
        return True

    def usable(self, wait_s: float = READY_WAIT_S) -> bool:
        until = time.monotonic() + wait_s
        while self._ready is None and time.monotonic() < until:
            self._receive(max(0.0, until - time.monotonic()))
        return bool(self._ready)

    def launch(self, argv: Sequence[str], env: Mapping[str, str], log: str | None
               ) -> ForkedProcess | None:
        """Fork ``argv``; None where the preloader cannot (the caller starts it itself)."""
        if not self.usable():
            return None
        try:
            self._conn.send_bytes(_ENCODER.encode(Launch(list(argv), dict(env), os.getcwd(),
                                                         log)))
        except OSError:
            self._ready = False
            return None
        until = time.monotonic() + 30.0
        while time.monotonic() < until:
            if self._pending:
                reply = self._pending.pop(0)
                if isinstance(reply, Launched):
                    return ForkedProcess(reply.pid, self)
                logger.warning("[local] the preloader could not fork: %s",
                               getattr(reply, "why", reply))
                return None
            if not self._receive(until - time.monotonic()) and self._ready is False:
                return None
        self._ready = False
        return None

    def exit_code(self, pid: int) -> int | None:
        while self._ready is not False and self._receive(0.0):
            pass
        return self._ended.get(pid)

    def close(self) -> None:
        """End the preloader (after the workers ended: it reaps them)."""
        self._conn.close()
        try:
            self._proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


# -- the preloader process -------------------------------------------------------------------

def _threads_of_this_process() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


# The coordinator's stdout and stderr (descriptors of this preloader), where a worker launched
# without a log writes; empty: the coordinator gave each worker a log
_STDIO: tuple[int, ...] = ()


def _run_child(req: Launch) -> int:
    """In the forked child: become the worker ``req`` names; its exit status."""
    import runpy
    import threading
    import traceback

    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    if req.log is not None:
        out = os.open(req.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
    elif _STDIO:  # no log: the coordinator's stdout and stderr, as a cold worker's
        os.dup2(_STDIO[0], 1)
        os.dup2(_STDIO[1], 2)
    for std in _STDIO:
        os.close(std)
    os.close(null)
    import shlex

    import setproctitle  # imported by the preloader already: argv's memory is its own

    setproctitle.setproctitle(shlex.join(req.argv))  # what ps and top show: the worker
    os.environ.clear()
    os.environ.update(req.env)
    os.chdir(req.cwd)
    threads = req.env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    code = 0
    try:
        if req.argv[1] == "-m":
            sys.argv = [req.argv[2], *req.argv[3:]]
            sys.path[0] = req.cwd
            runpy.run_module(req.argv[2], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(req.argv[1])
            sys.argv = [req.argv[1], *req.argv[2:]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, status 1
        traceback.print_exc()
        code = 1
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()  # non-daemon threads are joined, as at an interpreter's exit
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _reap(children: set[int], conn: Connection) -> None:
    """Report the children that ended; their process groups are killed before they are
    reaped (what they spawned dies with them while their pid is not reused)."""
    while children:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        try:
            os.killpg(info.si_pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _pid, status = os.waitpid(info.si_pid, 0)
        children.discard(info.si_pid)
        try:
            conn.send_bytes(_ENCODER.encode(Ended(info.si_pid,
                                                  os.waitstatus_to_exitcode(status))))
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    import gc
    import importlib

    global _STDIO
    args = sys.argv[1:] if argv is None else argv
    conn = Connection(int(args[0]))
    if len(args) > 1:  # the coordinator's stdout and stderr, for workers without a log
        _STDIO = tuple(int(x) for x in args[1].split(","))
    t0 = time.perf_counter()
    try:
        for name in (*PRELOAD, "setproctitle"):
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - said to the coordinator, which starts its own
        conn.send_bytes(_ENCODER.encode(Unusable(f"the preloader cannot import: {e}")))
        return 1
    if _threads_of_this_process() > 1:  # a fork would copy a thread's locks, not the thread
        conn.send_bytes(_ENCODER.encode(Unusable(
            f"the preloader runs {_threads_of_this_process()} threads after its imports")))
        return 1
    gc.collect()
    gc.freeze()
    conn.send_bytes(_ENCODER.encode(Ready(os.getpid(), time.perf_counter() - t0)))
    children: set[int] = set()
    while True:
        _reap(children, conn)
        try:
            if not conn.poll(0.02):
                continue
            req = _DECODER.decode(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the coordinator is gone: its workers live on (a restart adopts them)
        if not isinstance(req, Launch):
            continue
        try:
            pid = os.fork()
        except OSError as e:
            conn.send_bytes(_ENCODER.encode(Failed(f"fork: {e.strerror}")))
            continue
        if pid == 0:
            code = 1
            try:
                conn.close()
                code = _run_child(req)
                if code < 0:  # ended by a signal, as an interpreter interrupted would
                    signal.signal(-code, signal.SIG_DFL)
                    os.kill(os.getpid(), -code)
            finally:
                os._exit(code & 0xFF if code >= 0 else 128 - code)
        children.add(pid)
        conn.send_bytes(_ENCODER.encode(Launched(pid)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

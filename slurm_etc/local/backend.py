"""The local backend: workers as processes on this machine, grouped into simulated nodes,
with resource events from a script (:mod:`slurm_etc.local.script`).

It implements :class:`~slurm_etc.coordinator.backend.Backend`. ``launch`` starts one process
per worker (``subprocess.Popen`` of the launch's argv, in a session of its own, with the
worker's environment); ``stop`` sends SIGTERM to the worker's process group and SIGKILL after
the grace; a loss (a scripted failure, or a preemption deadline passing while the devices are
still held) and a release of devices kill the workers on them, as Slurm would. Nothing blocks:
signals are escalated and exits reaped in :meth:`LocalBackend.poll`. The escalation and the
reports are the :class:`~slurm_etc.coordinator.supervisor.WorkerSupervisor`'s, the same as the
Slurm backend's; this backend is its mechanism (the ``do_*`` methods: signal, kill, poll one
process group).

The simulated cluster outlives its coordinator, as a Slurm cluster does: with
:meth:`LocalBackend.keep_state` (``run_job`` passes a file beside the job's record) its state
is written after every change, and a coordinator restarted on the job takes it up: the
devices granted before the kill (a grow's joiners run there) are held again and their
workers adopted (:meth:`LocalBackend.adopt`), the script goes on from where it was.

How the coordinator's loop drives it (the loop stays in control; the backend never calls
back)::

    backend = LocalBackend(load_script("events.json"), log_dir=run_dir / "workers")
    try:
        while running:
            for event in backend.poll():       # Grant a0 (the anchor) comes first
                ...
            backend.on_step(latest_progress_step)   # scripted events due by then fire
            ...                                     # perform(backend, action)
    finally:
        backend.close()                      # stops every worker still running
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

from slurm_etc import bounds
from slurm_etc.alloc.topology import ClusterTopology, Device
from slurm_etc.store.location import private_dir

from ..coordinator.backend import (
    BackendDefaults,
    BackendError,
    BackendEvent,
    CancelRequest,
    LaunchWorkers,
    Loss,
    ReleaseDevices,
    RequestNodes,
    StopWorkers,
    WorkerState,
)
from ..coordinator.processes import AdoptedProcess, PolledProcess, process_start
from ..coordinator.supervisor import Supervised, WorkerSupervisor
from ..protocol import env as envvars
from ..protocol.gpus import gpu_env, gpus_present
from .preload import ForkedProcess, Preloader, forkable
from .script import EventsScript, ScriptedEvent, ScriptedResources

logger = logging.getLogger(__name__)

# How long close() waits after SIGTERM before it kills.
CLOSE_GRACE_S = 5.0
# How long a launch waits for a killed process whose vrank it reuses.
STOPPING_WAIT_S = 10.0


@dataclass
class _Process:
    """The supervisor's handle on one local worker: its process and its log."""

    proc: subprocess.Popen[bytes] | AdoptedProcess | ForkedProcess
    log: IO[bytes] | None


_Worker = Supervised[_Process]


class LocalBackend(BackendDefaults):
    """Processes on this machine, devices of simulated nodes, events from a script.

    Args:
        script: the validated events script (cluster size, anchor, events).
        log_dir: each worker's stdout and stderr go to ``<log_dir>/gen<G>-vrank<R>.log``
            (appended); None: inherited from the coordinator.
        clock: unix seconds (preemption deadlines); injectable for tests.
        preload: workers that are ``python -m module`` or ``python script.py`` fork from a
            process that imported torch and megatron-core once (:mod:`.preload`; started at
            the first launch), instead of importing them each.
    """

    def __init__(self, script: EventsScript, *, log_dir: Path | None = None,
                 clock: Callable[[], float] = time.time, preload: bool = False) -> None:
        self.script = script
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._clock = clock
        self._preload = preload
        self._preloader: Preloader | None = None
        self._resources = ScriptedResources(script)
        # stop -> grace -> kill -> report; this backend's do_* hooks are the mechanism
        self._workers: WorkerSupervisor[_Process] = WorkerSupervisor(self, name="[local]")
        self._events: list[BackendEvent] = []
        self._closed = False
        self._threads_said = False
        self._state_file: Path | None = None  # keep_state
        self._saved = -1  # the resources' version written there last
        self._save_failed = False  # the last write failed (said once; retried each second)
        self._save_retry_at = 0.0
        self._take_events()  # the anchor's Grant comes first

    def __enter__(self) -> "LocalBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def topology(self) -> ClusterTopology:
        return self.script.topology

    @property
    def held(self) -> Mapping[Device, str]:
        """Devices the job holds now, with their allocation."""
        return self._resources.held

    @property
    def unfired(self) -> tuple[ScriptedEvent, ...]:
        """The script's events that have not fired (the job ended before them)."""
        return self._resources.unfired

    # -- Backend ----------------------------------------------------------------------
    def poll(self) -> list[BackendEvent]:
        """Events since the last call: scripted ones, deadline losses, granted requests and
        worker exits; escalates stops past their grace. Never blocks."""
        now = self._clock()
        self._resources.tick(now)
        self._take_events()
        self._reap(now)
        out, self._events = self._events, []
        self._save()
        return out

    def on_step(self, step: int) -> None:
        """The job reached ``step``: scripted events due by then fire (a loss kills the
        workers on the lost devices at once)."""
        self._resources.on_step(step, self._clock())
        self._take_events()
        self._save()

    def request(self, action: RequestNodes) -> None:
        self._resources.request(action.key, action.nodes)
        self._save()
        logger.info("[local] request %s for %d node(s)%s", action.key, action.nodes,
                    f": {action.reason}" if action.reason else "")

    def cancel_request(self, action: CancelRequest) -> None:
        """A request of the scripted cluster not granted yet is dropped."""
        if self._resources.withdraw(action.key):
            self._save()
            logger.info("[local] withdrew request %s%s", action.key,
                        f": {action.reason}" if action.reason else "")

    def request_can_be_met(self, key: str) -> bool:
        """Whether the scripted cluster can still grant the pending request ``key`` while
        the job trains nothing: only where it grants requests (``grant_requests``) and
        enough whole nodes are free (scripted grants fire at training steps, and gone
        nodes never come back)."""
        nodes = dict(self._resources.pending_requests).get(key)
        return bool(nodes and self.script.grant_requests
                    and len(self._resources.free_nodes()) >= nodes)

    def release(self, action: ReleaseDevices) -> None:
        released = self._resources.release(action.devices)
        self._save()
        for w in self._running_on(set(released)):
            logger.warning("[local] vrank %d still runs on released device %s",
                           w.vrank, w.state.device)
            self._workers.kill(w, self._clock(), "released")
        if released:
            logger.info("[local] released %s%s", ",".join(str(d) for d in released),
                        f": {action.reason}" if action.reason else "")

    def launch(self, action: LaunchWorkers) -> None:
        self._reap(self._clock())  # a worker that ended is reported before it is replaced
        # a process being stopped on a device or under a vrank this launch uses (a joiner of
        # an aborted resize, a worker that left the job, one on a released or lost device):
        # let it end first (its stop's grace runs out into SIGKILL meanwhile)
        wanted = {spec.device for spec in action.workers}
        vranks = {spec.vrank for spec in action.workers}
        for w in self._workers.all():
            if not w.reported and w.state.stopping and (
                    w.state.device in wanted or w.state.vrank in vranks):
                self._wait_end(w, STOPPING_WAIT_S)
        held = self._resources.held
        busy = {w.state.device: w.state.vrank for w in self._workers.all()
                if not w.reported}
        todo = []
        for spec in action.workers:
            current = self._workers.get(spec.vrank)
            if current is not None and not current.reported:
                if current.state.device != spec.device:
                    raise BackendError(f"launch of vrank {spec.vrank} on {spec.device}: it "
                                       f"already runs on {current.state.device} "
                                       f"(pid {current.handle.proc.pid})")
                if current.state.generation != action.generation:
                    # never taken for the new process: that one would never start
                    raise BackendError(f"launch of vrank {spec.vrank} (generation "
                                       f"{action.generation}) on {spec.device}: its process "
                                       f"of generation {current.state.generation} (pid "
                                       f"{current.handle.proc.pid}) still runs; stop it first")
                continue  # the same launch again (a retried action): a no-op
            if spec.device not in held:
                raise BackendError(f"launch of vrank {spec.vrank} on {spec.device}: the job "
                                   f"does not hold {spec.device} "
                                   f"(held: {','.join(str(d) for d in held) or 'nothing'})")
            if spec.device in busy:
                raise BackendError(f"launch of vrank {spec.vrank} on {spec.device}: vrank "
                                   f"{busy[spec.device]} runs there")
            todo.append(spec)
        threads = self._threads()
        gpus = gpus_present()  # one GPU per worker where the node has them, as Slurm gives
        for spec in todo:
            env = {**os.environ, **threads, **action.env, **spec.env,
                   **gpu_env(os.environ, spec.device.local, gpus=gpus),
                   envvars.VRANK: str(spec.vrank), envvars.GENERATION: str(action.generation),
                   envvars.NODE: spec.device.node, envvars.LOCAL_INDEX: str(spec.device.local),
                   envvars.DEVICE: str(spec.device)}
            log: IO[bytes] | None = None
            log_path = None
            if self.log_dir is not None:
                # owner-only: a worker's output may name paths, hosts and data of the job
                private_dir(self.log_dir)
                log_path = self.log_dir / f"gen{action.generation}-vrank{spec.vrank}.log"
            proc: subprocess.Popen[bytes] | ForkedProcess | None = self._fork(
                action.argv, env, log_path, {**os.environ, **threads, **action.env})
            if proc is None:
                if log_path is not None:
                    log = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND
                                            | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "ab")
                try:
                    proc = subprocess.Popen(list(action.argv), env=env,
                                            stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT if log else None,
                                            start_new_session=True)
                except OSError as e:
                    if log is not None:
                        log.close()
                    raise BackendError(f"launch of vrank {spec.vrank}: cannot start "
                                       f"{action.argv[0]!r}: {e.strerror}") from None
            state = WorkerState(spec.vrank, action.generation, spec.device, proc.pid,
                                start=process_start(proc.pid))
            self._workers.add(state, _Process(proc, log))
            logger.info("[local] launched vrank %d (gen %d) on %s: pid %d", spec.vrank,
                        action.generation, spec.device, proc.pid)

    def stop(self, action: StopWorkers) -> None:
        self._workers.stop(action.vranks, self._clock(), action.grace_s, action.reason)

    def workers(self) -> Mapping[int, WorkerState]:
        return self._workers.states()

    def adopt(self, recorded: Sequence[WorkerState]) -> list[int]:
        """Take up the worker processes an earlier coordinator of this job started (from
        the record: vrank, generation, device, pid and start time), those still running on
        a device this backend holds; returns their vranks. A pid alive with another start
        time is another process (the pid was reused) and is left alone. They are stopped,
        killed and reported as ended like the workers this backend starts (an ended one with
        ``UNKNOWN_EXIT``: it is not this process's child)."""
        held = self._resources.held
        out = []
        for w in recorded:
            current = self._workers.get(w.vrank)
            if current is not None and not current.reported:
                continue
            if w.start is None or w.device not in held or process_start(w.pid) != w.start:
                continue
            state = replace(w, returncode=None, stopping=False)
            self._workers.add(state, _Process(AdoptedProcess(w.pid, w.start), None))
            out.append(w.vrank)
            logger.info("[local] adopted vrank %d (gen %d) on %s: pid %d", w.vrank,
                        w.generation, w.device, w.pid)
        return out

    def keep_state(self, path: Path, *, resume: bool) -> None:
        """Keep the simulated cluster's state in ``path`` (owner-only; rewritten whole after
        every change), from now on. ``resume``: a coordinator restarted on the job takes up
        the state kept there by the one before it (what it was granted, what is gone or
        under notice, pending requests, how far the script played), in place of the fresh
        cluster this backend started with; a file missing, of another script, or
        unreadable is one warning, and the cluster starts afresh. Called before the first
        :meth:`poll` (the restored grants are its first events) and before :meth:`adopt`
        (whose workers run on the devices held)."""
        self._state_file = Path(path)
        if resume:
            try:
                kept = json.loads(bounds.read_capped(path))
                if not isinstance(kept, dict):
                    raise ValueError("it is not a JSON object")
                self._resources.resume(kept)
            except FileNotFoundError:
                logger.warning("[local] no cluster state kept at %s: the scripted cluster "
                               "starts afresh (what the job was granted is not held)", path)
            except (OSError, ValueError, bounds.BoundError) as e:
                logger.warning("[local] the cluster state kept at %s is not taken up (%s): "
                               "the scripted cluster starts afresh", path,
                               getattr(e, "strerror", None) or e)
            else:
                self._events = []  # the fresh anchor's Grant: announced again with the rest
                logger.info("[local] took up the cluster kept at %s: holding %s", path,
                            ",".join(str(d) for d in self._resources.held) or "nothing")
        self._saved = -1
        self._save()

    def close(self) -> None:
        """Stop every worker still running: SIGTERM, then SIGKILL after CLOSE_GRACE_S."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers.close(self._clock(), CLOSE_GRACE_S, linger_s=CLOSE_GRACE_S):
            logger.error("[local] vrank %d (pid %d) survived SIGKILL", w.vrank,
                         w.handle.proc.pid)
        for w in self._workers.all():
            if w.handle.log is not None and not w.handle.log.closed:
                w.handle.log.close()
        if self._preloader is not None:
            self._preloader.close()

    # -- internals --------------------------------------------------------------------
    def _save(self) -> None:
        """Write the cluster's state where :meth:`keep_state` said, if it changed since the
        last write (a new file renamed over the old: a kill mid-write leaves the old one); a
        write that fails (a full disk) is one warning, and tried again a second later."""
        path = self._state_file
        if path is None or self._resources.version == self._saved or (
                self._save_failed and time.monotonic() < self._save_retry_at):
            return
        data = json.dumps(self._resources.state(), separators=(",", ":")).encode()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            # training goes on (as the record's writes wait out a full disk); written at the
            # next try once there is room; a restart meanwhile takes up the last one kept
            if not self._save_failed:
                logger.warning("[local] cannot keep the cluster's state in %s (%s): a "
                               "coordinator restarted now would not hold what the job was "
                               "granted since; trying again each second", path, e.strerror)
            self._save_failed, self._save_retry_at = True, time.monotonic() + 1.0
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return
        if self._save_failed:
            logger.info("[local] the cluster's state is kept in %s again", path)
        self._save_failed = False
        self._saved = self._resources.version

    def _fork(self, argv: Sequence[str], env: Mapping[str, str], log: Path | None,
              common: Mapping[str, str]) -> ForkedProcess | None:
        """The worker forked from the preloader, where it can be (else None); ``common``:
        the environment the preloader starts with (the first launch's, less the worker's
        own variables)."""
        if not self._preload:
            return None
        if self._preloader is None:
            self._preloader = Preloader(common, str(self.log_dir / "preload.log")
                                        if self.log_dir is not None else None)
        if not forkable(argv, env, self._preloader.env):
            return None
        return self._preloader.launch(argv, env, str(log) if log is not None else None)

    def _threads(self) -> dict[str, str]:
        """OMP_NUM_THREADS for the workers (said once): every simulated node is this
        machine, so its cores are shared by every device of the cluster."""
        cores = envvars.node_cores({})  # Slurm's count, if any, is not this cluster's
        devices = self.topology.gpus_per_node * len(self.topology.nodes)
        threads = envvars.thread_share(os.environ, cores, devices)
        if not self._threads_said:
            self._threads_said = True
            if threads:
                logger.info("[local] workers get %s=%s (%d cores of this machine / %d "
                            "devices of the cluster; set it to choose)", envvars.THREADS,
                            threads[envvars.THREADS], cores, devices)
            else:
                logger.info("[local] workers keep %s=%s from this environment",
                            envvars.THREADS, os.environ[envvars.THREADS])
        return threads

    def _wait_end(self, w: _Worker, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a stopping worker to end, escalating to SIGKILL when
        its grace runs out (as :meth:`poll` would)."""
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            self._reap(self._clock())  # the group is killed before the leader is reaped
            if w.reported:
                return
            time.sleep(0.02)

    def _reap(self, now: float) -> None:
        """Report workers that ended; SIGKILL those whose stop grace ran out."""
        self._events += self._workers.sweep(now)

    def _take_events(self) -> None:
        for event in self._resources.drain():
            if isinstance(event, Loss):
                for w in self._running_on(set(event.devices)):
                    self._workers.kill(w, self._clock(),
                                       f"{w.state.device} lost ({event.cause})")
            self._events.append(event)

    def _running_on(self, devices: set[Device]) -> list[_Worker]:
        return [w for w in self._workers.all()
                if w.state.device in devices and self._workers.alive(w)]

    # -- the supervisor's mechanism (slurm_etc.coordinator.supervisor) ----------------------
    def do_exit_status(self, w: _Worker) -> int | None:
        """The worker's exit status once it ended (reaped here), None while it runs.

        Its process group is killed before the leader is reaped, so that children it left
        behind die with it while its pid cannot have been reused."""
        proc = w.handle.proc
        if proc.returncode is not None:
            return proc.returncode
        if isinstance(proc, PolledProcess):
            return proc.poll()
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already
            return proc.poll()
        if info is None:
            return None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return proc.wait()

    def do_stop(self, w: _Worker) -> None:
        self._signal(w, signal.SIGTERM)

    def do_kill(self, w: _Worker) -> None:
        self._signal(w, signal.SIGKILL)

    def do_backstop(self, w: _Worker) -> None:
        """Never due (no backstop: a SIGKILL to the process group is final)."""

    def do_ended(self, w: _Worker) -> None:
        if w.handle.log is not None:
            w.handle.log.close()
        logger.info("[local] vrank %d (gen %d, pid %d) exited with %d", w.vrank,
                    w.state.generation, w.handle.proc.pid, w.state.returncode)

    def do_describe(self, w: _Worker) -> str:
        return f"pid {w.handle.proc.pid}"

    @staticmethod
    def _signal(w: _Worker, sig: signal.Signals) -> None:
        """Signal the worker's process group (its session, started by us), while its leader
        has not been reaped (so the group id is still ours)."""
        proc = w.handle.proc
        if proc.returncode is not None or (isinstance(proc, PolledProcess)
                                           and proc.poll() is not None):
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            # no group of its own yet: a child forked a moment ago, before its setsid (soak
            # seed 104: a joiner killed 0.3 s after its launch lived on, and its vrank's next
            # launch was refused); the process itself, which has spawned nothing yet
            try:
                os.kill(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        except PermissionError:
            pass


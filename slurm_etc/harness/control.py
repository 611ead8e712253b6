"""``slurm-etc bench control``: the control path of one job at N ranks, the coordinator real,
the ranks simulated.

**Real** (the code a job runs): the coordinator (:class:`~slurm_etc.coordinator.loop.
Coordinator`, its reconcile loop, policy, vrank allocator and planner), its SQLite record,
the control channel (CURVE, HMAC envelopes, libzmq's heartbeats), the rendezvous store it
hosts, and on the ranks' side the worker's end of both: every simulated rank holds its own
:class:`~slurm_etc.protocol.channel.WorkerChannel` and its own
:class:`~slurm_etc.protocol.store.StoreClient`, says what a worker says (Hello, ModelBuilt,
Progress from rank 0, Ready, Resized, Resumed, Exited) as the messages of
:mod:`slurm_etc.protocol.messages`, and decides each step boundary as the trainer does
(:meth:`ElasticTrainer._agree`): nothing asked of the store while the last step's gate says
no rank holds an order, else O(1) requests a rank (propose, count in, wait for the decision,
which the wake key naming the dead ends at once).

**Simulated**: the cluster (a backend of N/8 nodes of 8 devices, plus an eighth more for the
grow, whose grants, preemption notice and node loss come at scripted points); the workers'
processes (ranks are threads, up to ``ranks_per_host`` of them in each of several host
processes, all sharing one zmq context per process); training (a step is a sleep of
``step_s``); the collectives among ranks. Those that bear on the control path
run on a *fabric* (a process of their own that sums what the hosts send, one message a host
a step): the step's loss all-reduce, which carries the gate, the step agreement's
collectives after an open gate (the extremes of the key of the order each rank holds, and
the newest given to every rank), a resize's migration group (a barrier of the old survivors
and the joiners, standing for its rendezvous and data phase), the share of its commit
decision, and the new layout's first step finding its widest gap and stall (only those ranks
send Resumed, each for all). A rank killed fails its generation's collectives there, as
gloo's closed connection fails its peers'. A rank's wait in them is not control time
(``gate_wait_ms`` apart). The data phase itself, the new world's groups and the commit
vote's all-gather cost nothing here, and the resize times exclude them. Of a resize the
ranks do what goes through the coordinator's store: old rank 0 publishes the trainer state
and when its last step ended, joiners wait for it, the new layout's first rank asks the
commit decision (compare-and-set, :class:`~slurm_etc.migrate.decision.CommitDecision`) and
shares it with the others, then each reports.
Resizes are not prepared beside training (the agreed step carries it out). The ranks, their
host processes and the fabric are :mod:`slurm_etc.harness.control_ranks`.

What the machine limits: on 2 cores the ranks' threads, the coordinator and its store share
the CPUs. The ranks' host processes run at the idle scheduling class, so the coordinator
gets the CPU it asks for (on a cluster the ranks are on other nodes) and its figures (its
own process) are what a coordinator node pays for a job of that size; a rank's
``step_control_ms`` is what it pays itself (its thread's CPU at a boundary that asks
nobody anything), and ``step_control_wall_ms`` the clock's view with the CPU the other
simulated ranks took meanwhile. A coordinator holds one connection per rank (the channel,
which carries the store): the open-file limit (:func:`descriptor_problem`) bounds N.
Starting is not measured and is slower than on a cluster: each host admits a few ranks at
a time to the join (``control_ranks.JOINS_IN_FLIGHT``; 16,384 ranks join in a queue of
minutes, so the bench gives the coordinator a join timeout that grows with N,
:attr:`ControlBench.join_s`, where the product's default is 300 s), and ranks launched
with the job meet in a simulated world rendezvous before their first step. The hosts'
channels wait in slices of ``control_ranks.RANK_SOCKET_SLICE_S`` (a real worker's reads
its socket every 20-100 ms; a reply or an order ends a wait at once either way), and their
ranks are greenlets (gevent), which one OS thread a host runs in turn. What the
figures cannot show here: the coordinator's network (all connections are loopback), the
per-rank cost of a real process (an interpreter, CUDA, NCCL), and, at 16,384 ranks, a
machine whose only 2 cores are shared by every rank thread, so resize times (which wait for
every rank's store requests) include the ranks' queue for the CPU.
"""
from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from slurm_etc import bounds
from slurm_etc.coordinator.backend import BackendDefaults
from slurm_etc.errors import InternalError
from slurm_etc.harness.control_ranks import FDS_PER_SIM_RANK, fabric_main, host_main

logger = logging.getLogger(__name__)

JOB = "bench-control"
GPUS_PER_NODE = 8
# descriptors a coordinator needs beyond its connection per rank (SQLite, zmq's own
# mailboxes and listeners, the interpreter's)
COORDINATOR_FDS_SPARE = 256
EXTRAPOLATE_TO = 131_072
# the bench's join timeout a rank launched (ControlBench.join_s)
JOIN_S_PER_RANK = 0.04
# how long the job may take to end once the scenario ended it, before the bench cancels it
END_GRACE_S = 60.0


class ControlBenchError(InternalError, RuntimeError):
    """The benchmark could not run (one line says why)."""


@dataclass(frozen=True)
class ControlBench:
    """One run of the control benchmark.

    Attributes:
        ranks: simulated ranks (a multiple of 8: N/8 nodes of 8 devices).
        step_s: a training step's length (a sleep).
        warm_steps: steps trained before the steady window opens.
        steady_steps: steps in the steady window (what the steady figures average over).
        steady_min_s: the window's least length in seconds (it holds heartbeats: one to every
            rank each ``HEARTBEAT_S``).
        settle_steps: steps trained after each resize before the next event.
        resizes: drive the grow, the preemption shrink and the node loss after the window.
        grace_s: the preemption notice's grace.
        ranks_per_host: simulated ranks per host process (threads).
        model, global_batch: what the job trains (the chooser and the planner use it).
        timeout_s: the coordinator's deadline for the whole run.
        worker_timeout_s: the job's worker timeout (a rank's join, agreement and a resize's
            bound: unanswered for twice this, the coordinator aborts a resize); 0: 60 s and
            20 ms more a rank (thousands of simulated ranks start at once on 2 cores).
        join_timeout_s: how long a launched rank has to say Hello (the coordinator's
            ``JobSpec.join_timeout_s``); 0: the product's default (300 s) or 40 ms a rank
            launched, whichever is longer (the hosts admit a few ranks at a time to the
            join on 2 cores: 16,384 ranks queue for minutes; on a cluster they join at once).
    """

    ranks: int
    step_s: float = 0.05
    warm_steps: int = 3
    steady_steps: int = 10
    steady_min_s: float = 6.0
    settle_steps: int = 2
    resizes: bool = True
    grace_s: float = 600.0
    ranks_per_host: int = 512
    model: str = "small"
    global_batch: int = 0  # 0: a multiple of every dp the run can choose
    timeout_s: float = 600.0
    worker_timeout_s: float = 0.0
    join_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        if self.ranks < 16 or self.ranks % GPUS_PER_NODE:
            raise ControlBenchError(f"--ranks {self.ranks}: give a multiple of "
                                    f"{GPUS_PER_NODE} of at least 16 (N/8 nodes of "
                                    f"{GPUS_PER_NODE} devices)")

    @property
    def nodes(self) -> int:
        return self.ranks // GPUS_PER_NODE

    @property
    def grow_nodes(self) -> int:
        """An eighth of the nodes (at least one)."""
        return max(1, self.nodes // 8)

    @property
    def batch(self) -> int:
        if self.global_batch:
            return self.global_batch
        # every dp the grow, the shrink and the loss can give divides it (where that fits
        # the batch bound; else the loss's layout may leave some devices out)
        grown = self.ranks + GPUS_PER_NODE * self.grow_nodes
        every = math.lcm(self.ranks, grown, self.ranks - GPUS_PER_NODE)
        every = every if every <= bounds.BATCH.high else math.lcm(self.ranks, grown)
        # 64 sequences a rank at least: compute outweighs the gradients' all-reduce in the
        # chooser's estimate, so it takes every device offered
        return every * max(1, -(-64 * self.ranks // every))

    @property
    def join_s(self) -> float:
        """The coordinator's join timeout for this run (``join_timeout_s``)."""
        from slurm_etc.coordinator.job import DEFAULT_JOIN_TIMEOUT_S

        most = self.ranks + GPUS_PER_NODE * self.grow_nodes
        return self.join_timeout_s or max(DEFAULT_JOIN_TIMEOUT_S, JOIN_S_PER_RANK * most)

    @property
    def hosts(self) -> int:
        most = self.ranks + GPUS_PER_NODE * self.grow_nodes
        return max(1, -(-most // self.ranks_per_host))


def descriptor_problem(bench: ControlBench) -> str | None:
    """Why this machine cannot hold ``bench``'s connections (one line), or None. Raises the
    soft open-file limit to the hard one on the way (as the coordinator process would)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            hard = soft
    most = bench.ranks + GPUS_PER_NODE * bench.grow_nodes * bench.resizes
    need = most + COORDINATOR_FDS_SPARE
    if hard != resource.RLIM_INFINITY and need > hard:
        fit = hard - COORDINATOR_FDS_SPARE
        fit = (fit * 8 // 9 if bench.resizes else fit) // GPUS_PER_NODE * GPUS_PER_NODE
        return (f"{bench.ranks:,} ranks need about {need:,} open files in the coordinator's "
                f"process (one connection per rank, carrying its control channel and its "
                f"store requests, {most:,} ranks{' at the grow' if bench.resizes else ''}), "
                f"over this machine's hard limit of {hard:,} per process; the most it runs is "
                f"{fit:,} ranks{'' if bench.resizes else ' without resizes'}")
    per_host = bench.ranks_per_host * FDS_PER_SIM_RANK + COORDINATOR_FDS_SPARE
    if hard != resource.RLIM_INFINITY and per_host > hard:
        return (f"{bench.ranks_per_host} simulated ranks per host process need about "
                f"{per_host:,} open files, over the hard limit of {hard:,}: give fewer "
                f"--ranks-per-host")
    return None


# --------------------------------------------------------------------------- the cluster


class SimCluster(BackendDefaults):
    """The backend seam over a simulated cluster: N/8 nodes hold the job, an eighth more is
    granted for the grow; launches and stops go to the host processes; the scenario (steady
    window, grow, preemption shrink, node loss, end) advances at the steps the coordinator
    reports (``on_step`` comes only while it is settled)."""

    def __init__(self, bench: ControlBench, hosts: Sequence[Connection],
                 sample: Callable[[], dict[str, float]]) -> None:
        from slurm_etc.alloc.topology import ClusterTopology, Device

        self.bench = bench
        total = bench.nodes + bench.grow_nodes
        self.topology = ClusterTopology(GPUS_PER_NODE, tuple(f"n{i}" for i in range(total)))
        self.hosts = hosts
        self.sample = sample
        self.coordinator: Any = None
        self._devices = {n: tuple(Device(n, k) for k in range(GPUS_PER_NODE))
                         for n in self.topology.nodes}
        from slurm_etc.coordinator.backend import Grant

        first, rest = self.topology.nodes[0], self.topology.nodes[1:bench.nodes]
        self.events: list[Any] = [Grant("a0", self._devices[first]),
                                  Grant("a1", tuple(d for n in rest for d in self._devices[n]))]
        self.grown = tuple(self.topology.nodes[bench.nodes:])
        self._workers: dict[int, Any] = {}
        self._host_of: dict[int, int] = {}
        self.phase = "warm"
        self.window: dict[str, Any] = {}
        self.resizes: dict[str, dict[str, Any]] = {}
        # per resize: the counters when its event was handed over and when it committed
        self.spans: dict[str, dict[str, Any]] = {}
        self._event_at: float = 0.0
        self._resizes_before = 0
        self._event_step = 0
        self.control: dict[int, list[tuple[int, int, float, float]]] = {}
        # the same, as each host had them when the steady window closed (read_steady)
        self.report_dir = Path(tempfile.gettempdir())
        self.steady_control: dict[int, list[tuple[int, int, float, float]]] = {}
        self.steady_gate_waits: list[float] = []
        self.hosts_done = 0
        self.rank_failures: dict[str, int] = {}
        self.rank_restarts = 0
        self.gate_waits: list[float] = []
        self.resize_began: dict[int, float] = {}
        # generation -> its proposer's wait in the migration group's barrier (the group's
        # rendezvous and data phase: world building and data, outside control time)
        self.group_waits: dict[int, float] = {}
        # generation -> when its proposer left the barrier, and the largest own control of
        # a rank of the old layout (its boundary to its entry into the barrier)
        self.group_left: dict[int, float] = {}
        self.own_control: dict[int, float] = {}
        self.failures: list[str] = []

    # -- the scenario -------------------------------------------------------------------
    def on_step(self, step: int) -> None:
        from slurm_etc.coordinator.backend import EndTraining, Grant, Loss, PreemptNotice

        b = self.bench
        if self.phase == "warm" and step >= b.warm_steps:
            self.window = {"step0": step, "at0": self.sample()}
            self.phase = "steady"
            self._say(f"step {step}: the steady window opens")
        elif self.phase == "steady" and step >= self.window["step0"] + b.steady_steps and \
                time.monotonic() - self.window["at0"]["t"] >= b.steady_min_s:
            self.window.update(step1=step, at1=self.sample())
            self._say(f"step {step}: the steady window closed")
            # the window's step timings as the hosts hold them now, written to files read at
            # the end (not here: the grow that follows is measured): a run whose hosts end
            # late keeps them
            for i, conn in enumerate(self.hosts):
                conn.send(("report", str(self.report_dir / f"steady-{i}.pickle")))
            if not b.resizes:
                self.phase, self._event_at = "end", time.monotonic()
                self.events.append(EndTraining("the steady window is measured"))
                return
            self._next("grow", step, Grant("a2", tuple(d for n in self.grown
                                                       for d in self._devices[n])))
        elif self.phase in ("grow", "shrink", "loss"):
            if not self._settled(step):
                return
            if self.phase == "grow":
                self._next("shrink", step, PreemptNotice(
                    "a2", tuple(d for n in self.grown for d in self._devices[n]),
                    time.time() + b.grace_s))
            elif self.phase == "shrink":
                lost = self.topology.nodes[b.nodes - 1]
                devices = self._devices[lost]
                self._kill([v for v, w in self._workers.items()
                            if w.device in devices and w.running])
                self._next("loss", step, Loss("a1", devices, "failure"))
            else:
                self.phase, self._event_at = "end", time.monotonic()
                self.events.append(EndTraining("the scenario played out"))

    def _say(self, what: str) -> None:
        """Progress of a long run, on stderr (stdout holds the JSON)."""
        print(f"bench control, {self.bench.ranks} ranks: {what}", file=sys.stderr, flush=True)

    def _next(self, phase: str, step: int, event: Any) -> None:
        self._say(f"step {step}: {phase}")
        self.spans[phase] = {"at0": self.sample(), "wall": time.time()}
        self.phase = phase
        self.events.append(event)
        self._event_at = time.monotonic()
        self._event_step = step
        self._resizes_before = len(self.coordinator.resize.times)

    def _settled(self, step: int) -> bool:
        """The resize of the current phase committed and ``settle_steps`` trained since
        (or, without a resize, as many steps went by: recorded as none).

        The phase's span (the coordinator's CPU and messages in it) ends once the answers
        that come after the commit are in too (a resize commits at the store's commit vote,
        before most ranks said Resized), or at the settle steps."""
        c = self.coordinator
        got = self.resizes.get(self.phase)
        if got is None:
            if len(c.resize.times) > self._resizes_before:
                got = self.resizes[self.phase] = {"step": step, "committed": True}
            elif step >= self._event_step + 4 * self.bench.settle_steps + 4:
                got = self.resizes[self.phase] = {"step": step, "committed": False}
                self.failures.append(f"{self.phase}: no resize committed")
            else:
                return False
        done = bool(step >= got["step"] + self.bench.settle_steps)
        if got["committed"] and "at1" not in self.spans[self.phase] and \
                (c.resize.late is None or done):
            self.spans[self.phase]["at1"] = self.sample()
        return done

    # -- Backend ------------------------------------------------------------------------
    def poll(self) -> list[Any]:
        from dataclasses import replace

        from slurm_etc.coordinator.backend import WorkerExited

        out, self.events = self.events, []
        if self.phase == "end" and time.monotonic() - self._event_at > END_GRACE_S:
            # every figure is taken; a job whose ranks failed after its training was ended
            # waits for its deadline (its failures' events are never decided on): cut it
            self.coordinator.cancel(f"bench: the scenario ended {END_GRACE_S:.0f} s ago")
        for conn in self.hosts:
            while conn.poll(0):
                msg = conn.recv()
                if msg[0] == "exited":
                    _, vrank, gen, code, stopped = msg
                    w = self._workers.get(vrank)
                    if w is None or w.generation != gen or not w.running:
                        continue
                    self._workers[vrank] = replace(w, returncode=code)
                    out.append(WorkerExited(vrank, gen, w.device, code, stopped))
                elif msg[0] == "control":
                    self.control.update(msg[1])
                    for kind, n in msg[2].items():
                        self.rank_failures[kind] = self.rank_failures.get(kind, 0) + n
                    self.rank_restarts += msg[3]
                    self.gate_waits.extend(msg[4])
                    for g, at in msg[5].items():
                        self.resize_began[g] = min(self.resize_began.get(g, at), at)
                    self.group_waits.update(msg[6])
                    self.group_left.update(msg[7])
                    for g, own in msg[8].items():
                        self.own_control[g] = max(self.own_control.get(g, own), own)
                    self.hosts_done += 1
        return out

    def read_steady(self) -> None:
        """The step timings the hosts wrote when the steady window closed."""
        import pickle

        for path in sorted(self.report_dir.glob("steady-*.pickle")):
            control, waits = pickle.loads(path.read_bytes())
            self.steady_control.update(control)
            self.steady_gate_waits.extend(waits)

    def request(self, action: Any) -> None:
        pass

    def release(self, action: Any) -> None:
        # the set built once: per worker, it took 16 s of the coordinator's loop at a loss
        # of 16,384 ranks that released 4,088 devices (py-spy), blocking it after the commit
        leaving = set(action.devices)
        running = [v for v, w in self._workers.items() if w.device in leaving and w.running]
        self._kill(running)

    def launch(self, action: Any) -> None:
        from slurm_etc.coordinator.backend import WorkerState
        from slurm_etc.protocol import env as envvars

        by_host: dict[int, list[tuple[int, dict[str, str]]]] = {}
        for spec in action.workers:
            w = self._workers.get(spec.vrank)
            if w is not None and w.running:
                continue
            env = {**action.env, **spec.env, envvars.VRANK: str(spec.vrank),
                   envvars.GENERATION: str(action.generation), envvars.DEVICE: str(spec.device)}
            host = self._host(spec.device)
            by_host.setdefault(host, []).append((spec.vrank, env))
            self._host_of[spec.vrank] = host
            self._workers[spec.vrank] = WorkerState(spec.vrank, action.generation, spec.device,
                                                    pid=1_000_000 + host)
        for host, workers in by_host.items():
            self.hosts[host].send(("launch", action.generation, workers))

    def _host(self, device: Any) -> int:
        per_host = max(1, self.bench.ranks_per_host // GPUS_PER_NODE)
        return min(self.topology.nodes.index(device.node) // per_host, len(self.hosts) - 1)

    def stop(self, action: Any) -> None:
        self._send("stop", action.vranks)

    def _kill(self, vranks: Sequence[int]) -> None:
        self._send("kill", vranks)

    def _send(self, what: str, vranks: Sequence[int]) -> None:
        from dataclasses import replace

        by_host: dict[int, list[int]] = {}
        for v in vranks:
            w = self._workers.get(v)
            if w is None or not w.running:
                continue
            self._workers[v] = replace(w, stopping=True)
            by_host.setdefault(self._host_of[v], []).append(v)
        for host, vs in by_host.items():
            self.hosts[host].send((what, vs))

    def workers(self) -> Mapping[int, Any]:
        return self._workers

    def close(self) -> None:
        self._send("stop", [v for v, w in self._workers.items() if w.running])


# --------------------------------------------------------------------------- the coordinator


def _counting_channel(base: type) -> type:
    class CountingChannel(base):
        """The coordinator's channel, counting what it receives and sends."""

        received = 0
        sent = 0

        def recv(self, timeout_s: float) -> Any:
            got = super().recv(timeout_s)
            if got is not None:
                self.received += 1
            return got

        def _send_all(self, message: Any, vranks: Sequence[int], **how: Any) -> list[int]:
            self.sent += len(vranks)  # send, welcome and broadcast all come here
            return list(super()._send_all(message, vranks, **how))

    return CountingChannel


def _counting_store(base: type) -> type:
    class CountingStore(base):
        """The rendezvous store, counting the replies it sends (it counts the requests it
        serves itself: ``requests``)."""

        replies = 0
        reply_bytes = 0  # the values the replies carry (what grows with the job)

        def _reply(self, routing: bytes, reply: Any) -> None:
            self.replies += 1
            self.reply_bytes += sum(len(v) for v in reply.values)
            super()._reply(routing, reply)

    return CountingStore


# (channel class, store class) -> the same, counting otherwise: a planted miscount
# (slurm_etc.testing.bench_plants); None: the counters as they are
Counters = Callable[[type, type], tuple[type, type]]


def _coordinator_main(bench: ControlBench, out: Connection, log_level: int,
                      counters: Counters | None) -> None:
    """One run, in a process of its own (its CPU, RSS and descriptors are the coordinator's):
    the hosts, the coordinator over the simulated cluster, then the figures."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(message)s")
    try:
        out.send(("ok", _run(bench, counters)))
    except BaseException as err:  # noqa: BLE001 - said in one line by the parent
        logger.debug("bench control failed", exc_info=True)
        out.send(("error", f"{type(err).__name__}: {err}"))


def _run(bench: ControlBench, counters: Counters | None) -> dict[str, Any]:
    from slurm_etc.alloc.chooser import Hardware, TrainingJob
    from slurm_etc.coordinator.job import JobSpec
    from slurm_etc.coordinator.run import coordinator_over
    from slurm_etc.plan import load_model
    from slurm_etc.policy.rules import EffectivePolicy
    from slurm_etc.protocol.channel import CoordinatorChannel, create_secret
    from slurm_etc.protocol.messages import ModelReport
    from slurm_etc.protocol.store import StoreClient, StoreServer
    from slurm_etc.store import jobs as record

    problem = descriptor_problem(bench)
    if problem is not None:
        raise ControlBenchError(problem)
    desc = load_model(bench.model)
    training = TrainingJob(desc, bench.batch, 1, False)
    procs = _Processes.start(bench, ModelReport.of(desc, training.global_batch,
                                                   training.micro_batch))
    pipes, contributions = procs.pipes, procs.contributions
    rss_before = _rss_bytes()
    with tempfile.TemporaryDirectory(prefix="etc-bench-control-") as tmp:
        db = Path(tmp) / "job.db"
        store = record.open_job_store(JOB, db=db, state_dir=Path(tmp) / "state")
        record.create_job(store, JOB, name="bench", owner_uid=os.getuid(),
                          owner_name="bench", backend="local", model=desc.name)
        secret = create_secret(JOB, Path(tmp) / "secrets")
        channel_cls, store_cls = _counting_channel(CoordinatorChannel), \
            _counting_store(StoreServer)
        if counters is not None:
            channel_cls, store_cls = counters(channel_cls, store_cls)
        channel = channel_cls(JOB, secret, "127.0.0.1", store_class=store_cls)
        rendezvous = channel.store
        poster = StoreClient("127.0.0.1", channel.port, secret.key)

        def sample() -> dict[str, float]:
            # every thread of this process: the loop, the store's, zmq's I/O threads
            return {"t": time.monotonic(), "cpu": time.process_time(), "rss": _rss_bytes(),
                    "channel_in": channel.received, "channel_out": channel.sent,
                    "store_requests": rendezvous.requests, "store_replies": rendezvous.replies,
                    "store_reply_bytes": rendezvous.reply_bytes,
                    "gate_contributions": contributions.value}

        cluster = SimCluster(bench, [parent for parent, _ in pipes], sample)
        cluster.report_dir = Path(tmp)
        spec = JobSpec(JOB, "bench", ("simulated-rank",), training,
                       # data-parallel layouts only: a node lost is covered by its replicas
                       # (no peer copies to rebuild from in a simulation)
                       EffectivePolicy(grow=False, allowed_tp=(1,), allowed_pp=(1,)),
                       Hardware(gpus_per_node=GPUS_PER_NODE),
                       worker_timeout_s=bench.worker_timeout_s or 60.0 + 0.02 * bench.ranks,
                       join_timeout_s=bench.join_s,
                       prepare_while_training=False)
        # wired to its store as `slurm-etc run`'s (until 2026-12-07 the bench's was not: its
        # resizes committed on every rank's Resized, not on the store's commit vote)
        coordinator = coordinator_over(spec, cluster, store, channel, cluster.topology, poster)
        cluster.coordinator = coordinator
        t0 = time.monotonic()
        state, ended = "failed", sample()
        try:
            state = coordinator.run(deadline_s=bench.timeout_s)
        finally:
            wall, ended = time.monotonic() - t0, sample()
            cluster.close()
            procs.stop(cluster)
            cluster.read_steady()
            poster.close()
            channel.close()
            migrations = _migrations(db)
            store.close()
        record_bytes = sum(p.stat().st_size for p in Path(tmp).glob("job.db*"))
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for span in cluster.spans.values():
        span.setdefault("at1", ended)
    out = _figures(bench, cluster, state, wall, migrations, record_bytes, peak_kib,
                   rss_before)
    # every request the store took over the run, every rank gone: each was answered
    out["store_totals"] = {"requests": ended["store_requests"],
                           "replies": ended["store_replies"]}
    return out


@dataclass
class _Processes:
    """The bench's host processes (each running ``ranks_per_host`` simulated ranks) and the
    fabric process that simulates their collectives, with their pipes."""

    pipes: list[tuple[Connection, Connection]]
    wires: list[tuple[Connection, Connection]]
    contributions: Any
    fabric: BaseProcess
    hosts: Sequence[BaseProcess]

    @classmethod
    def start(cls, bench: ControlBench, report: Any) -> _Processes:
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(bench.hosts)]
        wires = [ctx.Pipe() for _ in range(bench.hosts)]
        contributions = ctx.Value("q", 0)
        fabric = ctx.Process(target=fabric_main, args=([a for a, _ in wires], contributions),
                             daemon=True, name="bench-control-fabric")
        hosts = [ctx.Process(target=host_main, args=(child, wire, report, bench.step_s,
                                                     bench.ranks_per_host, bench.join_s),
                             daemon=True, name=f"bench-control-host-{i}")
                 for i, ((_, child), (_, wire)) in enumerate(zip(pipes, wires, strict=True))]
        for h in (fabric, *hosts):
            h.start()
        return cls(pipes, wires, contributions, fabric, hosts)

    def stop(self, cluster: SimCluster) -> None:
        """Tell every host to quit, give them 60 s to report their ranks' timings (polled
        into ``cluster``), then end them and the fabric."""
        for parent, _ in self.pipes:
            try:
                parent.send(("quit",))
            except OSError:
                pass
        until = time.monotonic() + 60
        while cluster.hosts_done < len(self.hosts) and time.monotonic() < until:
            cluster.poll()
            time.sleep(0.05)
        cluster.poll()
        for h in self.hosts:
            h.join(10)
            if h.is_alive():
                h.kill()
        self.wires[0][1].send(("quit",))
        self.fabric.join(10)
        if self.fabric.is_alive():
            self.fabric.kill()


def _rss_bytes() -> int:
    """This process's resident set now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _migrations(db: Path) -> list[dict[str, Any]]:
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT from_generation, to_generation, outcome, measured_seconds, "
                           "error, started_at FROM migrations ORDER BY id").fetchall()
        job = con.execute("SELECT state, reason FROM jobs").fetchone()
    finally:
        con.close()
    return [{"from": a, "to": b, "outcome": o, "seconds": s, "error": (e or "")[:300],
             "started": _epoch(t)}
            for a, b, o, s, e, t in rows] + [{"job": job[0], "reason": (job[1] or "")[:300]}]


def _epoch(stamp: str) -> float:
    """A record's naive-UTC timestamp as unix seconds."""
    from datetime import datetime, timezone

    return datetime.fromisoformat(stamp).replace(tzinfo=timezone.utc).timestamp()


def _figures(bench: ControlBench, cluster: SimCluster, state: str, wall: float,
             migrations: list[dict[str, Any]], record_bytes: int, peak_kib: int,
             rss_before: int) -> dict[str, Any]:
    w = cluster.window
    job = migrations.pop() if migrations and "job" in migrations[-1] else {}
    out: dict[str, Any] = {"ranks": bench.ranks, "state": state, "wall_s": round(wall, 2)}
    if "at1" not in w:
        failed = "; ".join(f"{n} simulated rank(s) failed: {kind}"
                           for kind, n in cluster.rank_failures.items())
        raise ControlBenchError(f"the steady window never closed: the job ended {state} "
                                f"after {wall:.0f} s in phase {cluster.phase} "
                                f"({failed or 'no rank failed'}); "
                                f"{job.get('reason', '')[:160]}")
    steps = w["step1"] - w["step0"]
    seconds = w["at1"]["t"] - w["at0"]["t"]
    counts = _counted(w["at0"], w["at1"], steps)
    reply_mb = counts.pop("store_reply_bytes") / 1e6
    # every host's timings at its end; those that ended before they said them (16,384 rank
    # threads take long to stop), as they had them when the window closed
    measured = {**cluster.steady_control, **cluster.control}
    timed = [(cost, wall) for per in measured.values() for (g, step, cost, wall) in per
             if g == 0 and w["step0"] <= step < w["step1"]]
    gate_waits = cluster.gate_waits or cluster.steady_gate_waits
    control = [cost for cost, _ in timed]
    resize_s, detail = _resize_figures(cluster, migrations)
    out.update({
        "step_control_ms": round(1e3 * statistics.median(control), 4) if control else None,
        "coordinator_cpu_s_per_s": round((w["at1"]["cpu"] - w["at0"]["cpu"]) / seconds, 3),
        "coordinator_messages_per_step": round(sum(counts.values()), 1),
        "resize_control_s": resize_s,
        "coordinator_rss_mib": round(peak_kib / 1024, 1),
        "record_bytes": record_bytes,
        "steady": {"steps": steps, "seconds": round(seconds, 2),
                   "step_s": round(seconds / steps, 3),
                   "messages_per_step": {k: round(v, 1) for k, v in counts.items()},
                   "store_reply_mb_per_step": round(reply_mb, 2),
                   # the simulated all-reduce of the gate (module doc): ranks' contributions
                   # per step, and a rank's wait in it (not control time, not counted above)
                   "gate_contributions_per_step": round(
                       (w["at1"]["gate_contributions"] - w["at0"]["gate_contributions"])
                       / steps, 1),
                   "gate_wait_ms": round(1e3 * statistics.median(gate_waits), 2)
                   if gate_waits else None,
                   "coordinator_rss_mib_at_end": round(w["at1"]["rss"] / 2**20, 1),
                   "boundaries_timed": len(control),
                   # as the clock saw it: with the CPU thousands of simulated ranks share
                   "step_control_wall_ms": round(
                       1e3 * statistics.median(wall for _, wall in timed), 4) if timed else None},
        "resizes": detail,
        "migrations": migrations,
        "job": job,
        "coordinator_rss_mib_before_run": round(rss_before / 2**20, 1),
        # a rank's store request unanswered past the client's 10 s grace: it held as the
        # trainer does for a restarted coordinator (Hello, a new Welcome, repoint)
        "rank_store_timeouts": cluster.rank_restarts,
        "problems": list(cluster.failures) + [
            f"{cluster.rank_restarts} time(s) a rank's store request went unanswered past "
            f"the client's grace (it held for a restarted coordinator, as the trainer does)"
            for _ in range(1 if cluster.rank_restarts else 0)] + [
            f"{n} simulated rank(s) failed: {kind}" for kind, n in cluster.rank_failures.items()],
        "bench": asdict(bench),
    })
    return out


def _resize_figures(cluster: SimCluster, migrations: list[dict[str, Any]]
                    ) -> tuple[dict[str, float | None], dict[str, Any]]:
    """Each resize phase's control time and its detail.

    Control time is the critical path of a job whose ranks run side by side, as on a
    cluster: the largest over the old layout's ranks of each one's own control (from its
    step boundary that took the order up, or its collective that failed, to its entry into
    the migration group's barrier, which stands for the group's rendezvous and data phase),
    then the barrier's end (its proposer leaving it) to the commit. Each rank's part holds
    every wait it has on the coordinator, the store and its peers' collectives; what it
    does not hold is the spread of the ranks' boundaries, which on 2 cores is thousands of
    simulated ranks queueing for the CPU after each step (on a cluster a step ends in an
    all-reduce, at once everywhere). As the pause is, per process, the largest.

    Beside it, the definition used until 2026-12-08 (e1d6ae6): the span from the earliest
    rank's boundary to the commit, less the proposer's wait in the barrier
    (``earliest_boundary_control_s``), and the span with the barrier in it."""
    resize_s: dict[str, float | None] = {}
    detail: dict[str, Any] = {}
    phases = [p for p in ("grow", "shrink", "loss") if p in cluster.spans]
    for i, phase in enumerate(phases):
        span = cluster.spans[phase]
        moved = _counted(span["at0"], span["at1"], 1)
        # the migration this phase's event started: the first recorded after the event and
        # before the next phase's (a resize of the coordinator's own between them, e.g.
        # dropping ranks that died, is not the event's)
        until = cluster.spans[phases[i + 1]]["wall"] if i + 1 < len(phases) else math.inf
        m = next((m for m in migrations if span["wall"] <= m["started"] < until), None)
        ok = m is not None and m["outcome"] == "committed"
        commit = m["started"] + m["seconds"] if ok and m else None
        gen = m["to"] if m else None
        # the step in flight when the order came is training's
        began = cluster.resize_began.get(gen) if gen is not None else None
        span_s = commit - began if commit is not None and began else None
        group_s = cluster.group_waits.get(gen) if gen is not None else None
        own_s = cluster.own_control.get(gen) if gen is not None else None
        left = cluster.group_left.get(gen) if gen is not None else None
        after_s = commit - left if commit is not None and left is not None else None
        resize_s[phase] = (round(own_s + after_s, 3)
                           if own_s is not None and after_s is not None else None)
        detail[phase] = {
            "outcome": m["outcome"] if m else "none",
            "error": m["error"] if m else "",
            # control time's two parts: the slowest rank's own, the barrier's end to commit
            "slowest_rank_s": round(own_s, 3) if own_s is not None else None,
            "barrier_to_commit_s": round(after_s, 3) if after_s is not None else None,
            # the definition of before: from the earliest boundary, less the barrier
            "earliest_boundary_control_s": (round(span_s - group_s, 3) if span_s is not None
                                            and group_s is not None else None),
            # the span from the earliest boundary to the commit, the barrier in it
            "boundary_to_commit_s": round(span_s, 3) if span_s is not None else None,
            "group_barrier_s": round(group_s, 3) if group_s is not None else None,
            "order_to_commit_s": round(m["seconds"], 3) if ok and m else None,
            # the coordinator's reaction: the event handed to it to the resize recorded (its
            # order follows at once; in a loss the survivors may be waiting for it)
            "event_to_order_s": round(m["started"] - span["wall"], 3) if m else None,
            "step_in_flight_s": round(began - m["started"], 3) if m and began else None,
            "event_to_settled_s": round(span["at1"]["t"] - span["at0"]["t"], 2),
            # what the coordinator's process spent on it (loop, store, zmq), whatever the
            # ranks' share of the machine: the wall figures above wait for the ranks too
            "coordinator_cpu_s": round(span["at1"]["cpu"] - span["at0"]["cpu"], 2),
            "messages": round(sum(v for k, v in moved.items() if k != "store_reply_bytes")),
            "channel_in": round(moved["channel_in"]),
            "channel_out": round(moved["channel_out"]),
            "store_requests": round(moved["store_requests"]),
            "store_replies": round(moved["store_replies"]),
            "store_reply_mb": round(moved["store_reply_bytes"] / 1e6, 1)}
    return resize_s, detail


def _counted(a: Mapping[str, float], b: Mapping[str, float], per: int) -> dict[str, float]:
    """The counters' growth from sample ``a`` to ``b``, divided by ``per``."""
    return {k: (b[k] - a[k]) / per for k in ("channel_in", "channel_out", "store_requests",
                                             "store_replies", "store_reply_bytes")}


def run_control(bench: ControlBench, *, log_level: int = logging.WARNING,
                counters: Counters | None = None) -> dict[str, Any]:
    """One run in a fresh process (its figures; ControlBenchError with one line when it
    could not run). ``counters``: a module-level function (it travels to the process by
    name) that changes how messages are counted: a test's planted miscount."""
    problem = descriptor_problem(bench)
    if problem is not None:
        raise ControlBenchError(problem)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_coordinator_main, args=(bench, child, log_level, counters),
                       name=f"bench-control-{bench.ranks}")
    proc.start()
    try:
        if not parent.poll(bench.timeout_s + 180):
            raise ControlBenchError(f"{bench.ranks} ranks: no result within "
                                    f"{bench.timeout_s + 180:.0f} s")
        kind, got = parent.recv()
    except EOFError:
        raise ControlBenchError(f"{bench.ranks} ranks: the coordinator's process died "
                                f"(exit {proc.exitcode})") from None
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if kind != "ok":
        raise ControlBenchError(f"{bench.ranks} ranks: {got}")
    return dict(got)


def check_run(run: Mapping[str, Any]) -> list[str]:
    """What is wrong with one run's figures (empty: sane). In the steady window every rank
    takes part in each step's gate and rank 0 sends one Progress, and no rank asks the store
    anything (the gate is closed); in each resize every rank of the old layout arrives at
    the store's decision, or (a loss: the survivors' all-reduce failed) takes the commit
    decision, a request at least either way, and every request is answered once; the
    coordinator hears the group's Resized (a loss's too) and, in a grow, each joiner's
    Hello. A count off those is a miscount (or the gate broken)."""
    n = run["ranks"]
    bad = []
    steady = run["steady"]
    per = steady["messages_per_step"]
    if steady["gate_contributions_per_step"] < n * 0.8:
        bad.append(f"gate contributions per step {steady['gate_contributions_per_step']} "
                   f"< ranks {n}")
    if per["store_requests"] > 0.05 * n + 1:
        bad.append(f"store requests per steady step {per['store_requests']}: the gate "
                   f"should keep the store silent while no rank holds an order")
    if per["channel_in"] < 0.9:
        bad.append(f"channel reports per step {per['channel_in']} < 1 (rank 0's Progress)")
    total = sum(per.values())
    if abs(total - run["coordinator_messages_per_step"]) > 0.5:
        bad.append(f"messages per step {run['coordinator_messages_per_step']} != the sum of "
                   f"its parts {total:.1f}")
    totals = run.get("store_totals")
    if totals is not None and abs(totals["requests"] - totals["replies"]) > 1:
        bad.append(f"store replies {totals['replies']} differ from its requests "
                   f"{totals['requests']} over the run")
    for phase, got in run["resizes"].items():
        asked, answered = got["store_requests"], got["store_replies"]
        # the migration group's one Resized for all (a loss too: replicas cover it), and a
        # grow's joiners' Hello each
        least = {"grow": 1 + n // 8}.get(phase, 1)
        if got["channel_in"] < least:
            bad.append(f"resize {phase}: channel reports {got['channel_in']} < {least} (the "
                       "group's Resized, each joiner's Hello)")
        # requests in flight when the span closes (a resize committed) fall on either side
        if abs(answered - asked) > 0.05 * asked + 16:
            bad.append(f"resize {phase}: store replies {answered} differ from requests "
                       f"{asked}")
    if not run["step_control_ms"] or run["step_control_ms"] <= 0:
        bad.append(f"step_control_ms {run['step_control_ms']}")
    if not 0 < run["coordinator_cpu_s_per_s"] <= (os.cpu_count() or 1) * 1.1:
        bad.append(f"coordinator_cpu_s_per_s {run['coordinator_cpu_s_per_s']}")
    if run["record_bytes"] <= 0 or run["coordinator_rss_mib"] <= 0:
        bad.append("record or RSS not measured")
    for phase, sec in run["resize_control_s"].items():
        if sec is None or sec <= 0:
            bad.append(f"resize {phase}: {sec}")
    bad += run.get("problems", [])
    return bad


def fit_power(runs: Sequence[Mapping[str, Any]], key: str) -> dict[str, float] | None:
    """``key`` ~ a * ranks^b by least squares in log-log over ``runs`` (two at least), and its
    value extrapolated to 131,072 ranks."""
    pts = [(math.log(r["ranks"]), math.log(r[key])) for r in runs if r.get(key)]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    a = math.exp(my - b * mx)
    return {"a": a, "exponent": round(b, 3),
            f"at_{EXTRAPOLATE_TO}": round(a * EXTRAPOLATE_TO ** b, 3)}

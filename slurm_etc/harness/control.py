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
``step_s``); the collectives among ranks. Two of those decide what the control path does
and run on a *fabric* (a process of their own that sums what the hosts send, one message a
host a step): the step's loss all-reduce, which carries the gate, and a resize's migration
group (a barrier of the old survivors and the joiners, standing for its rendezvous and data
phase). A rank killed fails its generation's collectives there, as gloo's closed
connection fails its peers'. A rank's wait in them is not control time (``gate_wait_ms``
apart). The data phase itself, the new world's groups and the commit vote's all-gather cost
nothing here, and the resize times exclude them. Of a resize the ranks do what goes through
the coordinator's store: old rank 0 publishes the trainer state and when its last step
ended, joiners wait for it, every rank of the new layout takes the commit decision
(compare-and-set, :class:`~slurm_etc.migrate.decision.CommitDecision`), then each reports.
Resizes are not prepared beside training (the agreed step carries it out).

What the machine limits: on 2 cores the ranks' threads, the coordinator and its store share
the CPUs. The ranks' host processes run at the idle scheduling class, so the coordinator
gets the CPU it asks for (on a cluster the ranks are on other nodes) and its figures (its
own process) are what a coordinator node pays for a job of that size; a rank's
``step_control_ms`` is what it pays itself (its thread's CPU at a boundary that asks
nobody anything), and ``step_control_wall_ms`` the clock's view with the CPU the other
simulated ranks took meanwhile. A coordinator holds one connection per rank (the channel,
which carries the store): the open-file limit (:func:`descriptor_problem`) bounds N.
"""
from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import queue
import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, cast

from slurm_etc import bounds
from slurm_etc.errors import InternalError

logger = logging.getLogger(__name__)

JOB = "bench-control"
GPUS_PER_NODE = 8
# descriptors a coordinator needs beyond its connection per rank (SQLite, zmq's own
# mailboxes and listeners, the interpreter's)
COORDINATOR_FDS_SPARE = 256
# descriptors one simulated rank costs its host process (its TCP connection, the socket's
# mailbox, the link monitor's pair, the eventfd that wakes the thread reading the socket)
FDS_PER_SIM_RANK = 5
EXTRAPOLATE_TO = 131_072
# the fabric's key of a resize's migration group (a step number no step has)
MIGRATION_GROUP = -1
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


# --------------------------------------------------------------------------- the ranks


@dataclass
class _Halt:
    """Why a simulated rank must end now: ``kill`` (its node was lost: it says nothing, as a
    killed process) or ``stop`` (StopWorkers: SIGTERM)."""

    event: threading.Event = field(default_factory=threading.Event)
    kind: str = ""

    def set(self, kind: str) -> None:
        self.kind = self.kind or kind
        self.event.set()


class _Shared:
    """What the ranks of one host process share: the zmq context, parsed layouts, the
    secret, and the host's end of the simulated all-reduce."""

    def __init__(self, ranks: int, fabric: "_HostFabric") -> None:
        import zmq

        self.ctx: Any = zmq.Context(io_threads=1)
        self.ctx.set(zmq.MAX_SOCKETS, max(1024, FDS_PER_SIM_RANK * ranks + 64))
        self.fabric = fabric
        self._lock = threading.Lock()
        self._layouts: dict[str, Any] = {}
        self._spec_layouts: dict[tuple[Any, ...], Any] = {}
        self._secrets: dict[str, Any] = {}
        self._ranks: dict[int, dict[int, int]] = {}

    def secret(self, path: str) -> Any:
        from slurm_etc.protocol.channel import load_secret

        with self._lock:
            if path not in self._secrets:
                self._secrets[path] = load_secret(path)
            return self._secrets[path]

    def layout(self, text: str) -> Any:
        """The layout of a worker's environment (``LAYOUT``), parsed once per process."""
        from slurm_etc.protocol.messages import parse_layout

        with self._lock:
            if text not in self._layouts:
                self._layouts[text] = parse_layout(text)
            return self._layouts[text]

    def layout_of(self, spec: Any) -> Any:
        """The Layout of an order's LayoutSpec, one object per process (ranks are found in
        it by identity)."""
        key = (spec.config, spec.distributed_optimizer, spec.runs)
        with self._lock:
            got = self._spec_layouts.get(key)
            if got is None:
                got = self._spec_layouts[key] = spec.layout()
            return got

    def rank_of(self, layout: Any, vrank: int) -> int:
        with self._lock:
            index = self._ranks.get(id(layout))
            if index is None:
                index = self._ranks[id(layout)] = {v: i for i, v in enumerate(layout.devices)}
            return index[vrank]


class SimRank:
    """One simulated rank: the worker's side of the control path, training nothing.

    ``control`` collects ``(generation, step, cost, wall)`` of every step boundary: from the
    end of a step's work (the sleep) to the start of the next (orders read, the agreement,
    rank 0's Progress), its all-reduce apart (:meth:`_train`)."""

    def __init__(self, shared: _Shared, vrank: int, generation: int, env: Mapping[str, str],
                 model: Any, step_s: float, done: Callable[[int, int, int, bool], None]
                 ) -> None:
        from slurm_etc.protocol import env as envvars

        self.shared, self.vrank, self.launched_in = shared, vrank, generation
        self.job = env[envvars.JOB]
        self.address = env[envvars.COORDINATOR]
        self.secret = shared.secret(env[envvars.SECRET_FILE])
        self.timeout_s = float(env.get(envvars.TIMEOUT, "300"))
        self.layout = shared.layout(env[envvars.LAYOUT]) if env.get(envvars.LAYOUT) else None
        self.generation = generation
        self.model, self.step_s, self.done = model, step_s, done
        self.halt = _Halt()
        self.step = 0
        self.control: list[tuple[int, int, float, float]] = []
        self._pending: Any = None
        self._woken_by = b""
        self._last_ended: float | None = None
        self._resumed_due = False
        self._joined = False
        self.failure = ""  # why the rank failed (a line), empty while it did not
        self.restarts = 0  # times the store went unanswered past the client's grace
        self._aborted: set[int] = set()
        self.fabric = shared.fabric
        self._gate: tuple[int, int, bool] | None = None
        self.gate_wait: list[float] = []  # seconds in each step's gate all-reduce
        self._asked = False  # whether this step boundary asked the store
        self._boundary_at = 0.0  # when the boundary that asked the store (or failed) began
        # generation -> when this rank's layout began the resize to it: the boundary that
        # agreed on it, or the collective that failed (the step in flight is not control)
        self.resize_began: dict[int, float] = {}
        self.thread = threading.Thread(target=self._main, name=f"rank-{vrank}", daemon=True)

    # -- the thread ---------------------------------------------------------------------
    def _main(self) -> None:
        from slurm_etc.protocol.store import StoreUnreachable

        code = 0
        try:
            code = self._run()
        except _Halted:
            code = -9 if self.halt.kind == "kill" else -15
        except _Lost:
            self._exit("coordinator-lost")
        except StoreUnreachable as err:
            # a real trainer holds here as if its coordinator had died (_await_restart) and
            # drops the order it held as aborted; a simulated rank ends (counted)
            self.failure = f"store unanswered: {str(err)[:120]}"
            code = 1
        except Exception as err:  # noqa: BLE001 - a rank's failure is its exit code
            self.failure = f"{type(err).__name__}: {str(err)[:120]}"
            code = 1
        finally:
            channel, store = getattr(self, "channel", None), getattr(self, "store", None)
            try:
                if channel is not None:
                    # a killed rank's reports die with it; a stopped one's Exited leaves
                    channel.close(linger_s=0 if self.halt.kind == "kill" else 0.5)
                if store is not None:
                    store.close()
            except Exception:  # noqa: BLE001 - closing what a dead rank held
                pass
        self.done(self.vrank, self.launched_in, code, bool(self.halt.kind))

    def _check(self) -> None:
        if self.halt.event.is_set():
            raise _Halted()

    def _run(self) -> int:
        from slurm_etc.protocol.channel import WorkerChannel
        from slurm_etc.protocol.messages import ModelBuilt, Resize, Stop
        from slurm_etc.protocol.store import StoreClient

        self.channel = WorkerChannel(self.job, self.vrank, self.address, self.secret,
                                     generation=self.generation, context=self.shared.ctx)
        self._join()
        self.store = StoreClient.over(self.channel)
        if self.layout is None:  # a joiner: its first order brings it in
            order = self._first_order()
            if isinstance(order, Stop):
                return self._exit("stopped")
            if self._resize(order) == "left":
                return 0
        self.channel.report(ModelBuilt(self.job, self.generation, self.vrank, self.model))
        while True:
            self._check()
            t0, c0 = time.perf_counter(), time.thread_time()
            self._asked = False
            try:
                order = self._agree()
                if order is None:
                    self._train(t0, c0)
                    continue
            except CollectiveFailed:
                order = self._recover()
            if isinstance(order, Stop):
                return self._exit("stopped")
            if isinstance(order, Resize) and self._resize(order) == "left":
                return 0

    def _train(self, t0: float, c0: float) -> None:
        """One step: its work (a sleep), then the trainer's ``_reduce_loss``: the gate of the
        next boundary (whether any rank holds an order) in the all-reduce the step runs
        anyway (the fabric's, timed apart), then rank 0's Progress.

        ``control`` gets ``(generation, step, cost, wall)`` of the boundary, outside the
        step's work and its all-reduce: ``wall`` as the clock saw it (with the CPU the other
        simulated ranks took meanwhile: thousands of threads on 2 cores), ``cost`` what the
        rank itself paid: its own CPU time at a boundary that asked nobody anything, the
        wall time at one that asked the store (a round trip is paid waiting)."""
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        started = time.time()
        if self.halt.event.wait(self.step_s):
            raise _Halted()
        ended = time.time()
        t1, c1 = time.perf_counter(), time.thread_time()
        self.step += 1  # trained (the trainer counts it before the loss's all-reduce)
        holds = self._holds_an_order()
        layout = self.layout
        assert layout is not None  # trained steps have one
        t2, c2 = time.perf_counter(), time.thread_time()
        try:
            self._gate = (self.generation, self.step, self.fabric.all_reduce(
                self.generation, self.step, layout.config.world, holds, self.halt.event,
                self.timeout_s))
        finally:
            t3, c3 = time.perf_counter(), time.thread_time()
            self.gate_wait.append(t3 - t2)
        self._step_ended(started, ended)
        wall += (t2 - t1) + (time.perf_counter() - t3)
        cpu += (c2 - c1) + (time.thread_time() - c3)
        self.control.append((self.generation, self.step - 1,
                             wall if self._asked else cpu, wall))

    def _join(self) -> Any:
        from slurm_etc.protocol.channel import ChannelError

        deadline = time.monotonic() + self.timeout_s
        while True:
            self._check()
            try:
                return self.channel.join(min(5.0, max(0.1, deadline - time.monotonic())),
                                         host=f"sim-{os.getpid()}")
            except ChannelError:
                if time.monotonic() > deadline:
                    raise

    def _first_order(self) -> Any:
        from slurm_etc.protocol.messages import Ready, Resize, Stop

        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            self._check()
            order = self.channel.wait(0.2)
            if isinstance(order, Stop) or (isinstance(order, Resize)
                                           and self.vrank in order.new.devices):
                if isinstance(order, Resize):  # warmed up at once: nothing to import
                    self.channel.report(Ready(self.job, order.generation, self.vrank, 0.0))
                return order
        raise TimeoutError(f"vrank {self.vrank}: no order to join within {self.timeout_s} s")

    def _take_orders(self) -> None:
        while (order := self.channel.poll()) is not None:
            self._consider(order)

    def _consider(self, order: Any) -> None:
        from slurm_etc.protocol.messages import Abort

        if order.generation <= self.generation or order.generation in self._aborted:
            return
        if isinstance(order, Abort):
            if self._pending is not None and self._pending.generation == order.generation:
                self._pending = None
            return
        if self._pending is None or order.generation >= self._pending.generation:
            self._pending = order

    def _holds_an_order(self) -> bool:
        """The trainer's ``_holds_an_order``: an order pending, or the store's connection
        closed (a coordinator died)."""
        self._take_orders()
        return self._pending is not None or self.store.disconnected()

    def _agree(self) -> Any:
        """The trainer's step agreement (``ElasticTrainer._agree``), its exact requests: none
        when the last step's gate said no rank holds an order; else ``_arrive`` (O(1)
        requests a rank: propose, count in, the last closes "no order") and the wait for
        the decision, which the wake key ends at once when the coordinator names the dead.
        A trainer that changes it changes this with it."""
        from slurm_etc.protocol.messages import ORDER_DECODER
        from slurm_etc.protocol.rendezvous import GenerationKeys
        from slurm_etc.protocol.store import StoreUnreachable, Woken, agree_step
        from slurm_etc.worker.trainer import AGREE_SLICE_S, newest_order

        layout = self.layout
        assert layout is not None  # agreed steps have one
        self._take_orders()
        gate, self._gate = self._gate, None
        if gate == (self.generation, self.step, False):
            return None
        self._asked, self._boundary_at = True, time.time()
        rank = self.shared.rank_of(layout, self.vrank)
        names = GenerationKeys(self.job, self.generation)
        own = names.agreement(0, self.step, rank)
        decided = names.agreement(0, self.step, "decided")
        stale = names.agreement(0, self.step - 2, rank) if self.step >= 2 else ""
        arrived = names.agreement(0, self.step, "arrived")
        self._arrive(decided, arrived, layout.config.world)
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._check()
            try:
                got = agree_step(self.store, own, b"-", stale, [decided], AGREE_SLICE_S,
                                 wake=names.lost, seen=self._woken_by)
            except StoreUnreachable:
                self._await_restart()
                self._arrive(decided, arrived, layout.config.world)
                deadline = time.monotonic() + self.timeout_s
                continue
            if isinstance(got, Woken):
                self._woken_by = got.value
                order = ORDER_DECODER.decode(got.value)
                if order.generation > self.generation:
                    self._pending = order
            elif got is not None:
                break
            self._take_orders()
            p = self._pending
            if self._names_the_dead(p):
                self._pending = None
                return p
            if time.monotonic() > deadline:
                raise RuntimeError(f"vrank {self.vrank}: step {self.step} not agreed within "
                                   f"{self.timeout_s} s")
        decision = newest_order(got, self.generation, self._aborted)
        held = self._pending
        if held is None or (decision is not None and held.generation <= decision.generation) \
                or held.generation in self._aborted:
            self._pending = None
        return decision

    def _arrive(self, decided: str, arrived: str, world: int) -> None:
        """The trainer's ``_arrive``: propose what this rank holds, count in, and the last
        rank in closes the decision with "no order"."""
        from slurm_etc.protocol.messages import ENCODER

        if self._pending is not None:
            self.store.compare_set(decided, b"", ENCODER.encode(self._pending))
        if self.store.add(arrived, 1) == world:
            self.store.compare_set(decided, b"", b"-")

    def _names_the_dead(self, order: Any) -> bool:
        from slurm_etc.protocol.messages import Resize

        return (isinstance(order, Resize) and bool(order.lost) and self.layout is not None
                and self.shared.layout_of(order.old) is self.layout)

    def _recover(self) -> Any:
        """The trainer's ``_recover``: a collective failed (a peer died); wait on the channel
        for the coordinator's order naming the dead (or Stop)."""
        from slurm_etc.protocol.messages import Stop

        self._boundary_at = time.time()
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            self._check()
            self._take_orders()
            p = self._pending
            if isinstance(p, Stop) or self._names_the_dead(p):
                self._pending = None
                return p
            if (order := self.channel.wait(0.5)) is not None:
                self._consider(order)
        raise TimeoutError(f"vrank {self.vrank}: no order naming the dead within "
                           f"{self.timeout_s} s")

    def _await_restart(self) -> None:
        """What the trainer does when the store leaves a request unanswered past the
        client's grace (``ElasticTrainer._await_restart``): it takes its coordinator for
        dead, drops the resize it held as aborted, says Hello again each second until a
        coordinator answers, points the store client at the store of the Welcome, says
        its model again and agrees on."""
        from slurm_etc.protocol.messages import ModelBuilt, Resize, Stop

        self.restarts += 1
        if isinstance(self._pending, Resize):
            self._aborted.add(self._pending.generation)
        self._pending = None
        next_hello = 0.0
        while True:
            self._check()
            if time.monotonic() >= next_hello:
                self.channel.rejoin(self.step, self.generation)
                next_hello = time.monotonic() + 1.0
            time.sleep(0.05)
            self._take_orders()
            if isinstance(self._pending, Stop):  # the trainer's CoordinatorLost: it exits
                raise _Lost()
            welcome = self.channel.rendezvous
            if welcome is not None:
                break
        self.store.repoint(welcome.store_host, welcome.store_port)
        self.channel.report(ModelBuilt(self.job, self.generation, self.vrank, self.model))

    def _step_ended(self, started: float, ended: float) -> None:
        from slurm_etc.protocol.messages import Progress, Resumed

        layout = self.layout
        assert layout is not None  # trained steps have one
        if self.shared.rank_of(layout, self.vrank) == 0:
            self.channel.report(Progress(self.job, self.generation, self.vrank, self.step,
                                         1.0, 1e-4, self.step * 8, str(layout.config),
                                         started, ended))
        if self._resumed_due:
            self._resumed_due = False
            self.channel.report(Resumed(self.job, self.generation, self.vrank, self.step,
                                        started, self._last_ended, joined=self._joined))
        self._last_ended = ended

    def _resize(self, order: Any) -> str:
        """The resize's control part (module doc): what goes through the store, and the
        migration group every rank of it joins (old survivors and joiners: the fabric's
        barrier stands for its rendezvous and data phase, which no rank leaves before
        all read the decision), then the report."""
        from slurm_etc.lifecycle import ProcessOutcome
        from slurm_etc.migrate.decision import CommitDecision
        from slurm_etc.protocol.messages import Resized
        from slurm_etc.protocol.rendezvous import GenerationKeys, commit_decision
        from slurm_etc.protocol.store import wait_for_keys

        keys = GenerationKeys(self.job, order.generation)
        old, new = self.shared.layout_of(order.old), self.shared.layout_of(order.new)
        t0 = time.perf_counter()
        lost = set(order.lost)
        if self.layout is not None:
            self.resize_began[order.generation] = self._boundary_at
            publisher = next(v for v in old.devices if v not in lost)
            if self.vrank == publisher:
                self.store.set(keys.trainer, str(self.step).encode())
                self.store.set(keys.last_ended, repr(self._last_ended or time.time()).encode())
        if self.layout is None:
            # a joiner: the trainer state the old layout published, one request that waits
            # at the store, as the trainer's get (its get after the wait reads what came)
            if not wait_for_keys(self.store, [keys.trainer, keys.last_ended], self.timeout_s):
                raise TimeoutError(f"vrank {self.vrank}: no trainer state of generation "
                                   f"{order.generation}")
            self._check()
            self.step = int(self.store.get(keys.trainer))
            self._last_ended = float(self.store.get(keys.last_ended))
        self._joined = self.layout is None
        members = ({v for v in old.devices if v not in lost} | set(new.devices))
        self.fabric.all_reduce(order.generation, MIGRATION_GROUP, len(members), False,
                               self.halt.event, self.timeout_s)
        if self.vrank not in new.devices:
            self.channel.report(Resized(self.job, order.generation, self.vrank,
                                        ProcessOutcome.LEFT, self.step))
            self._exit("left", order.generation)
            return "left"
        committed = CommitDecision(self.store, commit_decision(keys.prefix))(True)
        outcome = ProcessOutcome.COMMITTED if committed else ProcessOutcome.ABORTED
        self.layout, self.generation = new, order.generation
        self._resumed_due = True
        self.channel.report(Resized(self.job, order.generation, self.vrank, outcome,
                                    self.step, pause_seconds=time.perf_counter() - t0))
        return "stay"

    def _exit(self, why: str, generation: int | None = None) -> int:
        from slurm_etc.protocol.messages import Exited

        self.channel.report(Exited(self.job, self.generation if generation is None
                                   else generation, self.vrank, why, self.step))
        return 0


class _Halted(InternalError):
    """A simulated rank was stopped or killed (its backend's StopWorkers, a lost node)."""


class _Lost(InternalError):
    """Told to stop while holding for a restarted coordinator (the trainer's
    ``CoordinatorLost``): the rank says it exits and ends."""


def _host_main(conn: Connection, fabric_conn: Connection, model: Any, step_s: float,
               ranks: int) -> None:
    """A host process: runs the simulated ranks the backend launches on its nodes.

    Commands on ``conn``: ``("launch", generation, [(vrank, env)])``, ``("stop", [vranks])``,
    ``("kill", [vranks])``, ``("quit",)``; it sends ``("exited", vrank, generation, code,
    stopped)`` as ranks end, and ``("control", {vrank: [(gen, step, cost, wall)...]}, failures,
    restarts, gate_waits, began)`` at quit. A rank killed or stopped while in a layout fails
    its generation's collectives at the fabric (its peers' next all-reduce raises).

    The host runs at the idle scheduling class: Linux shares the CPU per thread, and
    thousands of rank threads would otherwise starve the coordinator's few (its handshakes
    time out, its messages go stale) — on a cluster the ranks run on other nodes."""
    logging.basicConfig(level=logging.WARNING)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: the ranks compete as they are
        pass
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass
    fabric = _HostFabric(fabric_conn)
    shared = _Shared(ranks, fabric)
    gate_waits: list[float] = []
    began: dict[int, float] = {}  # generation -> the first of its ranks' resize_began

    def took(r: SimRank) -> None:
        control.setdefault(r.vrank, []).extend(r.control)
        gate_waits.extend(r.gate_wait)
        for g, at in r.resize_began.items():
            began[g] = min(began.get(g, at), at)
    ranks_: dict[int, SimRank] = {}
    restarts = 0  # times a rank held for a restarted coordinator (its ranks' sum)
    ended: queue.Queue[tuple[Any, ...]] = queue.Queue()
    control: dict[int, list[tuple[int, int, float, float]]] = {}

    failures: dict[str, int] = {}

    def done(vrank: int, generation: int, code: int, stopped: bool) -> None:
        ended.put(("exited", vrank, generation, code, stopped))
        why = ranks_[vrank].failure if vrank in ranks_ else ""
        if why:
            kind = why.split(":")[0]
            if kind not in failures:
                logger.warning("simulated vrank %d failed: %s (said once per host)", vrank,
                               why)
            failures[kind] = failures.get(kind, 0) + 1

    while True:
        while True:
            try:
                conn.send(ended.get_nowait())
            except queue.Empty:
                break
        if not conn.poll(0.02):
            continue
        msg = conn.recv()
        if msg[0] == "launch":
            _, generation, workers = msg
            for vrank, env in workers:
                old = ranks_.get(vrank)
                if old is not None:
                    took(old)
                    restarts += old.restarts
                r = SimRank(shared, vrank, generation, env, model, step_s, done)
                ranks_[vrank] = r
                r.thread.start()
        elif msg[0] in ("stop", "kill"):
            for v in msg[1]:
                if (halted := ranks_.get(v)) is not None:
                    if halted.thread.is_alive() and halted.layout is not None:
                        fabric.died(halted.generation)
                    halted.halt.set(msg[0])
        elif msg[0] == "quit":
            for r in ranks_.values():
                r.halt.set("stop")
            for r in ranks_.values():
                r.thread.join(10)
                took(r)
                restarts += r.restarts
            fabric.close()
            while True:
                try:
                    conn.send(ended.get_nowait())
                except queue.Empty:
                    break
            conn.send(("control", control, failures, restarts, gate_waits, began))
            return


# --------------------------------------------------------------------------- the fabric


class CollectiveFailed(InternalError, RuntimeError):
    """A simulated collective of a generation one of whose ranks died (gloo: the closed
    connection fails the peers' all-reduce; NCCL: the watchdog's abort)."""


class _HostFabric:
    """A host process's end of the simulated all-reduce: its ranks' contributions to a
    step's gate (generation, step, world, flag) are summed here and sent on to the fabric
    process in batches (one message per host per step, not one per rank); the fabric's
    answer wakes every waiting rank of the host.

    What it stands for: the few bytes the gate adds to the loss all-reduce every step
    already runs among the ranks (the trainer's ``_reduce_loss``). It costs the coordinator
    nothing and is not control time: a rank's wait in it (for the slowest rank, the CPU
    the other simulated ranks use) is timed apart (``gate_wait_ms``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._cond = threading.Condition()
        self._sums: dict[tuple[int, int], list[int]] = {}  # (gen, step) -> [count, flag, world]
        self._done: dict[tuple[int, int], bool] = {}
        self._failed: set[int] = set()
        self._dead: list[int] = []
        self._thread = threading.Thread(target=self._pump, name="fabric", daemon=True)
        self._closed = False
        self._thread.start()

    def all_reduce(self, generation: int, step: int, world: int, flag: bool,
                   halt: threading.Event, timeout_s: float) -> bool:
        """Whether any rank of the step's world raised ``flag`` (the gate), once all have
        contributed. CollectiveFailed when a rank of ``generation`` died."""
        key = (generation, step)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            got = self._sums.setdefault(key, [0, 0, world])
            got[0] += 1
            got[1] |= int(flag)
            self._cond.notify_all()
            while key not in self._done:
                if generation in self._failed:
                    raise CollectiveFailed(f"generation {generation}: a peer died")
                if halt.is_set():
                    raise _Halted()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the gate of step {step} not reduced in {timeout_s} s")
                self._cond.wait(min(left, 0.5))
            return self._done[key]

    def died(self, generation: int) -> None:
        """A rank of ``generation`` ended without leaving it (killed, stopped): its peers'
        collectives of that generation fail."""
        with self._cond:
            self._dead.append(generation)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5)

    def _pump(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                out: list[tuple[Any, ...]] = [
                    ("sum", g, s, c, f, w) for (g, s), (c, f, w) in self._sums.items() if c]
                for got in self._sums.values():
                    got[0] = got[1] = 0
                out += [("dead", g) for g in self._dead]
                self._dead.clear()
            for msg in out:
                self.conn.send(msg)
            if not self.conn.poll(0.001 if out else 0.005):
                continue
            while self.conn.poll(0):
                msg = self.conn.recv()
                with self._cond:
                    if msg[0] == "done":
                        _, g, s, flag = msg
                        self._done[(g, s)] = flag
                        self._sums.pop((g, s), None)
                        if len(self._done) > 256:  # the oldest answers: read long since
                            for k in sorted(self._done)[:128]:
                                del self._done[k]
                    elif msg[0] == "failed":
                        self._failed.add(msg[1])
                    self._cond.notify_all()


def _fabric_main(conns: Sequence[Connection], contributions: Any) -> None:
    """The fabric process: sums the hosts' contributions to each step's gate and answers
    every host when the step's world is complete; a generation one of whose ranks died
    fails, now and for every later contribution. ``contributions`` (shared) counts the
    ranks' contributions, a figure the benchmark checks."""
    sums: dict[tuple[int, int], list[int]] = {}
    failed: set[int] = set()
    live = list(conns)
    while live:
        for ready in wait(live, timeout=1.0):
            conn = cast(Connection, ready)
            try:
                msg = conn.recv()
            except EOFError:
                live.remove(conn)
                continue
            answer: tuple[Any, ...] | None = None
            if msg[0] == "sum":
                _, g, s, count, flag, world = msg
                with contributions.get_lock():
                    contributions.value += count
                if g in failed:
                    continue
                got = sums.setdefault((g, s), [0, 0])
                got[0] += count
                got[1] |= flag
                if got[0] >= world:
                    del sums[(g, s)]
                    answer = ("done", g, s, bool(got[1]))
            elif msg[0] == "dead" and msg[1] not in failed:
                failed.add(msg[1])
                for key in [k for k in sums if k[0] == msg[1]]:
                    del sums[key]
                answer = ("failed", msg[1])
            elif msg[0] == "quit":
                return
            if answer is not None:
                for c in live:
                    try:
                        c.send(answer)
                    except (BrokenPipeError, OSError):
                        pass


# --------------------------------------------------------------------------- the cluster


class SimCluster:
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
        self.hosts_done = 0
        self.rank_failures: dict[str, int] = {}
        self.rank_restarts = 0
        self.gate_waits: list[float] = []
        self.resize_began: dict[int, float] = {}
        self.failures: list[str] = []

    # -- the scenario -------------------------------------------------------------------
    def on_step(self, step: int) -> None:
        from slurm_etc.coordinator.backend import EndTraining, Grant, Loss, PreemptNotice

        b = self.bench
        if self.phase == "warm" and step >= b.warm_steps:
            self.window = {"step0": step, "at0": self.sample()}
            self.phase = "steady"
        elif self.phase == "steady" and step >= self.window["step0"] + b.steady_steps and \
                time.monotonic() - self.window["at0"]["t"] >= b.steady_min_s:
            self.window.update(step1=step, at1=self.sample())
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

    def _next(self, phase: str, step: int, event: Any) -> None:
        self.spans[phase] = {"at0": self.sample(), "wall": time.time()}
        self.phase = phase
        self.events.append(event)
        self._event_at = time.monotonic()
        self._event_step = step
        self._resizes_before = len(self.coordinator.resize_times)

    def _settled(self, step: int) -> bool:
        """The resize of the current phase committed and ``settle_steps`` trained since
        (or, without a resize, as many steps went by: recorded as none)."""
        c = self.coordinator
        got = self.resizes.get(self.phase)
        if got is None:
            if len(c.resize_times) > self._resizes_before:
                got = self.resizes[self.phase] = {"step": step, "committed": True}
                self.spans[self.phase]["at1"] = self.sample()
            elif step >= self._event_step + 4 * self.bench.settle_steps + 4:
                got = self.resizes[self.phase] = {"step": step, "committed": False}
                self.failures.append(f"{self.phase}: no resize committed")
            else:
                return False
        return bool(step >= got["step"] + self.bench.settle_steps)

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
                    self.hosts_done += 1
        return out

    def request(self, action: Any) -> None:
        pass

    def release(self, action: Any) -> None:
        running = [v for v, w in self._workers.items()
                   if w.device in set(action.devices) and w.running]
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
    from slurm_etc.coordinator.loop import Coordinator, JobSpec
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
    report = ModelReport.of(desc, training.global_batch, training.micro_batch)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(bench.hosts)]
    wires = [ctx.Pipe() for _ in range(bench.hosts)]
    per_host = bench.ranks_per_host
    contributions = ctx.Value("q", 0)
    fabric = ctx.Process(target=_fabric_main, args=([a for a, _ in wires], contributions),
                         daemon=True, name="bench-control-fabric")
    hosts = [ctx.Process(target=_host_main,
                         args=(child, wire, report, bench.step_s, per_host),
                         daemon=True, name=f"bench-control-host-{i}")
             for i, ((_, child), (_, wire)) in enumerate(zip(pipes, wires, strict=True))]
    for h in (fabric, *hosts):
        h.start()
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
        spec = JobSpec(JOB, "bench", ("simulated-rank",), training,
                       # data-parallel layouts only: a node lost is covered by its replicas
                       # (no peer copies to rebuild from in a simulation)
                       EffectivePolicy(grow=False, allowed_tp=(1,), allowed_pp=(1,)),
                       Hardware(gpus_per_node=GPUS_PER_NODE),
                       worker_timeout_s=bench.worker_timeout_s or 60.0 + 0.02 * bench.ranks,
                       prepare_while_training=False)
        coordinator = Coordinator(spec, cluster, store, channel, cluster.topology,
                                  post=lambda k, v: poster.set(k, v))
        cluster.coordinator = coordinator
        t0 = time.monotonic()
        state, ended = "failed", sample()
        try:
            state = coordinator.run(deadline_s=bench.timeout_s)
        finally:
            wall, ended = time.monotonic() - t0, sample()
            cluster.close()
            for parent, _ in pipes:
                try:
                    parent.send(("quit",))
                except OSError:
                    pass
            until = time.monotonic() + 60
            while cluster.hosts_done < len(hosts) and time.monotonic() < until:
                cluster.poll()
                time.sleep(0.05)
            cluster.poll()
            for h in hosts:
                h.join(10)
                if h.is_alive():
                    h.kill()
            wires[0][1].send(("quit",))
            fabric.join(10)
            if fabric.is_alive():
                fabric.kill()
            poster.close()
            channel.close()
            migrations = _migrations(db)
            store.close()
        record_bytes = sum(p.stat().st_size for p in Path(tmp).glob("job.db*"))
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for span in cluster.spans.values():
        span.setdefault("at1", ended)
    return _figures(bench, cluster, state, wall, migrations, record_bytes, peak_kib,
                    rss_before)


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
    timed = [(cost, wall) for per in cluster.control.values() for (g, step, cost, wall) in per
             if g == 0 and w["step0"] <= step < w["step1"]]
    control = [cost for cost, _ in timed]
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
        # control: from the step boundary that took the order up (or the collective that
        # failed) to the commit; the step in flight when the order came is training's
        began = cluster.resize_began.get(m["to"]) if m else None
        resize_s[phase] = (round(m["started"] + m["seconds"] - began, 3)
                           if ok and m and began else None)
        detail[phase] = {
            "outcome": m["outcome"] if m else "none",
            "error": m["error"] if m else "",
            "order_to_commit_s": round(m["seconds"], 3) if ok and m else None,
            "step_in_flight_s": round(began - m["started"], 3) if m and began else None,
            "event_to_settled_s": round(span["at1"]["t"] - span["at0"]["t"], 2),
            # what the coordinator's process spent on it (loop, store, zmq), whatever the
            # ranks' share of the machine: the wall figures above wait for the ranks too
            "coordinator_cpu_s": round(span["at1"]["cpu"] - span["at0"]["cpu"], 2),
            "messages": round(sum(v for k, v in moved.items() if k != "store_reply_bytes")),
            "store_requests": round(moved["store_requests"]),
            "store_replies": round(moved["store_replies"]),
            "store_reply_mb": round(moved["store_reply_bytes"] / 1e6, 1)}
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
                   "gate_wait_ms": round(1e3 * statistics.median(cluster.gate_waits), 2)
                   if cluster.gate_waits else None,
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
    decision, a request at least either way, and every request is answered once. A count
    off those is a miscount (or the gate broken)."""
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
    for phase, got in run["resizes"].items():
        asked, answered = got["store_requests"], got["store_replies"]
        if asked < n * 0.5:
            bad.append(f"resize {phase}: store requests {asked} < half the ranks ({n})")
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

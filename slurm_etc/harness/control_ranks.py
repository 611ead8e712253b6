"""The simulated ranks of ``slurm-etc bench control`` (:mod:`slurm_etc.harness.control`):
the worker's side of the control path, training nothing, many ranks to a host process, and
the *fabric* that stands for the collectives among them.

What a simulated rank is: one greenlet of a host process (gevent: its threads, locks,
events and sleeps patched at the host's start; up to ``ranks_per_host`` ranks, one zmq
context a process) holding its own :class:`~slurm_etc.protocol.channel.WorkerChannel` (one
CURVE connection to the coordinator, which carries its store requests; a green poller)
and running the worker's decisions (:class:`SimRank`). One OS thread a host runs its ranks
in turn, each until it waits (its socket, an event, a sleep). As OS threads, a thousand a
process handed the GIL and the CPU to each other at every wake: one pass of 16,384 rank
threads through a collective took 1-3.5 s on 2 cores (0.07-0.4 s as greenlets, bare).
What that limits, on this machine:

- 16,384 ranks share 2 cores with the coordinator. Host processes run at the idle
  scheduling class, so the coordinator gets the CPU it asks for; a host admits only
  ``JOINS_IN_FLIGHT`` of its ranks to the join at a time (a rank waiting for its Welcome
  polls its socket), so 16,384 ranks join in a queue rather than at once, as a real job's
  ranks would on thousands of nodes at once. The join is therefore slower here than on a
  cluster and is not among the figures.
- Ranks launched with the job pass the training world's rendezvous (a barrier at the
  fabric, standing for ``init_process_group``, which no real rank leaves before every rank
  joined) before their first step boundary: the first boundary's agreement then waits for
  nobody, as on a cluster. A real world's rendezvous goes through the store; here it costs
  the coordinator nothing (the figures exclude world building).
- Every rank of a collective runs once before it completes: a pass of 16,384 ranks costs
  their boundaries' CPU on 2 cores (~1 s a step here, ``gate_wait_ms``), which a resize's
  control time waits out a few times; on a cluster each rank has a core of its own.
- The per-step figures are what a rank pays itself (its host thread's CPU between two
  waits, which no other rank runs in); the clock's view (``step_control_wall_ms``)
  includes the CPU thousands of other simulated ranks took.
"""
from __future__ import annotations

import gc
import logging
import os
import queue
import resource
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from slurm_etc.errors import InternalError

logger = logging.getLogger(__name__)

# descriptors one simulated rank costs its host process (its TCP connection, the socket's
# mailbox, the link monitor's pair, the eventfd that wakes the thread reading the socket)
FDS_PER_SIM_RANK = 5
# the fabric's key of a resize's migration group (a step number no step has)
MIGRATION_GROUP = -1
# the fabric's key of the training world's rendezvous before the first step (another)
WORLD_GROUP = -2
# the fabric's key of a resize's commit decision shared over its migration group (another)
COMMIT_SHARE = -3
# the fabric's key of the step agreement's collective after the gate of step s:
# HELD_EVERYWHERE - s (steps count from 0: below the three above)
HELD_EVERYWHERE = -4
# the fabric's key of a layout's first step, where its ranks find the widest gap and stall
# (the trainer's ``_widest_resumed``; one a generation, below every HELD_EVERYWHERE - s)
RESUMED_GAPS = -(1 << 40)
# what a reduction's lowest and highest key start from (no rank contributed one yet)
_NO_LOW, _NO_HIGH = 1 << 62, -(1 << 62)
# ranks of one host process in the join at once (a rank waiting for its Welcome reads its
# socket every 50 ms and says Hello again every 2 s: 16,384 of them at once on 2 cores keep
# the coordinator's handshakes and Hellos minutes behind, see after-16384-attempt.log)
JOINS_IN_FLIGHT = 8
# how often a host moves what its ranks hold to the collector's permanent generation
# (``gc.freeze``): a thousand ranks' channels, sealers and queues are ~a million objects,
# which each full collection walked again, every rank of the host waiting
FREEZE_EVERY_S = 5.0
# a green poller's longest wait before it asks zmq again (zmq's descriptor signals edges)
_EDGE_S = 1.0
# a rank's wait in a simulated collective looks at its halt this often (a stop or a kill
# wakes it at once: _HostFabric.wake); thousands of ranks waking twice a second each cost
# the 2 cores more than the coordinator
FABRIC_WAIT_S = 10.0
# A waiting WorkerChannel wakes every 20 ms (an order) or 100 ms (a store reply) to look at
# its socket although the socket's poll returns at once when something arrives: free for a
# worker's one channel, but 16,384 ranks' channels waking so are ~1.6 million wake-ups a
# second, more than 2 cores do, and the ranks' requests queue behind them. A host process
# lengthens those slices to this (a reply or an order still ends a wait at once; a link
# drop or a closed channel is seen up to this late). At 1 s, 16,384 waiting ranks still
# woke 16,384 times a second: about a core of the two.
RANK_SOCKET_SLICE_S = 4.0
# ... only in hosts of more ranks than this (the 16,384-rank runs' --ranks-per-host 1024):
# the 4,096-rank run with them everywhere resized 3-5 x slower (under 10 x the load, not
# told apart); hosts of the default 512 keep a real worker's slices
LENGTHEN_SLICES_ABOVE = 512
# a rank waiting for the order that names the dead (its collective failed) looks at its
# halt this often (the order itself ends the wait at once)
RECOVER_WAIT_S = 2.0

# --------------------------------------------------------------------------- the ranks


@dataclass
class _Halt:
    """Why a simulated rank must end now: ``kill`` (its node was lost: it says nothing, as a
    killed process) or ``stop`` (StopWorkers: SIGTERM)."""

    # made when the rank is (a greenlet's event: the host patched threading by then)
    event: threading.Event = field(default_factory=lambda: threading.Event())
    kind: str = ""

    def set(self, kind: str) -> None:
        self.kind = self.kind or kind
        self.event.set()


class _Shared:
    """What the ranks of one host process share: the zmq context, parsed layouts, the
    secret, the host's end of the simulated all-reduce, the join's admission and how long
    the training world's rendezvous may wait for the last rank to join (``world_s``)."""

    def __init__(self, ranks: int, fabric: "_HostFabric", world_s: float) -> None:
        import zmq
        import zmq.green

        # green sockets and pollers: a rank waiting on its socket yields to the others
        self.ctx: Any = zmq.green.Context(io_threads=1)
        self.poller: Any = _green_poller_class()
        self.ctx.set(zmq.MAX_SOCKETS, max(1024, FDS_PER_SIM_RANK * ranks + 64))
        # libzmq starts its threads with a context's first socket: now, in the thread
        # that makes the context (host_main: before it turns to the idle class)
        self.ctx.socket(zmq.PAIR).close(linger=0)
        self.fabric = fabric
        self.admission = _Admission(JOINS_IN_FLIGHT)
        self.world_s = world_s
        self._lock = threading.Lock()
        self._layouts: dict[str, Any] = {}
        self._spec_layouts: dict[tuple[Any, ...], Any] = {}
        self._secrets: dict[str, Any] = {}
        self._ranks: dict[int, dict[int, int]] = {}
        self._members: dict[tuple[int, int, tuple[int, ...]], int] = {}

    def secret(self, path: str) -> Any:
        from slurm_etc.protocol.channel import load_secret

        with self._lock:
            if path not in self._secrets:
                self._secrets[path] = load_secret(path)
            return self._secrets[path]

    # Each is read without the lock once made (a dict look-up is atomic under the GIL):
    # a thousand ranks asking at once queue on a lock each step boundary otherwise.
    def layout(self, text: str) -> Any:
        """The layout of a worker's environment (``LAYOUT``), parsed once per process."""
        from slurm_etc.protocol.messages import parse_layout

        if (got := self._layouts.get(text)) is None:
            with self._lock:
                if text not in self._layouts:
                    self._layouts[text] = parse_layout(text)
                got = self._layouts[text]
        return got

    def layout_of(self, spec: Any) -> Any:
        """The Layout of an order's LayoutSpec, one object per process (ranks are found in
        it by identity)."""
        key = (spec.config, spec.distributed_optimizer, spec.runs)
        if (got := self._spec_layouts.get(key)) is None:
            with self._lock:
                got = self._spec_layouts.get(key)
                if got is None:
                    got = self._spec_layouts[key] = spec.layout()
        return got

    def rank_of(self, layout: Any, vrank: int) -> int:
        if (index := self._ranks.get(id(layout))) is None:
            with self._lock:
                index = self._ranks.get(id(layout))
                if index is None:
                    index = {v: i for i, v in enumerate(layout.devices)}
                    self._ranks[id(layout)] = index
        return index[vrank]

    def holds(self, layout: Any, vrank: int) -> bool:
        """Whether ``vrank`` is a rank of ``layout`` (one dict look-up, not a scan of its
        devices: a thousand ranks a process scanning 18,432 vranks each is the whole
        simulation's O(N^2))."""
        self.rank_of(layout, layout.devices[0])  # the index made
        return vrank in self._ranks[id(layout)]

    def migration_size(self, old: Any, new: Any, lost: tuple[int, ...]) -> int:
        """How many ranks a resize's migration group has (old survivors and joiners),
        counted once per process: a real worker counts it once, as here; a set of 18,432
        vranks held by each of a host's thousand rank threads while they wait in the group
        was ~1 GB a host process at 16,384 ranks (the grows that ran out of memory)."""
        key = (id(old), id(new), lost)
        if (got := self._members.get(key)) is None:
            with self._lock:
                got = self._members.get(key)
                if got is None:
                    gone = set(lost)
                    got = len({v for v in old.devices if v not in gone} | set(new.devices))
                    self._members[key] = got
        return got


def _green_poller_class() -> type:
    """A zmq poller whose wait yields to the other greenlets, for any descriptor number
    (``zmq.green.Poller`` waits in ``select``, which refuses descriptors past 1,023: a host
    of a thousand ranks has thousands). It asks zmq without waiting, and between asks waits
    on gevent's ``poll`` of the sockets' descriptors (zmq's is edge-triggered: every wake,
    and at least every ``_EDGE_S``, asks zmq again)."""
    import zmq
    from gevent import select as green_select

    class GreenPoller(zmq.Poller):
        def poll(self, timeout: float | None = -1) -> list[tuple[Any, int]]:
            deadline = None if timeout is None or timeout < 0 else \
                time.monotonic() + timeout / 1000
            while True:
                events = super().poll(0)
                left = _EDGE_S if deadline is None else deadline - time.monotonic()
                if events or left <= 0:
                    return events
                waiting = green_select.poll()
                for sock, _ in self.sockets:
                    waiting.register(sock.getsockopt(zmq.FD) if isinstance(sock, zmq.Socket)
                                     else sock, green_select.POLLIN)
                waiting.poll(1000 * min(left, _EDGE_S))

    return GreenPoller


class _Admission:
    """Starts a host's rank threads a few at a time: a rank's thread starts when fewer than
    ``limit`` of the host's ranks are between connecting and their Welcome (it calls
    :meth:`joined` when its join ends, either way). 16,384 ranks launched at once join in
    a queue; none of them is a thread before its turn."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._queue: deque[SimRank] = deque()
        self._joining = 0
        self._lock = threading.Lock()
        self._closed = False

    def add(self, rank: "SimRank") -> None:
        with self._lock:
            self._queue.append(rank)
        self._admit()

    def joined(self) -> None:
        with self._lock:
            self._joining -= 1
        self._admit()

    def close(self) -> None:
        """Start no more (the host quits: ranks not started never ran)."""
        with self._lock:
            self._closed = True
            self._queue.clear()

    def _admit(self) -> None:
        with self._lock:
            while self._queue and self._joining < self.limit and not self._closed:
                self._joining += 1
                self._queue.popleft().thread.start()


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
        # generation -> the proposer's wait in its migration group's barrier, which stands
        # for the group's rendezvous and data phase (world building and data, not control),
        # and when it left it (the barrier complete: the commit decision comes next)
        self.group_wait: dict[int, float] = {}
        self.group_left: dict[int, float] = {}
        # generation -> this rank's own control before the data phase: from its boundary
        # (resize_began) to its entry into the migration group's barrier (a rank of the old
        # layout; a joiner waits for the old layout, which is not its work)
        self.own_control: dict[int, float] = {}
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

        try:
            self._join(WorkerChannel)
        finally:
            self.shared.admission.joined()
        self.store = StoreClient.over(self.channel)
        world = self.layout is not None  # launched with the job: the world's rendezvous
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
                if world:
                    world = False
                    self._rendezvous()
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

    def _rendezvous(self) -> None:
        """The training world's rendezvous (``init_process_group``: no rank leaves it before
        every rank of the world joined), a barrier at the fabric; CollectiveFailed when a
        rank of the generation died meanwhile."""
        layout = self.layout
        assert layout is not None  # ranks launched with the job have one
        self.fabric.all_reduce(self.generation, WORLD_GROUP, layout.config.world, False,
                               self.halt.event, self.shared.world_s)

    def _join(self, channel_class: type) -> Any:
        from slurm_etc.protocol.channel import ChannelError

        self.channel = channel_class(self.job, self.vrank, self.address, self.secret,
                                     generation=self.generation, context=self.shared.ctx,
                                     poller=self.shared.poller)
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
            if isinstance(order, Stop) or (isinstance(order, Resize) and self.shared.holds(
                    self.shared.layout_of(order.new), self.vrank)):
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
        when the last step's gate said no rank holds an order; else the collective of the
        order each rank holds (the fabric's: its key's extremes, the newest one given with
        them) and rank 0's one request writing a decided order; where no rank holds an order
        and a store closed (or at a layout's first boundary, no gate yet), one request that arrives
        (propose, count in, the last closes "no order": ``arrive_step``) and waits for the
        decision, then the wait's next slices, which the wake key ends at once when the
        coordinator names the dead. A trainer that changes it changes this with it."""
        from slurm_etc.protocol.messages import ENCODER, ORDER_DECODER
        from slurm_etc.protocol.rendezvous import GenerationKeys
        from slurm_etc.protocol.store import StoreUnreachable, Woken, agree_step, arrive_step
        from slurm_etc.worker.agreement import how_decided, order_key
        from slurm_etc.worker.trainer import agree_slice_s, newest_order

        layout = self.layout
        assert layout is not None  # agreed steps have one
        self._take_orders()
        gate, self._gate = self._gate, None
        if gate == (self.generation, self.step, False):
            return None
        self._asked, self._boundary_at = True, time.time()
        rank = self.shared.rank_of(layout, self.vrank)
        names = GenerationKeys(self.job, self.generation)
        decided = names.agreement(0, self.step, "decided")
        if gate == (self.generation, self.step, True):
            key = order_key(self._pending, self.store.disconnected())
            lowest, highest, given = self.fabric.extremes(
                self.generation, self.step, layout.config.world, key,
                self._pending if key > 1 else None, self.halt.event, self.timeout_s)
            how = how_decided(lowest, highest)
            if how != "store":
                order = self._pending if how == "held" else newest_order(
                    [ENCODER.encode(given)], self.generation, self._aborted)
                if rank == 0 and order is not None:
                    try:
                        self.store.compare_set(decided, "", ENCODER.encode(order))
                    except StoreUnreachable:
                        pass  # the trainer's: only the coordinator's resends are saved
                return self._took(order)
        own = names.agreement(0, self.step, rank)
        stale = names.agreement(0, self.step - 2, rank) if self.step >= 2 else ""
        arrived = names.agreement(0, self.step, "arrived")
        deadline = time.monotonic() + self.timeout_s
        arriving = True
        slice_s = agree_slice_s(layout.config.world)
        while True:
            self._check()
            try:
                if arriving:
                    proposal = b"" if self._pending is None else ENCODER.encode(self._pending)
                    got = arrive_step(self.store, decided, arrived, layout.config.world,
                                      proposal, own, stale, slice_s, wake=names.lost,
                                      seen=self._woken_by)
                    arriving = False
                else:
                    got = agree_step(self.store, own, b"-", stale, [decided], slice_s,
                                     wake=names.lost, seen=self._woken_by)
            except StoreUnreachable:
                self._await_restart()
                arriving = True
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
        return self._took(newest_order(got, self.generation, self._aborted))

    def _took(self, order: Any) -> Any:
        """The trainer's ``_took``: the order held is done with unless newer."""
        held = self._pending
        if held is None or (order is not None and held.generation <= order.generation) \
                or held.generation in self._aborted:
            self._pending = None
        return order

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
            if (order := self.channel.wait(RECOVER_WAIT_S)) is not None:
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
            own = Resumed(self.job, self.generation, self.vrank, self.step, started,
                          self._last_ended, joined=self._joined)
            report = self._widest_resumed(own, layout.config.world)
            if report is not None:
                self.channel.report(report)
        self._last_ended = ended

    def _widest_resumed(self, own: Any, world: int) -> Any:
        """The trainer's ``_widest_resumed``: the layout's widest gap and stall found by one
        collective (the fabric's maxima of the codes); ``own`` where this rank's is
        either, standing for the layout, or where the collective failed; else None."""
        import msgspec

        from slurm_etc.worker.reporting import code_vrank, gap_codes

        gap, stall = gap_codes(own.vrank, own.started, own.last_ended, own.stalled)
        try:
            _, _, widest, _, stalled = self.fabric.reduce(
                self.generation, RESUMED_GAPS, world, False, gap, self.halt.event,
                self.timeout_s, most=stall)
        except CollectiveFailed:
            return own
        mine = code_vrank(widest) == own.vrank, code_vrank(stalled) == own.vrank
        if not any(mine):
            return None
        return msgspec.structs.replace(own, widest_of=world if mine[0] else 0,
                                       stall_of=world if mine[1] else 0)

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
        group = self.shared.migration_size(old, new, tuple(order.lost))
        entered = time.time()
        if not self._joined:
            self.own_control[order.generation] = entered - self._boundary_at
        self.fabric.all_reduce(order.generation, MIGRATION_GROUP, group, False,
                               self.halt.event, self.timeout_s)
        if self.vrank == new.devices[0]:  # the proposer: its commit decision comes next
            left = time.time()
            self.group_wait[order.generation] = left - entered
            self.group_left[order.generation] = left
        # the executor's decision: its group's rank 0 (here new's first rank) asks the
        # store, every rank of the group shares what it got and its data phase (none here)
        decision = CommitDecision(
            self.store, commit_decision(keys.prefix),
            share=lambda known, data_us: (lambda r: ([r[2]], r[4]))(self.fabric.reduce(
                order.generation, COMMIT_SHARE, group, False, known, self.halt.event,
                self.timeout_s, most=data_us)),
            proposer=self.vrank == new.devices[0])
        committed = decision(True, 0.0)
        # shared: the proposer answers for the group (the trainer's _record), nobody else
        # (a loss too: replicas cover it here, nothing is rebuilt)
        for_group = committed and decision.longest_data_s is not None
        if not self.shared.holds(new, self.vrank):
            if not for_group:
                self.channel.report(Resized(self.job, order.generation, self.vrank,
                                            ProcessOutcome.LEFT, self.step))
            self._exit("left", order.generation)
            return "left"
        outcome = ProcessOutcome.COMMITTED if committed else ProcessOutcome.ABORTED
        self.layout, self.generation = new, order.generation
        self._gate = (self.generation, self.step, True)  # the trainer's, once installed
        self._resumed_due = True
        if not for_group or decision.proposer:
            self.channel.report(Resized(self.job, order.generation, self.vrank, outcome,
                                        self.step, pause_seconds=time.perf_counter() - t0,
                                        data_seconds=decision.longest_data_s or 0.0,
                                        for_group=for_group))
        return "stay"

    def _exit(self, why: str, generation: int | None = None) -> int:
        from slurm_etc.protocol.messages import Exited

        if why != "left":  # the trainer's: a process that left at a commit says nothing
            self.channel.report(Exited(self.job, self.generation if generation is None
                                       else generation, self.vrank, why, self.step))
        return 0


class _Halted(InternalError):
    """A simulated rank was stopped or killed (its backend's StopWorkers, a lost node)."""


class _Lost(InternalError):
    """Told to stop while holding for a restarted coordinator (the trainer's
    ``CoordinatorLost``): the rank says it exits and ends."""


def _lengthen_socket_slices() -> None:
    """Lengthen this process's WorkerChannel wait slices to ``RANK_SOCKET_SLICE_S`` (see
    there): the simulation's setting, in the host processes only."""
    from slurm_etc.protocol import channel

    for name in ("_WAIT_SLICE_S", "_LEAD_SLICE_S"):
        if not hasattr(channel, name):
            raise InternalError(f"protocol.channel has no {name}: bench control's hosts "
                                f"lengthen it (harness/control_ranks.py)")
        setattr(channel, name, RANK_SOCKET_SLICE_S)


def _import_what_ranks_use() -> None:
    """Import the modules the ranks import where they use them, now, at the normal class:
    the first rank to import the trainer (torch) would hold the import lock at the idle
    class while a thousand others wait on it."""
    import importlib

    for name in ("slurm_etc.worker.trainer", "slurm_etc.migrate.decision",
                 "slurm_etc.protocol.store", "slurm_etc.protocol.rendezvous",
                 "slurm_etc.protocol.messages", "slurm_etc.lifecycle"):
        importlib.import_module(name)


def _go_green() -> None:
    """Make this host process's threads greenlets (gevent's monkey-patching: threads,
    locks, events, sleeps, select), before any rank starts. A thousand rank threads a
    process handed the GIL and the CPU to each other at every wake: a pass of 16,384 of
    them through a collective took 1-3.5 s on 2 cores; as greenlets one OS thread runs
    them in turn, each until it waits (on its socket, an event, a sleep)."""
    from gevent import monkey

    monkey.patch_all()


class _Readable:
    """Whether a pipe has something to read within a time, waiting as a greenlet
    (``Connection.poll`` would block every rank of the host); one watcher of its descriptor
    for every wait (a ``select`` makes its watchers again each time: the fabric's pump waits
    a thousand times a second)."""

    def __init__(self, conn: Connection) -> None:
        from gevent import get_hub
        from gevent.monkey import get_original
        from gevent.socket import wait

        self._wait = wait
        self._watcher = get_hub().loop.io(conn.fileno(), 1)
        # the kernel's poll, not gevent's, asked without waiting (``Connection.poll``
        # makes a selector each time)
        self._now = get_original("select", "poll")()
        self._now.register(conn.fileno(), get_original("select", "POLLIN"))

    def __call__(self, timeout_s: float) -> bool:
        if self._now.poll(0):
            return True
        if timeout_s > 0:
            try:
                self._wait(self._watcher, timeout_s, _TimedOut)
            except _TimedOut:
                return False
        return bool(self._now.poll(0))


class _TimedOut(InternalError):
    """A green wait's time ran out."""


def _host_setup(fabric_conn: Connection, ranks: int, world_s: float
                ) -> tuple["_HostFabric", _Shared]:
    """A host process made ready for its ranks (its limits, the channels' slices, the
    modules), its fabric end and shared state; then this thread turns to the idle class."""
    logging.basicConfig(level=logging.WARNING)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass
    if ranks > LENGTHEN_SLICES_ABOVE:  # hosts of the default size keep a worker's slices
        _lengthen_socket_slices()
    _import_what_ranks_use()
    # zmq's I/O thread (it answers the links' heartbeats) starts at the normal class:
    # starved for the heartbeats' 30 s, a link drops and its rank's store request fails,
    # as a dead coordinator's would
    fabric = _HostFabric(fabric_conn)
    shared = _Shared(ranks, fabric, world_s)
    try:  # this thread, which runs every rank (Linux: the class is per thread)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: the ranks compete as they are
        pass
    return fabric, shared


def host_main(conn: Connection, fabric_conn: Connection, model: Any, step_s: float,
              ranks: int, world_s: float) -> None:
    """A host process: runs the simulated ranks the backend launches on its nodes.

    Commands on ``conn``: ``("launch", generation, [(vrank, env)])``, ``("stop", [vranks])``,
    ``("kill", [vranks])``, ``("report", path)`` (the ranks' step timings written to ``path``:
    ``({vrank: [(gen, step, cost, wall)...]}, gate_waits)``), ``("quit",)``; it sends
    ``("exited", vrank, generation, code, stopped)`` as ranks end, and ``("control", {vrank:
    [(gen, step, cost, wall)...]}, failures, restarts, gate_waits, began, group_waits,
    group_left, own_control)`` at quit (per generation: the proposer's barrier, the
    host's largest own control of a rank). A rank
    killed or stopped while in a layout fails its generation's collectives at the fabric (its
    peers' next all-reduce raises).

    The ranks (greenlets of the host's one thread, with its fabric pump) run at the idle
    scheduling class: sixteen busy hosts would otherwise take the coordinator's share of
    the 2 cores (its handshakes time out, its messages go stale) — on a cluster the ranks
    run on other nodes. The host's zmq I/O thread keeps the normal class. Ranks start a few at a
    time (:class:`_Admission`); ``world_s`` bounds the world's rendezvous before the
    first step (the coordinator's join timeout)."""
    _go_green()
    host = _Host(conn, *_host_setup(fabric_conn, ranks, world_s), model, step_s)
    readable = _Readable(conn)
    frozen = 0.0
    while True:
        if time.monotonic() - frozen > FREEZE_EVERY_S:
            gc.freeze()
            frozen = time.monotonic()
        host.flush()
        if not readable(0.02):
            continue
        msg = conn.recv()
        if msg[0] == "launch":
            host.launch(msg[1], msg[2])
        elif msg[0] in ("stop", "kill"):
            host.halt(msg[0], msg[1])
        elif msg[0] == "report":
            host.report(msg[1])
        elif msg[0] == "quit":
            host.quit()
            return


class _Host:
    """The simulated ranks of one host process, and what they measured (sent at quit)."""

    def __init__(self, conn: Connection, fabric: Any, shared: Any, model: Any,
                 step_s: float) -> None:
        self.conn, self.fabric, self.shared = conn, fabric, shared
        self.model, self.step_s = model, step_s
        self.ranks: dict[int, SimRank] = {}
        self.ended: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.control: dict[int, list[tuple[int, int, float, float]]] = {}
        self.failures: dict[str, int] = {}
        self.gate_waits: list[float] = []
        self.began: dict[int, float] = {}  # generation -> the first of its ranks' resize_began
        self.group_waits: dict[int, float] = {}  # generation -> its proposer's group_wait
        self.group_left: dict[int, float] = {}  # generation -> when its proposer left it
        self.own_control: dict[int, float] = {}  # generation -> its ranks' largest
        self.restarts = 0  # times a rank held for a restarted coordinator (its ranks' sum)

    def flush(self) -> None:
        """Send the exits queued by the rank threads."""
        while True:
            try:
                self.conn.send(self.ended.get_nowait())
            except queue.Empty:
                return

    def done(self, vrank: int, generation: int, code: int, stopped: bool) -> None:
        """A rank thread ended (called on it): its exit queued, its failure counted."""
        self.ended.put(("exited", vrank, generation, code, stopped))
        why = self.ranks[vrank].failure if vrank in self.ranks else ""
        if why:
            kind = why.split(":")[0]
            if kind not in self.failures:
                logger.warning("simulated vrank %d failed: %s (said once per host)", vrank,
                               why)
            self.failures[kind] = self.failures.get(kind, 0) + 1

    def took(self, r: SimRank) -> None:
        """Keep what a rank measured (it ended, or its vrank is launched again)."""
        self.control.setdefault(r.vrank, []).extend(r.control)
        self.gate_waits.extend(r.gate_wait)
        for g, at in r.resize_began.items():
            self.began[g] = min(self.began.get(g, at), at)
        self.group_waits.update(r.group_wait)
        self.group_left.update(r.group_left)
        for g, own in r.own_control.items():
            self.own_control[g] = max(self.own_control.get(g, own), own)
        self.restarts += r.restarts

    def launch(self, generation: int, workers: list[tuple[int, dict[str, str]]]) -> None:
        for vrank, env in workers:
            old = self.ranks.get(vrank)
            if old is not None:
                self.took(old)
            r = SimRank(self.shared, vrank, generation, env, self.model, self.step_s,
                        self.done)
            self.ranks[vrank] = r
            self.shared.admission.add(r)

    def halt(self, how: str, vranks: list[int]) -> None:
        for v in vranks:
            if (halted := self.ranks.get(v)) is not None:
                if halted.thread.is_alive() and halted.layout is not None:
                    self.fabric.died(halted.generation)
                halted.halt.set(how)
        self.fabric.wake()

    def report(self, path: str) -> None:
        """Write the step timings the ranks hold now (the steady window closed) to
        ``path``: read at the bench's end, where this host may have ended before it said
        them."""
        import pickle

        control = {v: list(r.control) for v, r in self.ranks.items()}
        waits = [w for r in self.ranks.values() for w in list(r.gate_wait)]
        tmp = f"{path}.part"
        with open(tmp, "wb") as f:
            pickle.dump((control, waits), f)
        os.replace(tmp, path)

    def quit(self) -> None:
        """Stop every rank, wait for their threads, and send what they measured."""
        self.shared.admission.close()
        for r in self.ranks.values():
            r.halt.set("stop")
        self.fabric.wake()
        for r in self.ranks.values():
            if r.thread.ident is not None:  # started
                r.thread.join(10)
            self.took(r)
        self.fabric.close()
        self.flush()
        self.conn.send(("control", self.control, self.failures, self.restarts,
                        self.gate_waits, self.began, self.group_waits, self.group_left,
                        self.own_control))


# --------------------------------------------------------------------------- the fabric


class CollectiveFailed(InternalError, RuntimeError):
    """A simulated collective of a generation one of whose ranks died (gloo: the closed
    connection fails the peers' all-reduce; NCCL: the watchdog's abort)."""


class _HostFabric:
    """A host process's end of the simulated all-reduce: its ranks' contributions to a
    step's gate (generation, step, world, flag, key) are reduced here (the flags' or, the
    keys' lowest and highest) and sent on to the fabric process in batches (one message per
    host per step, not one per rank); the fabric's answer wakes every waiting rank of the
    host.

    What it stands for: the few bytes the gate adds to the loss all-reduce every step
    already runs among the ranks (the trainer's ``_reduce_loss``), and after an open gate
    the trainer's small collectives of the order each rank holds (``_decide_together``). It
    costs the coordinator nothing and is not control time: a rank's wait in the gate (for
    the slowest rank, the CPU the other simulated ranks use) is timed apart
    (``gate_wait_ms``)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        # the sums and answers, held briefly; a rank waits on an event of its own, never on
        # this lock nor on one event with the others (a thousand waiters of one condition
        # convoy on its lock each time they wake, longer than the slice between wakes)
        self._lock = threading.Lock()
        # (gen, step) -> [count, flag, world, lowest key, highest key, the highest's order,
        # highest most]
        self._sums: dict[tuple[int, int], list[Any]] = {}
        self._done: dict[tuple[int, int], tuple[bool, int, int, Any, int]] = {}
        # (gen, step) -> its waiters' events, each set when done or failed
        self._ready: dict[tuple[int, int], list[threading.Event]] = {}
        self._failed: set[int] = set()
        self._dead: list[int] = []
        self._thread = threading.Thread(target=self._pump, name="fabric", daemon=True)
        self._closed = False
        self._thread.start()

    def all_reduce(self, generation: int, step: int, world: int, flag: bool,
                   halt: threading.Event, timeout_s: float) -> bool:
        """Whether any rank of the step's world raised ``flag`` (the gate), once all have
        contributed. CollectiveFailed when a rank of ``generation`` died."""
        return bool(self.reduce(generation, step, world, flag, 0, halt, timeout_s)[0])

    def extremes(self, generation: int, step: int, world: int, key: int, order: Any,
                 halt: threading.Event, timeout_s: float) -> tuple[int, int, Any]:
        """The lowest and highest ``key`` the ranks of the step's world gave, and an order
        of a rank that gave the highest (the trainer's all-reduce of the key of the order
        each rank holds after an open gate and, where they differ, its broadcast of the
        newest: ``_decide_together``, ``_given``)."""
        _, lowest, highest, given, _ = self.reduce(generation, HELD_EVERYWHERE - step,
                                                   world, False, key, halt, timeout_s, order)
        return lowest, highest, given

    def reduce(self, generation: int, step: int, world: int, flag: bool, key: int,
               halt: threading.Event, timeout_s: float, order: Any = None,
               most: int = _NO_HIGH) -> tuple[bool, int, int, Any, int]:
        """Any ``flag``, the lowest and highest ``key``, the ``order`` given with the
        highest and the highest ``most``, of the ranks of the step's world, once all have
        contributed. CollectiveFailed when a rank of ``generation`` died."""
        slot = (generation, step)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            got = self._sums.setdefault(slot, [0, 0, world, _NO_LOW, _NO_HIGH, None,
                                               _NO_HIGH])
            got[0] += 1
            got[1] |= int(flag)
            got[3] = min(got[3], key)
            if key > got[4]:
                got[4], got[5] = key, order
            got[6] = max(got[6], most)
            mine = threading.Event()
            self._ready.setdefault(slot, []).append(mine)
        while True:
            # read without the lock (one dict or set look-up: atomic under the GIL), so
            # the ranks a step's answer wakes do not queue for it
            done = self._done.get(slot)
            if done is not None:
                return done
            if generation in self._failed:
                raise CollectiveFailed(f"generation {generation}: a peer died")
            if halt.is_set():
                raise _Halted()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the gate of step {step} not reduced in {timeout_s} s")
            mine.wait(min(left, FABRIC_WAIT_S))
            mine.clear()  # the answer is recorded before the event is set: read above

    def wake(self) -> None:
        """Wake every rank waiting here (one was halted: it ends its wait)."""
        with self._lock:
            waiting = [e for events in self._ready.values() for e in events]
        for event in waiting:
            event.set()

    def died(self, generation: int) -> None:
        """A rank of ``generation`` ended without leaving it (killed, stopped): its peers'
        collectives of that generation fail."""
        with self._lock:
            self._dead.append(generation)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._thread.join(5)

    def _pump(self) -> None:
        readable = _Readable(self.conn)
        while True:
            with self._lock:
                if self._closed:
                    return
                out: list[tuple[Any, ...]] = [
                    ("sum", g, s, c, f, w, lo, hi, given, most)
                    for (g, s), (c, f, w, lo, hi, given, most) in self._sums.items() if c]
                for got in self._sums.values():
                    got[0] = got[1] = 0
                    got[3], got[4], got[5], got[6] = _NO_LOW, _NO_HIGH, None, _NO_HIGH
                out += [("dead", g) for g in self._dead]
                self._dead.clear()
            for msg in out:
                self.conn.send(msg)
            if not readable(0.001 if out else 0.005):
                continue
            while readable(0):
                self._answer(self.conn.recv())

    def _answer(self, msg: tuple[Any, ...]) -> None:
        """The fabric's answer: a step's sum done, or a generation failed; its waiters
        woken."""
        with self._lock:
            if msg[0] == "done":
                _, g, s, flag, lo, hi, given, most = msg
                self._done[(g, s)] = (flag, lo, hi, given, most)
                self._sums.pop((g, s), None)
                woken = self._ready.pop((g, s), [])
                if len(self._done) > 256:  # the oldest answers: read long since
                    for k in sorted(self._done)[:128]:
                        del self._done[k]
            elif msg[0] == "failed":
                self._failed.add(msg[1])
                woken = [e for k, events in self._ready.items() if k[0] == msg[1]
                         for e in events]
            else:
                woken = []
        for event in woken:
            event.set()


def fabric_main(conns: Sequence[Connection], contributions: Any) -> None:
    """The fabric process: sums the hosts' contributions to each step's gate and answers
    every host when the step's world is complete; a generation one of whose ranks died
    fails, now and for every later contribution. ``contributions`` (shared) counts the
    ranks' contributions, a figure the benchmark checks."""
    # (gen, step) -> [count, flag, lowest key, highest key, the highest's order, most]
    sums: dict[tuple[int, int], list[Any]] = {}
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
                _, g, s, count, flag, world, lo, hi, given, most = msg
                with contributions.get_lock():
                    contributions.value += count
                if g in failed:
                    continue
                got = sums.setdefault((g, s), [0, 0, _NO_LOW, _NO_HIGH, None, _NO_HIGH])
                got[0] += count
                got[1] |= flag
                got[2] = min(got[2], lo)
                if hi > got[3]:
                    got[3], got[4] = hi, given
                got[5] = max(got[5], most)
                if got[0] >= world:
                    del sums[(g, s)]
                    answer = ("done", g, s, bool(got[1]), got[2], got[3], got[4], got[5])
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

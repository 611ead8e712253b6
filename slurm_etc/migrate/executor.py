"""Execute this process's part of a MigrationPlan over a transport, two-phase.

Protocol (every process of the migration group runs the same global step list, see
program.py):

1. Check the old shards against the plan and allocate the new shards (fresh tensors).
2. For each step ``i``: post **vote** ``i``, then step ``i``'s sends and receives
   (``batch_isend_irecv``); while they fly, run the local copies (first step), unpack step
   ``i - 1``'s chunk from the other receive buffer and pack step ``i + 1``'s chunk into the
   other send buffer; decide vote ``i``; post vote ``i + 1`` and step ``i + 1`` (the other
   buffers: the wire does not idle between steps), then wait for step ``i`` (bounded). Parts
   of a chunk that are one large contiguous range of a shard are sent from / received into
   the shard directly, without staging. Without ``overlap`` (one buffer each way) step
   ``i + 1`` is packed and posted only after step ``i`` completed.
3. Final **vote**: commit only if every rank voted success at every vote.

Vote 0 is a **gate** unless the ranks agreed on the program before (:func:`agree`, run by
``prepare_resize`` while the job still trains): nothing goes on the wire until every rank
started and agrees on the plan and the chunking. With ``agreed=True`` vote 0 travels with step
0's data like every other vote, and the pause saves a round trip; a rank that could not start
then posts nothing and votes a transport failure, so no peer waits on its operations.

A vote is an allgather of a fixed 512-byte record per rank (status, step, chunk size, plan
digest, error text) over a separate control group. Any failure on any rank (an exception
while packing or unpacking, a receive that timed out, a peer that died, disagreeing plans)
is voted at the next vote; every rank then sees the same table and stops: the executor raises
:class:`MigrationAborted` on every rank, naming the failing ranks, their messages and causes.
Old shards are only ever read, so an abort leaves them untouched; the new shards are dropped.

A new shard that equals an old shard of the same process (same tensor, box and elements,
e.g. a data-parallel replica that stays) is kept whole: the executor hands back the old
tensor itself instead of copying it, so after the commit the old state is dropped, not
trained on. On success the executor returns the new shards; the caller swaps them in (commit). Ranks
without a new rank (a shrink) get none back and may exit.
"""
from __future__ import annotations

import functools
import logging
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InternalError
from .collector import collector_paused
from .dtypes import dtype_for
from .faults import FaultInjector
from .memory import PeakMemory
from .program import (
    DEFAULT_STAGING_BYTES,
    DIRECT_MIN_BYTES,
    STAGING_BUFFERS,
    Program,
    Side,
    Step,
    compile_program,
)
from .shards import LocalShard, state_bytes
from .transport import Transport, TransportError

if TYPE_CHECKING:
    from slurm_etc.plan.plan import MigrationPlan

logger = logging.getLogger(__name__)

VOTE_BYTES = 512
_HEADER = struct.Struct("<B7xqqq")  # status, step, chunk bytes, plan digest
_TEXT_BYTES = VOTE_BYTES - _HEADER.size
OK, FAILED, TRANSPORT_FAILED = 0, 1, 2

# Buffers that an unfinished transport op may still write into after an abort (NCCL kernels,
# gloo pairs being torn down). Never freed, so their memory cannot be reused under them.
_QUARANTINE: list[object] = []


@dataclass(frozen=True)
class MigrationOptions:
    """Knobs of one migration; ``staging_bytes`` must be equal on every rank (it fixes the
    chunking, which the first vote checks).

    Attributes:
        staging_bytes: staging memory per rank: two send and two receive buffers of
            ``staging_bytes // 4`` each; larger messages travel in chunks of that size.
        timeout_s: bound on each step's sends and receives.
        vote_timeout_s: bound on each vote; defaults to ``2 * timeout_s + 10`` so a rank that
            is already voting outlasts a peer still timing out on a receive.
        overlap: pack the next chunk and unpack the previous one while the current one is on
            the wire (else one send and one receive buffer, used in turn).
        measure_memory: record the peak memory growth (CPU RSS or CUDA allocator).
        dtypes: dtype of new shards per state key (default: by itemsize, 4 -> float32,
            2 -> bfloat16); old shards of the same key must have the same element size.
        direct_min_bytes: segments at least this large travel as operations of their own,
            straight from / into the shard when contiguous there (equal on every rank).
    """

    staging_bytes: int = DEFAULT_STAGING_BYTES
    timeout_s: float = 300.0
    vote_timeout_s: float | None = None
    overlap: bool = True
    measure_memory: bool = True
    dtypes: Mapping[str, torch.dtype] | None = None
    direct_min_bytes: int = DIRECT_MIN_BYTES

    @property
    def vote_timeout(self) -> float:
        return self.vote_timeout_s if self.vote_timeout_s is not None else 2 * self.timeout_s + 10


@dataclass
class MigrationStats:
    """What one rank did and how long it took (bytes, seconds, memory)."""

    steps: int = 0
    rounds: int = 0
    chunk_bytes: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    local_bytes: int = 0
    kept_whole_bytes: int = 0  # of local_bytes: new shards that are old shards, not copied
    in_place_bytes: int = 0  # of local_bytes: already where they go (placed before the pause)
    direct_bytes: int = 0
    old_state_bytes: int = 0
    new_state_bytes: int = 0
    staging_budget: int = 0
    staging_bytes: int = 0
    compile_seconds: float = 0.0
    data_seconds: float = 0.0  # from the first step to this rank's last byte in place
    # the migration group's longest data phase, found by its commit decision's share (None:
    # not shared, each rank answers the coordinator itself); the proposer answers for all
    group_data_seconds: float | None = None
    answers_for_group: bool = False
    commit_seconds: float = 0.0  # the commit vote after it
    total_seconds: float = 0.0
    pack_seconds: float = 0.0
    unpack_seconds: float = 0.0
    local_seconds: float = 0.0
    wait_seconds: float = 0.0
    vote_seconds: float = 0.0
    memory_base: int | None = None
    memory_peak: int | None = None
    memory_peak_delta: int | None = None
    memory_reset: bool = False

    @property
    def memory_bound(self) -> int:
        """New state plus the staging budget: what a migration may add to a rank's memory."""
        return self.new_state_bytes + self.staging_budget

    @property
    def peak_over_bound(self) -> float | None:
        if self.memory_peak_delta is None or not self.memory_bound:
            return None
        return self.memory_peak_delta / self.memory_bound

    @property
    def throughput_gibps(self) -> float:
        """Bytes this rank sent and received per second of the data phase, GiB/s."""
        if self.data_seconds <= 0:
            return 0.0
        return (self.sent_bytes + self.received_bytes) / self.data_seconds / 2**30

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out.update(memory_bound=self.memory_bound, peak_over_bound=self.peak_over_bound,
                   throughput_gibps=self.throughput_gibps)
        return out


@dataclass
class MigrationResult:
    """A committed migration: every rank voted success at every vote."""

    device: int
    group_rank: int
    old_rank: int | None
    new_rank: int | None
    new_shards: list[LocalShard]
    stats: MigrationStats

    @property
    def departing(self) -> bool:
        """This process has no rank in the new layout: it exits after the commit."""
        return self.new_rank is None


@dataclass(frozen=True)
class RankFailure:
    """One rank's failed vote: its migration-group rank, device and reason."""

    rank: int
    device: int
    transport: bool
    text: str


class MigrationError(InternalError, RuntimeError):
    """A migration failed (base class)."""


class MigrationAborted(MigrationError):
    """Some rank failed: every rank raises this, with the same failures, and keeps its old state.

    Attributes:
        failures: the failed ranks' votes (rank, device, whether the data path failed, text).
        vote: index of the vote that decided the abort (len(steps) = the commit vote).
        transport_failed: a data or control transfer failed or timed out somewhere: the
            migration group may be unusable; build a fresh one before retrying.
        stats: this rank's statistics up to the abort.
    """

    def __init__(self, message: str, failures: Sequence[RankFailure], vote: int,
                 transport_failed: bool, stats: MigrationStats) -> None:
        super().__init__(message)
        self.failures = tuple(failures)
        self.vote = vote
        self.transport_failed = transport_failed
        self.stats = stats


def _encode_vote(status: int, step: int, chunk: int, digest: int, text: str) -> torch.Tensor:
    raw = text.encode("utf-8")[:_TEXT_BYTES]
    buf = _HEADER.pack(status, step, chunk, digest) + raw + bytes(_TEXT_BYTES - len(raw))
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8)


def _decode_vote(row: torch.Tensor) -> tuple[int, int, int, int, str]:
    raw = bytes(row.tolist())
    status, step, chunk, digest = _HEADER.unpack_from(raw)
    text = raw[_HEADER.size:].rstrip(b"\0").decode("utf-8", errors="replace")
    return status, step, chunk, digest, text


@dataclass
class _Failure:
    text: str
    transport: bool


@dataclass
class _Run:
    prog: Program
    transport: Transport
    options: MigrationOptions
    faults: FaultInjector
    stats: MigrationStats
    old_bytes: list[torch.Tensor] = field(default_factory=list)
    new_bytes: list[torch.Tensor] = field(default_factory=list)
    aliased: set[int] = field(default_factory=set)  # new shards that are old shards
    failure: _Failure | None = None
    t_start: float = 0.0
    new_tensors: list[torch.Tensor] = field(default_factory=list)
    send_bufs: list[torch.Tensor] = field(default_factory=list)
    recv_bufs: list[torch.Tensor] = field(default_factory=list)
    outgoing: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # packed, by step
    local_done: bool = False

    # -- naming ----------------------------------------------------------------------------

    @property
    def who(self) -> str:
        p = self.prog
        return (f"rank {p.group_rank} (device {p.device}, old rank {p.old_rank}, "
                f"new rank {p.new_rank})")

    def fail(self, what: str, exc: BaseException, transport: bool = False) -> None:
        if self.failure is None:
            cause = f"{type(exc).__name__}: {exc}"
            self.failure = _Failure(f"{self.who} {what}: {cause}", transport)
            logger.warning("migration: %s", self.failure.text)
        elif transport:
            self.failure.transport = True

    def where(self, side: Side, step: Step) -> str:
        c0, c1 = self.prog.chunk(side, step)
        return (f"{side.describe()}, chunk {step.chunk + 1}/{side.chunks} (bytes {c0}..{c1}) "
                f"in step {step.index}")

    # -- data ------------------------------------------------------------------------------

    def _direct(self, shards: list[torch.Tensor], side: Side, seg: int, a: int,
                b: int) -> torch.Tensor | None:
        """The shard bytes of stream range [a, b) of a large segment, if contiguous."""
        if seg < 0 or not side.segs.contiguous(seg):
            return None
        t = shards[int(side.segs.shard[seg])]
        start = int(side.segs.offset[seg]) + a - int(side.segs.start[seg])
        return t[start:start + (b - a)]

    def pack(self, side: Side, step: Step, buf: torch.Tensor) -> list[torch.Tensor]:
        """The tensors to send for this step's chunk of ``side``, one per operation."""
        t0 = time.perf_counter()
        c0, c1 = self.prog.chunk(side, step)
        out = []
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for a, b, seg in self.prog.ops(side, step):
            direct = self._direct(self.old_bytes, side, seg, a, b)
            if direct is not None:
                out.append(direct)
                self.stats.direct_bytes += b - a
                continue
            for shard, off, sizes, strides, pos in self.prog.pieces(side, a, b):
                src = self.old_bytes[shard]
                at = a - c0 + pos
                dsts.append(buf[at:at + _prod(sizes)].view(sizes))
                srcs.append(src.as_strided(sizes, strides, src.storage_offset() + off))
            out.append(buf[a - c0:b - c0])
        _copy_all(dsts, srcs)
        self.stats.pack_seconds += time.perf_counter() - t0
        return out

    def scratch(self, side: Side, step: Step, buf: torch.Tensor) -> list[torch.Tensor]:
        """The operations of this step's chunk of ``side`` without packing (a failed rank
        keeps the wire pattern going; what it sends is never installed)."""
        c0, _ = self.prog.chunk(side, step)
        out = []
        for a, b, seg in self.prog.ops(side, step):
            direct = self._direct(self.old_bytes, side, seg, a, b)
            out.append(direct if direct is not None else buf[a - c0:b - c0])
        return out

    def receive_into(self, side: Side, step: Step, buf: torch.Tensor) -> list:
        """(tensor, a, b, staged) per operation of this step's chunk of ``side``."""
        c0, c1 = self.prog.chunk(side, step)
        out = []
        for a, b, seg in self.prog.ops(side, step):
            direct = self._direct(self.new_bytes, side, seg, a, b)
            if direct is not None:
                self.stats.direct_bytes += b - a
                out.append((direct, a, b, False))
            else:
                out.append((buf[a - c0:b - c0], a, b, True))
        return out

    def unpack(self, side: Side, ops: list) -> None:
        t0 = time.perf_counter()
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for tensor, a, b, staged in ops:
            if not staged:
                continue
            for shard, off, sizes, strides, pos in self.prog.pieces(side, a, b):
                dst = self.new_bytes[shard]
                dsts.append(dst.as_strided(sizes, strides, dst.storage_offset() + off))
                srcs.append(tensor[pos:pos + _prod(sizes)].view(sizes))
        _copy_all(dsts, srcs)
        self.stats.unpack_seconds += time.perf_counter() - t0

    def local_copies(self) -> None:
        t0 = time.perf_counter()
        try:
            self.faults.check(self.prog.group_rank, "local")
            dsts: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            for old, new, sizes, old_strides, old_off, new_strides, new_off in (
                    self.prog.local_pieces()):
                if new in self.aliased:
                    continue
                a, b = self.old_bytes[old], self.new_bytes[new]
                if (a.data_ptr() + old_off == b.data_ptr() + new_off
                        and _same_walk(sizes, old_strides, new_strides)):
                    self.stats.in_place_bytes += _prod(sizes)  # placed before the pause
                    continue
                dsts.append(b.as_strided(sizes, new_strides, b.storage_offset() + new_off))
                srcs.append(a.as_strided(sizes, old_strides, a.storage_offset() + old_off))
            _copy_all(dsts, srcs)
        except Exception as exc:  # noqa: BLE001 - voted, then raised on every rank
            self.fail("failed in its local copies", exc)
        self.stats.local_seconds += time.perf_counter() - t0

    def local_copies_once(self) -> None:
        """The local copies, unless done already or this rank failed."""
        if not self.local_done and self.failure is None:
            self.local_copies()
            self.local_done = True

    # -- steps -----------------------------------------------------------------------------

    def pack_step(self, i: int) -> None:
        """Pack step i's outgoing chunk (into send buffer i % 2)."""
        prog = self.prog
        st = prog.steps[i]
        side = prog.sends.get(st.send) if st.send is not None else None
        try:
            if st.chunk == 0:
                self.faults.check(prog.group_rank, "pack", st.round)
            if side is not None:
                self.outgoing[i] = self.pack(side, st,
                                             self.send_bufs[i % len(self.send_bufs)])
        except Exception as exc:  # noqa: BLE001
            self.fail("failed to pack " + (self.where(side, st) if side else f"step {i}"), exc)

    def unpack_step(self, i: int, received: list) -> None:
        """Unpack what step i received; then the 'after' fault of its round."""
        prog = self.prog
        steps = prog.steps
        st = steps[i]
        if self.failure is not None:
            return
        for side, ops in received:
            try:
                if st.chunk == 0:
                    self.faults.check(prog.group_rank, "unpack", st.round)
                self.unpack(side, ops)
            except Exception as exc:  # noqa: BLE001
                self.fail(f"failed to unpack {self.where(side, st)}", exc)
                return
            self.faults.die_if(prog.group_rank, "after-receive")
        if i + 1 == len(steps) or steps[i + 1].round != st.round:
            try:
                self.faults.check(prog.group_rank, "after", st.round)
            except Exception as exc:  # noqa: BLE001
                self.fail(f"failed after round {st.round}", exc)

    def before_round(self, st: Step) -> None:
        """The 'before' fault of a round, at its first chunk."""
        if st.chunk == 0 and self.failure is None:
            try:
                self.faults.check(self.prog.group_rank, "before", st.round)
            except Exception as exc:  # noqa: BLE001
                self.fail(f"failed before round {st.round}", exc)

    def post_step(self, i: int, gated: bool) -> tuple[Any, list, list]:
        """Post vote ``i`` (unless it was the gate) and step ``i``'s operations."""
        st = self.prog.steps[i]
        if i > 0:
            self.before_round(st)
        # Vote i travels with step i's data and is decided before that data is waited
        # for: a rank that failed still posts its operations (without packing or
        # unpacking) unless its transport failed, so no rank waits on a missing
        # operation, and every rank stops at the same vote as with a vote per step.
        ballot = self.post_vote(i) if i > 0 or not gated else None
        recv_buf = self.recv_bufs[i % len(self.recv_bufs)] if self.recv_bufs else None
        send_buf = self.send_bufs[i % len(self.send_bufs)] if self.send_bufs else None
        pending, received = _post(self, st, self.outgoing.pop(i, None), recv_buf, send_buf)
        if pending:
            self.faults.die_if(self.prog.group_rank, "mid-transfer")
        return ballot, pending, received

    # -- votes -----------------------------------------------------------------------------

    def post_vote(self, index: int) -> tuple[object, float]:
        """Post this rank's vote ``index`` (what it knows now); decide it with :meth:`decide`."""
        p = self.prog
        t0 = time.perf_counter()
        f = self.failure
        status = OK if f is None else (TRANSPORT_FAILED if f.transport else FAILED)
        payload = _encode_vote(status, index, p.chunk_bytes, p.digest, f.text if f else "")
        pending = self.transport.start_allgather(payload)
        self.stats.vote_seconds += time.perf_counter() - t0
        return pending, t0

    def decide(self, index: int, posted: tuple[object, float]) -> None:
        """Wait for vote ``index``; raise MigrationAborted on every rank if anyone failed."""
        p = self.prog
        pending, _ = posted
        t0 = time.perf_counter()
        f = self.failure
        try:
            table = pending.wait(self.options.vote_timeout)  # type: ignore[attr-defined]
        except TransportError as exc:
            self.stats.vote_seconds += time.perf_counter() - t0
            own = RankFailure(p.group_rank, p.device, True,
                              f"{self.who} got no answer to vote {index} within "
                              f"{self.options.vote_timeout:.1f} s: {exc}")
            failures = ([RankFailure(p.group_rank, p.device, f.transport, f.text)] if f else [])
            self._abort(index, failures + [own], True)
        self.stats.vote_seconds += time.perf_counter() - t0
        votes = [_decode_vote(table[r]) for r in range(table.shape[0])]
        failures = [RankFailure(r, p.group_devices[r], v[0] == TRANSPORT_FAILED, v[4])
                    for r, v in enumerate(votes) if v[0] != OK]
        for what, pos in (("vote", 1), ("chunk size", 2), ("plan digest", 3)):
            values = {v[pos] for v in votes}
            if len(values) > 1:
                detail = ", ".join(f"rank {r}: {v[pos]}" for r, v in enumerate(votes))
                failures.append(RankFailure(-1, -1, False,
                                            f"ranks disagree on the {what} ({detail}): they "
                                            "execute different plans or staging budgets"))
        if failures:
            self._abort(index, failures, any(x.transport for x in failures))

    def vote(self, index: int) -> None:
        """Cast this rank's vote and wait for everyone's (see :meth:`decide`)."""
        self.decide(index, self.post_vote(index))

    def _abort(self, index: int, failures: list[RankFailure], transport: bool) -> None:
        self.stats.total_seconds = time.perf_counter() - self.t_start
        p = self.prog
        what = "the commit vote" if index == len(p.steps) else f"vote {index}"
        message = (f"migration aborted at {what} on {self.who}; old state kept. "
                   + " | ".join(f.text for f in failures))
        raise MigrationAborted(message, failures, index, transport, self.stats)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for every pair, in one call: a step's hundreds of small segments
    (biases, norms, strided tp halves) cost one dispatch instead of one each."""
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _same_walk(sizes, strides_a, strides_b) -> bool:
    """Whether two strided views of ``sizes`` from one address cover the same bytes in
    the same order (strides of axes of size 1 do not count)."""
    return all(a == b for n, a, b in zip(sizes, strides_a, strides_b) if n != 1)


def _check_old_shards(prog: Program, shards: Sequence[LocalShard],
                      device: torch.device) -> list[torch.Tensor]:
    """The old shards flattened, in spec order; raise ValueError on any mismatch."""
    by_key = {}
    for sh in shards:
        key = sh.key
        if key in by_key:
            raise ValueError(f"shard {key} given twice")
        by_key[key] = sh
    out = []
    for sp in prog.old_specs:
        held = by_key.get(sp.key)
        if held is None:
            raise ValueError(f"old rank {prog.old_rank} must hold shard {sp.key} "
                             f"({sp.numel} elements) and was not given it")
        t = held.tensor
        if t.numel() != sp.numel or t.element_size() != sp.itemsize:
            raise ValueError(f"shard {sp.key}: {t.numel()} elements of {t.element_size()} "
                             f"bytes, the plan says {sp.numel} of {sp.itemsize}")
        if not t.is_contiguous():
            raise ValueError(f"shard {sp.key} is not contiguous")
        if t.device != device:
            raise ValueError(f"shard {sp.key} is on {t.device}, the transport on {device}")
        out.append(t.detach().reshape(-1))
    expected = {sp.key for sp in prog.old_specs}
    extra = sorted(k for k in by_key if k not in expected)
    if extra:
        raise ValueError(f"old rank {prog.old_rank} was given {len(extra)} shard(s) the plan "
                         f"does not place on it, e.g. {extra[0]}")
    return out


def allocate_destinations(prog: Program, options: MigrationOptions | None = None,
                          device: torch.device | str = "cpu", *,
                          prefault: bool = True) -> list[torch.Tensor | None]:
    """Tensors for ``prog``'s new shards (see ``execute_migration(destinations=...)``);
    None for a shard kept whole (``prog.kept``: it is an old shard of this process).

    ``prefault`` writes every page once, so the migration does not pay the first-touch
    page faults of fresh memory (on CPU they halve the receive rate); done before the pause,
    while training continues, that work leaves the downtime. The memory is what the
    two-phase migration holds anyway (new state beside old).
    """
    options = options or MigrationOptions()
    out: list[torch.Tensor | None] = []
    for j, sp in enumerate(prog.new_specs):
        if j in prog.kept:
            out.append(None)  # kept whole: the old shard itself becomes the new one
            continue
        t = torch.empty(sp.numel, dtype=_new_dtype(sp, options), device=device)
        if prefault:
            t.view(torch.uint8).zero_()
        out.append(t)
    return out


def _staging_layout(prog: Program, options: MigrationOptions) -> tuple[tuple[int, int], ...]:
    """(bytes, count) of the send and of the receive staging buffers ``prog`` needs."""
    send_size, recv_size = prog.staging_sizes
    per_side = 2 if options.overlap else 1
    n_send = sum(st.send is not None for st in prog.steps)
    n_recv = sum(st.recv is not None for st in prog.steps)
    return (send_size, min(per_side, n_send)), (recv_size, min(per_side, n_recv))


def staging_bytes(prog: Program, options: MigrationOptions) -> int:
    """Bytes of the staging buffers :func:`allocate_staging` gives ``prog``."""
    return sum(size * count for size, count in _staging_layout(prog, options))


def allocate_staging(prog: Program, options: MigrationOptions, transport: Transport, *,
                     prefault: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The staging buffers ``prog`` packs into and receives into (two of each with
    ``options.overlap``, none where it sends or receives nothing), on the transport's
    device. ``prefault`` writes once the bytes that staged operations will use (not the rest:
    most of a chunk usually goes directly from or into the shards, and untouched pages cost
    no memory)."""
    send, recv = ([transport.empty(size) for _ in range(count)]
                  for size, count in _staging_layout(prog, options))
    if prefault:
        for i, st in enumerate(prog.steps):
            for side, bufs in ((prog.sends[st.send] if st.send is not None else None, send),
                               (prog.recvs[st.recv] if st.recv is not None else None, recv)):
                if side is None or not bufs:
                    continue
                c0, _ = prog.chunk(side, st)
                buf = bufs[i % len(bufs)]
                for a, b, seg in prog.ops(side, st):
                    if seg < 0 or not side.segs.contiguous(seg):
                        buf[a - c0:b - c0].zero_()
    return send, recv


def _check_staging(prog: Program, options: MigrationOptions,
                   staging: tuple[list[torch.Tensor], list[torch.Tensor]],
                   dev: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    for name, bufs, (size, count) in zip(("send", "receive"), staging,
                                         _staging_layout(prog, options)):
        if len(bufs) != count or any(b.numel() < size or b.dtype != torch.uint8
                                     or b.device != dev for b in bufs):
            raise ValueError(f"{name} staging buffers: {len(bufs)} given ("
                             f"{[(b.numel(), str(b.dtype), str(b.device)) for b in bufs]}); "
                             f"this program needs {count} of {size} bytes (uint8) on {dev} "
                             "(see allocate_staging)")
    return list(staging[0]), list(staging[1])


def _new_dtype(sp, options: MigrationOptions, default: torch.dtype | None = None
               ) -> torch.dtype:
    """dtype of a new shard: requested in ``options.dtypes``, else ``default`` (a kept old
    shard's), else by itemsize; ValueError if its element size is not the catalog's."""
    dtype = (options.dtypes or {}).get(sp.state_key) or default or dtype_for(sp.itemsize)
    size = dtype.itemsize
    if size != sp.itemsize:
        raise ValueError(f"dtype {dtype} of {sp.state_key} has {size} bytes per element, the "
                         f"catalog says {sp.itemsize}")
    return dtype


def _check_destinations(prog: Program, tensors: Sequence[torch.Tensor | None],
                        dev: torch.device) -> list[torch.Tensor | None]:
    if len(tensors) != len(prog.new_specs):
        raise ValueError(f"{len(tensors)} destination tensors for {len(prog.new_specs)} new "
                         "shards")
    for j, (sp, t) in enumerate(zip(prog.new_specs, tensors)):
        if t is None:
            if j not in prog.kept:
                raise ValueError(f"no destination for {sp.state_key} {sp.lo}..{sp.hi}, which "
                                 "is not kept in place")
            continue
        if (t.numel() != sp.numel or t.element_size() != sp.itemsize
                or not t.is_contiguous() or t.device != dev):
            raise ValueError(f"destination of {sp.state_key} {sp.lo}..{sp.hi}: {t.numel()} x "
                             f"{t.element_size()} bytes on {t.device} "
                             f"({'' if t.is_contiguous() else 'not '}contiguous); needs "
                             f"{sp.numel} x {sp.itemsize} bytes, contiguous, on {dev}")
    return list(tensors)


def _plain_tensor_ops(func: Callable) -> Callable:
    """Run ``func`` with torch function modes off and without the garbage collector.

    A mode a process installed for its own reasons (megatron's CPU compatibility mode
    rewrites device arguments) would otherwise wrap each of the migration's thousands of
    small tensor calls (checks, views, copies) in Python (0.008 s measured on ``small``);
    none of them creates a tensor on a device by name. See :mod:`.collector` for the
    collector.
    """
    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction(), collector_paused():
            return func(*args, **kwargs)

    return run


@_plain_tensor_ops
def execute_migration(plan: MigrationPlan, transport: Transport, device: int,
                      old_shards: Sequence[LocalShard], *,
                      options: MigrationOptions | None = None,
                      faults: FaultInjector | None = None,
                      program: Program | None = None,
                      destinations: Sequence[torch.Tensor | None] | None = None,
                      commit: Callable[[bool, float], bool] | None = None,
                      agreed: bool = False,
                      staging: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
                      ) -> MigrationResult:
    """Run this process's part of ``plan`` (see module docstring).

    Args:
        plan: the MigrationPlan, identical on every process of the migration group.
        transport: this process's transport; its rank must be the position of ``device`` in
            ``plan.participants`` (the sorted union of old and new devices, minus the
            lost ones).
        device: this process's device id.
        old_shards: the shards the process's old rank holds (empty for a process that joins);
            read only. Shards of state keys the plan does not know are ignored.
        options: staging budget, timeouts, overlap.
        faults: fault injection for tests.
        program: a precompiled ``compile_program(plan, device, options.staging_bytes,
            options.direct_min_bytes)``.
        destinations: where the new shards go, one tensor per ``program.new_specs`` entry
            (e.g. from :func:`allocate_destinations` before the pause, pages already
            touched; or views of the new layout's own buffers): contiguous, on the
            transport's device, of the spec's element count and size. Every element is
            written; on an abort their content is undefined. Default: fresh tensors.
        commit: the commit vote's one decision (a
            :class:`~slurm_etc.migrate.decision.CommitDecision`): given what this rank saw
            of the vote and its data phase's seconds, returns what every rank does. None:
            each rank follows its own view (a rank dying inside the vote can then split the
            survivors).
        agreed: every rank already checked ``program`` against the others' (:func:`agree`
            on the same transport): vote 0 travels with step 0's data instead of gating it.
        staging: the send and receive buffers, from :func:`allocate_staging` before the
            pause (pages touched); default: fresh ones.

    Returns:
        MigrationResult with the new shards (one per state key, region and layer the new
        rank needs; empty for a departing process) and statistics.

    Raises:
        MigrationAborted: on every rank when any rank failed; the old shards are untouched.
    """
    options = options or MigrationOptions()
    faults = faults or FaultInjector()
    t_start = time.perf_counter()
    prog = _checked_program(plan, transport, device, options, program)
    catalog_keys = {st.key for g in plan.catalog.groups for st in g.states}
    stats = _opening_stats(plan, prog, options, t_start)
    run = _Run(prog, transport, options, faults, stats, t_start=t_start)
    memory = PeakMemory(transport.device)
    if options.measure_memory:
        memory.start()
    _start(run, catalog_keys, old_shards, destinations, staging)
    try:
        t_data = time.perf_counter()
        gated = _open_gate(run, agreed)
        _data_steps(run, gated)
        _before_commit(run)
        t_commit = time.perf_counter()
        stats.data_seconds = t_commit - t_data
        _commit_vote(run, len(prog.steps), faults, commit)
        stats.commit_seconds = time.perf_counter() - t_commit
    finally:
        if options.measure_memory:
            memory.stop()
            stats.memory_base, stats.memory_peak = memory.base, memory.peak
            stats.memory_peak_delta, stats.memory_reset = memory.peak_delta, memory.reset
    stats.total_seconds = time.perf_counter() - t_start
    new_shards = [LocalShard(sp.state_key, sp.lo, sp.hi, sp.s, t)
                  for sp, t in zip(prog.new_specs, run.new_tensors)]
    return MigrationResult(device, prog.group_rank, prog.old_rank, prog.new_rank, new_shards,
                           stats)


def _checked_program(plan: MigrationPlan, transport: Transport, device: int,
                     options: MigrationOptions, program: Program | None) -> Program:
    """This device's program (compiled unless given), checked against the options and the
    transport; ValueError where they do not match."""
    if program is None:
        program = compile_program(plan, device, options.staging_bytes, options.direct_min_bytes)
    prog = program
    if (prog.device != device or prog.chunk_bytes * STAGING_BUFFERS > options.staging_bytes
            or prog.direct_min != options.direct_min_bytes):
        raise ValueError("program compiled for another device, staging budget or "
                         "direct_min_bytes")
    if transport.size != len(prog.group_devices) or transport.rank != prog.group_rank:
        raise ValueError(f"device {device} is migration rank {prog.group_rank} of "
                         f"{len(prog.group_devices)} (devices {prog.group_devices}); the "
                         f"transport is rank {transport.rank} of {transport.size}")
    return prog


def _opening_stats(plan: MigrationPlan, prog: Program, options: MigrationOptions,
                   t_start: float) -> MigrationStats:
    """What the program says this rank will move, before anything moves."""
    return MigrationStats(
        steps=len(prog.steps), rounds=plan.rounds, chunk_bytes=prog.chunk_bytes,
        messages_sent=len(prog.sends), messages_received=len(prog.recvs),
        sent_bytes=sum(s.nbytes for s in prog.sends.values()),
        received_bytes=sum(s.nbytes for s in prog.recvs.values()),
        local_bytes=int(prog.stats.get("local_bytes", 0)),
        old_state_bytes=state_bytes(list(prog.old_specs)),
        new_state_bytes=state_bytes(list(prog.new_specs)),
        staging_budget=options.staging_bytes,
        compile_seconds=time.perf_counter() - t_start)


def _start(run: _Run, catalog_keys: set[str], old_shards: Sequence[LocalShard],
           destinations: Sequence[torch.Tensor | None] | None,
           staging: tuple[list[torch.Tensor], list[torch.Tensor]] | None) -> None:
    """Phase 1: check the old state, allocate the new state and the staging buffers. A
    failure is not raised: it is voted at the first vote."""
    prog, options, stats = run.prog, run.options, run.stats
    dev = run.transport.device
    try:
        run.faults.check(prog.group_rank, "start")
        mine = [sh for sh in old_shards if sh.state_key in catalog_keys]
        old_flat = _check_old_shards(prog, mine, dev)
        run.old_bytes = [t.view(torch.uint8) for t in old_flat]
        slots = (_check_destinations(prog, destinations, dev) if destinations is not None
                 else allocate_destinations(prog, options, dev, prefault=False))
        for j, slot in enumerate(slots):
            if slot is None:  # a kept shard (checked above): the old one is the new one, no copy
                old = old_flat[prog.kept[j]]
                slot = old.view(_new_dtype(prog.new_specs[j], options, old.dtype))
                run.aliased.add(j)
                stats.kept_whole_bytes += prog.new_specs[j].nbytes
            run.new_tensors.append(slot)
        run.new_bytes = [t.view(torch.uint8) for t in run.new_tensors]
        run.send_bufs, run.recv_bufs = (
            _check_staging(prog, options, staging, dev) if staging is not None
            else allocate_staging(prog, options, run.transport, prefault=False))
        stats.staging_bytes = sum(b.numel() for b in run.send_bufs + run.recv_bufs)
    except Exception as exc:  # noqa: BLE001 - voted at the first vote
        run.fail("could not start", exc)


def _open_gate(run: _Run, agreed: bool) -> bool:
    """Pack step 0 and, unless the ranks agreed before, hold vote 0 as the gate; returns
    whether vote 0 was the gate."""
    steps = run.prog.steps
    gated = not agreed
    if not steps:
        return gated
    if run.failure is None:
        run.pack_step(0)
    run.before_round(steps[0])
    run.faults.die_if(run.prog.group_rank, "before-send")
    if gated:
        # Vote 0 is the gate: nothing goes on the wire before every rank started
        # and agrees on the plan and the chunking. The local copies need no peer:
        # they run while the vote travels (and while slower ranks still arrive).
        gate = run.post_vote(0)
        run.local_copies_once()
        run.decide(0, gate)
    elif run.failure is not None:
        # could not start (no buffers, no destinations): post nothing, and vote
        # so that no peer waits on this rank's operations
        run.failure.transport = True
    return gated


def _data_steps(run: _Run, gated: bool) -> None:
    """Phase 2: every step's sends and receives, each with its vote, the next step packed
    and posted (with ``overlap``) while the current one is on the wire."""
    steps, overlap = run.prog.steps, run.options.overlap
    previous: tuple[int, list] | None = None  # (step, received) not yet unpacked
    ahead: tuple[Any, list, list] | None = None  # the next step, posted already
    for i, st in enumerate(steps):
        ballot, pending, received = ahead if ahead is not None else run.post_step(i, gated)
        ahead = None
        run.local_copies_once()  # while the first step's data is on the wire
        if overlap:
            if previous is not None:
                run.unpack_step(*previous)
                previous = None
            if i + 1 < len(steps) and run.failure is None:
                run.pack_step(i + 1)
        if ballot is not None:
            _decide_step(run, i, ballot, pending)
        if overlap and i + 1 < len(steps):
            # Step i + 1 goes on the wire before step i is waited for: its buffers are
            # the other pair (step i - 1's, sent and unpacked above), and every rank
            # posts it after deciding vote i, so an abort there leaves nothing posted
            # ahead. A failure seen while waiting for step i is voted one vote later.
            ahead = run.post_step(i + 1, gated)
        if _wait(run, st, pending):
            previous = (i, received)
        if not overlap:
            if previous is not None:
                run.unpack_step(*previous)
                previous = None
            if i + 1 < len(steps) and run.failure is None:
                run.pack_step(i + 1)
    if previous is not None:
        run.unpack_step(*previous)


def _decide_step(run: _Run, i: int, ballot: Any, pending: list) -> None:
    """Decide vote ``i``; on an abort, leave nothing of step ``i`` behind that can be
    waited for, and raise."""
    try:
        run.decide(i, ballot)
    except MigrationAborted as exc:
        if exc.transport_failed:
            _QUARANTINE.append(pending)
        else:  # every rank posted this step: let it complete, leave nothing behind
            _wait(run, run.prog.steps[i], pending)
        raise


def _before_commit(run: _Run) -> None:
    """The last local copies (a program without steps), then the device settled and the
    commit fault checked: what fails here is voted at the commit vote."""
    rank = run.prog.group_rank
    run.local_copies_once()
    if run.failure is None:
        try:
            _settle_device(run.transport.device)
        except RuntimeError as exc:  # an asynchronous CUDA error: voted, not raised
            run.fail("the device failed before the commit vote", exc)
    if run.failure is None:
        try:
            run.faults.check(rank, "commit")
        except Exception as exc:  # noqa: BLE001
            run.fail("failed before the commit vote", exc)
    run.faults.die_if(rank, "before-commit")


def agree(transport: Transport, program: Program, timeout_s: float = 300.0) -> None:
    """Check, collectively over the migration group, that every rank compiled the same plan
    and chunking (what vote 0 checks otherwise), so that ``execute_migration(...,
    agreed=True)`` can put step 0's data on the wire with vote 0. Run before the pause.

    Raises:
        ValueError: naming each rank's digest and chunk size when they differ.
    """
    mine = torch.tensor([program.digest, program.chunk_bytes, program.direct_min],
                        dtype=torch.int64, device="cpu")  # votes travel in host memory
    table = transport.allgather(mine.view(torch.uint8), timeout_s).view(torch.int64)
    rows = [tuple(int(x) for x in table[r]) for r in range(table.shape[0])]
    if len(set(rows)) > 1:
        detail = ", ".join(f"rank {r}: digest {d:x}, chunk {c}, direct {m}"
                           for r, (d, c, m) in enumerate(rows))
        raise ValueError(f"the migration's ranks compiled different programs ({detail}): "
                         "they execute different plans or staging budgets")


def _settle_device(device: torch.device) -> None:
    """On a GPU, wait for every copy and unpack queued on the device (they run
    asynchronously): an error among them surfaces here, before this rank votes to commit.
    Nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _commit_vote(run: _Run, index: int, faults: FaultInjector,
                 commit: Callable[[bool, float], bool] | None) -> None:
    """The commit vote, then its one decision (see :mod:`slurm_etc.migrate.decision`): a
    rank whose view of the vote failed still commits when another rank saw every vote OK
    first (every rank had finished its part), and one that saw them all OK aborts when the
    failure was recorded first."""
    rank = run.prog.group_rank
    posted = run.post_vote(index)
    faults.die_if(rank, "in-vote")
    try:
        run.decide(index, posted)
        if faults.vote_lost(rank):
            run._abort(index, [RankFailure(rank, run.prog.device, True, f"{run.who} lost "
                                           "the answer to the commit vote (injected)")], True)
    except MigrationAborted:
        if commit is None:
            raise
        if run.failure is not None:
            # its own vote failed: abort, but it takes part in the decision
            commit(False, run.stats.data_seconds)
            raise
        if not commit(False, run.stats.data_seconds):
            raise
        logger.warning("migration: %s saw the commit vote fail, but the decision recorded "
                       "first is commit: it commits", run.who)
        return
    if commit is not None and not commit(True, run.stats.data_seconds):
        run._abort(index, [RankFailure(-1, -1, False, "another rank saw the commit vote "
                                       "fail first: the decision is abort")], False)


def _post(run: _Run, st: Step, send: list[torch.Tensor] | None,
          recv_buf: torch.Tensor | None, send_buf: torch.Tensor | None = None
          ) -> tuple[list, list]:
    """Post the step's operations. Returns ((kind, side, pending) per operation,
    [(side, receive ops)] to unpack once they completed).

    After a failure of this rank's own (not of its transport) the operations are still
    posted, from and into the same buffers, unpacked and not to be unpacked: the peers'
    operations complete and the abort comes at the vote that carries the failure.
    """
    prog = run.prog
    failed = run.failure is not None
    if failed and run.failure.transport:  # type: ignore[union-attr]
        return [], []
    sends, recvs, sides, received = [], [], [], []
    if st.send is not None:
        side = prog.sends[st.send]
        if send is None and send_buf is not None:
            send = run.scratch(side, st, send_buf)
        if run.faults.stalled(prog.group_rank, st.round):
            logger.warning("migration: %s stalls (injected): not sending %s", run.who,
                           run.where(side, st))
        elif send is not None:
            sends += [(side.peer, t) for t in send]
            sides += [("send", side)] * len(send)
    if st.recv is not None and recv_buf is not None:
        side = prog.recvs[st.recv]
        ops = run.receive_into(side, st, recv_buf)
        recvs += [(side.peer, t) for t, _, _, _ in ops]
        sides += [("receive", side)] * len(ops)
        if not failed:
            received.append((side, ops))
    if not sides:
        return [], received
    try:
        pending = run.transport.exchange(sends, recvs, tag=st.index)
    except TransportError as exc:
        run.fail(f"could not post step {st.index}", exc, transport=True)
        _QUARANTINE.append((sends, recvs))
        return [], []
    return [(kind, side, p) for (kind, side), p in zip(sides, pending)], received


def _wait(run: _Run, st: Step, pending: list) -> bool:
    """Wait for the step's operations (one deadline for all); True if they all completed.

    Operations posted before this rank's transport failed (the next step goes on the wire
    before the current one is waited for) are not waited for: they are set aside."""
    if not pending:
        return run.failure is None
    if run.failure is not None and run.failure.transport:
        _QUARANTINE.append(pending)
        return False
    t0 = time.perf_counter()
    deadline = time.monotonic() + run.options.timeout_s
    broken = False
    for kind, side, p in pending:
        try:
            p.wait(max(deadline - time.monotonic(), 0.0))
        except TransportError as exc:
            if not broken:
                verb = ("timed out " if exc.timed_out else "failed ") + \
                    ("sending" if kind == "send" else "receiving")
                run.fail(f"{verb} {run.where(side, st)}", exc, transport=True)
            broken = True
    run.stats.wait_seconds += time.perf_counter() - t0
    if broken:
        _QUARANTINE.append(pending)
    return not broken

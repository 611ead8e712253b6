"""One process's part of a MigrationPlan, compiled into byte segments and steps (pure).

Packing format of a message (both ends derive it from the plan alone):

* A message is ``plan.transfers[start:end]`` in plan order; transfer ``k`` occupies bytes
  ``[offset[k], offset[k] + nbytes[k])`` of the message (the planner's offset table).
* Inside a transfer, the states of its tensor group follow in catalog order
  (``TensorGroup.states``); each state contributes the fragment's elements in row-major
  order of the fragment's box interval (``interval_boxes``), as that state's raw bytes.
  States of different itemsize (bf16 params next to fp32 moments) simply follow each other:
  the stream is bytes, nothing is aligned or padded.
* A *segment* is one sub-box of the fragment (split per layer for stacked tensors) of one
  state: a contiguous byte range of the message and a strided byte view of one shard.

Chunking: with a staging budget of ``B`` bytes a rank holds two send buffers (one packed while
the other is on the wire) and two receive buffers (one unpacked while the other fills), so a
chunk is ``C = B // 4`` bytes. Message ``m`` travels as ``ceil(nbytes / C)`` chunks
``[j*C, min((j+1)*C, nbytes))``. Round ``r`` of the plan becomes ``max_m ceil(nbytes_m / C)``
steps; every rank walks the same global step list, sending and receiving chunk ``j`` of its
round-``r`` messages in step ``(r, j)``. A chunk boundary may cut a segment anywhere, even
inside an element: the cut is a row-major interval of the segment's byte box, which
``interval_boxes`` turns into a few strided views again.

Operations: a chunk travels as one or more point-to-point operations, split at the edges of
*large* segments (at least ``DIRECT_MIN_BYTES``): each part of a large segment is an
operation of its own, each run of small segments between them is one operation. The split
depends only on segment sizes, which both ends share, so the operations pair up. An
operation that is one large segment contiguous in this rank's shard is sent from / received
into the shard directly; every other operation goes through the staging buffer, at its
offset in the chunk.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import numpy as np

from slurm_etc.plan.boxes import box_offset, box_strides, interval_boxes
from slurm_etc.plan.fingerprint import plan_fingerprint

from .shards import ShardSpec, shard_specs

if TYPE_CHECKING:
    from slurm_etc.plan.plan import MigrationPlan

# Two send and two receive buffers of one chunk each fit in the staging budget.
STAGING_BUFFERS = 4
DEFAULT_STAGING_BYTES = 256 << 20
# Segments at least this large travel as their own operation (directly when contiguous).
DIRECT_MIN_BYTES = 256 << 10


def chunk_bytes_for(staging_bytes: int) -> int:
    """Chunk size every rank derives from the (common) staging budget."""
    if staging_bytes < STAGING_BUFFERS:
        raise ValueError(f"staging budget ({staging_bytes} bytes) must be at least "
                         f"{STAGING_BUFFERS} bytes (two send and two receive buffers)")
    return staging_bytes // STAGING_BUFFERS


def num_chunks(nbytes: int, chunk: int) -> int:
    return -(-int(nbytes) // chunk)


def chunk_range(nbytes: int, chunk: int, j: int) -> tuple[int, int]:
    """Bytes ``[c0, c1)`` of a message that chunk ``j`` carries."""
    return j * chunk, min((j + 1) * chunk, int(nbytes))


@dataclass(frozen=True)
class Segments:
    """Contiguous byte ranges of one message stream (or of the local copies), one row each.

    Row i: bytes ``[start[i], start[i] + nbytes[i])`` of the stream are the strided byte view
    ``as_strided(sizes[i], strides[i], offset[i])`` of shard ``shard[i]``'s flat bytes.
    """

    shard: np.ndarray    # int64 index into the side's shard list
    offset: np.ndarray   # int64 byte offset into that shard
    sizes: np.ndarray    # int64 (n, 3) byte-box extents (last axis in bytes)
    strides: np.ndarray  # int64 (n, 3) byte strides (last is 1)
    start: np.ndarray    # int64 byte offset in the stream
    nbytes: np.ndarray   # int64

    def __len__(self) -> int:
        return len(self.shard)

    @property
    def total(self) -> int:
        return int(self.nbytes.sum()) if len(self) else 0

    def ops(self, c0: int, c1: int,
            direct_min: int = DIRECT_MIN_BYTES) -> list[tuple[int, int, int]]:
        """Operations of stream bytes ``[c0, c1)``: ``(a, b, segment)`` partitioning it, where
        ``segment`` is the large segment the operation lies in, or -1 for a run of small
        segments. A function of segment sizes only: both ends of a message get the same list."""
        end = self.start + self.nbytes
        first = int(np.searchsorted(end, c0, side="right"))
        last = int(np.searchsorted(self.start, c1, side="left"))
        out: list[tuple[int, int, int]] = []
        run = None
        for i in range(first, last):
            a, b = max(int(self.start[i]), c0), min(int(end[i]), c1)
            if int(self.nbytes[i]) >= direct_min:
                if run is not None:
                    out.append((run[0], run[1], -1))
                    run = None
                out.append((a, b, i))
            else:
                run = (run[0], b) if run is not None else (a, b)
        if run is not None:
            out.append((run[0], run[1], -1))
        return out

    def contiguous(self, i: int) -> bool:
        """Whether segment ``i`` is one contiguous byte range of its shard."""
        expect = 1
        for k in range(2, -1, -1):
            size = int(self.sizes[i, k])
            if size > 1 and int(self.strides[i, k]) != expect:
                return False
            expect *= size
        return True

    def pieces(self, c0: int, c1: int) -> Iterator[tuple[int, int, tuple, tuple, int]]:
        """Views covering stream bytes ``[c0, c1)``: (shard, offset, sizes, strides, pos)
        where ``pos`` is the byte position relative to ``c0``."""
        end = self.start + self.nbytes
        first = int(np.searchsorted(end, c0, side="right"))
        last = int(np.searchsorted(self.start, c1, side="left"))
        for i in range(first, last):
            s0, n = int(self.start[i]), int(self.nbytes[i])
            a, b = max(c0 - s0, 0), min(c1 - s0, n)
            sizes = tuple(int(x) for x in self.sizes[i])
            strides = tuple(int(x) for x in self.strides[i])
            base = int(self.offset[i])
            shard = int(self.shard[i])
            if a == 0 and b == n:
                yield shard, base, sizes, strides, s0 - c0
                continue
            pos = s0 + a - c0
            for lo, hi in interval_boxes((0, 0, 0), sizes, a, b):
                sub = tuple(h - low for low, h in zip(lo, hi))
                off = base + sum(low * st for low, st in zip(lo, strides))
                yield shard, off, sub, strides, pos
                pos += _prod(sub)


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


class _SegmentBuilder:
    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def add(self, shard: int, offset: int, sizes, strides, start: int, nbytes: int) -> None:
        self.rows.append((shard, offset, *sizes, *strides, start, nbytes))

    def build(self) -> Segments:
        a = np.array(self.rows, np.int64).reshape(len(self.rows), 10)
        return Segments(a[:, 0], a[:, 1], a[:, 2:5], a[:, 5:8], a[:, 8], a[:, 9])


@dataclass(frozen=True)
class Side:
    """One message as this rank packs it (send) or unpacks it (receive)."""

    msg: int
    src_device: int
    dst_device: int
    peer: int        # migration-group rank of the other end
    nbytes: int
    round: int
    chunks: int
    segs: Segments

    def describe(self) -> str:
        return (f"message {self.msg} (device {self.src_device} -> device {self.dst_device}, "
                f"{self.nbytes} bytes, round {self.round})")


@dataclass(frozen=True)
class Step:
    """One exchange: chunk ``chunk`` of every message of plan round ``round``."""

    index: int
    round: int
    chunk: int
    send: int | None  # message this rank sends a chunk of, if any
    recv: int | None  # message this rank receives a chunk of, if any


@dataclass(frozen=True)
class Program:
    """What one process does in a migration (see module docstring)."""

    device: int
    group_devices: tuple[int, ...]
    old_rank: int | None
    new_rank: int | None
    old_specs: tuple[ShardSpec, ...]
    new_specs: tuple[ShardSpec, ...]
    chunk_bytes: int
    sends: dict[int, Side]
    recvs: dict[int, Side]
    local_src: Segments   # local copies: row i of local_src goes to row i of local_dst
    local_dst: Segments
    steps: tuple[Step, ...]
    digest: int
    direct_min: int = DIRECT_MIN_BYTES
    stats: dict = field(default_factory=dict)
    # new shard -> old shard of this device that it equals byte for byte (same tensor, box
    # and elements, all of it a local copy in place): kept whole, no copy needed
    kept: dict[int, int] = field(default_factory=dict)
    # operations and pieces per step, computed once (see :meth:`ops`, :meth:`warm`)
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def group_rank(self) -> int:
        return self.group_devices.index(self.device)

    @property
    def departing(self) -> bool:
        return self.new_rank is None

    @property
    def staging_sizes(self) -> tuple[int, int]:
        """(send buffer, receive buffer) bytes this rank needs: at most one chunk each."""
        send = max((min(s.nbytes, self.chunk_bytes) for s in self.sends.values()), default=0)
        recv = max((min(s.nbytes, self.chunk_bytes) for s in self.recvs.values()), default=0)
        return send, recv

    def chunk(self, side: Side, step: Step) -> tuple[int, int]:
        return chunk_range(side.nbytes, self.chunk_bytes, step.chunk)

    def ops(self, side: Side, step: Step) -> list[tuple[int, int, int]]:
        """The operations this step's chunk of ``side`` travels as (see module docstring);
        computed once (:meth:`warm` computes them all before the pause)."""
        key = (side.msg, step.index)
        ops = self._memo.get(key)
        if ops is None:
            c0, c1 = self.chunk(side, step)
            ops = self._memo[key] = side.segs.ops(c0, c1, self.direct_min)
        return ops

    def pieces(self, side: Side, a: int, b: int) -> list[tuple[int, int, tuple, tuple, int]]:
        """``side.segs.pieces(a, b)`` as a list, computed once."""
        key = (side.msg, a, b)
        pieces = self._memo.get(key)
        if pieces is None:
            pieces = self._memo[key] = list(side.segs.pieces(a, b))
        return pieces

    def local_pieces(self) -> list[tuple[int, int, tuple, tuple, int, tuple, int]]:
        """The local copies, computed once: (old shard, new shard, sizes, old strides, old
        byte offset, new strides, new byte offset) each."""
        pieces = self._memo.get("local")
        if pieces is None:
            src, dst = self.local_src, self.local_dst
            pieces = self._memo["local"] = [
                (int(src.shard[i]), int(dst.shard[i]), tuple(int(x) for x in src.sizes[i]),
                 tuple(int(x) for x in src.strides[i]), int(src.offset[i]),
                 tuple(int(x) for x in dst.strides[i]), int(dst.offset[i]))
                for i in range(len(src))]
        return pieces

    def warm(self) -> None:
        """Compute every step's operations and the pieces of every operation that may be
        staged, and the local copies, so that the data phase only builds views (run before
        the pause)."""
        self.local_pieces()
        for st in self.steps:
            sides = ([self.sends[st.send]] if st.send is not None else []) + \
                ([self.recvs[st.recv]] if st.recv is not None else [])
            for side in sides:
                for a, b, seg in self.ops(side, st):
                    if seg < 0 or not side.segs.contiguous(seg):
                        self.pieces(side, a, b)


def group_devices(plan: MigrationPlan) -> tuple[int, ...]:
    """Devices of the migration group: ``plan.participants`` (old ∪ new minus the lost
    devices, sorted; group rank = position)."""
    return tuple(plan.participants)


def program_digest(plan: MigrationPlan, chunk_bytes: int,
                   direct_min: int = DIRECT_MIN_BYTES) -> int:
    """A 63-bit fingerprint of what the ranks' programs must agree on: the plan's
    fingerprint and the chunking."""
    h = hashlib.blake2b(plan_fingerprint(plan), digest_size=8)
    h.update(repr((chunk_bytes, direct_min)).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def _layout_rank(devices: tuple[int, ...], device: int) -> int | None:
    return devices.index(device) if device in devices else None


def _piece_shard(multi_layer: bool, lo: tuple, hi: tuple, s: int, layer: int):
    if multi_layer:
        return (layer, lo[1], lo[2]), (layer + 1, hi[1], hi[2]), 0
    return lo, hi, s


def _transfer_segments(plan: MigrationPlan, k: int, old_side: bool, index: dict,
                       out: _SegmentBuilder, start: int) -> int:
    """Append the segments of transfer ``k`` (old side reads old shards, else new shards);
    returns the stream position after it."""
    frag = plan.fragments
    f = int(plan.transfers.frag[k])
    table = plan.old_regions if old_side else plan.new_regions
    row = int(frag.old_row[f] if old_side else frag.new_row[f])
    gi = int(table.group[row])
    g = plan.catalog.groups[gi]
    rlo = tuple(int(x) for x in table.lo[row])
    rhi = tuple(int(x) for x in table.hi[row])
    rs = int(table.s[row])
    multi = g.stacked and rhi[0] - rlo[0] > 1
    pieces = []
    for plo, phi in interval_boxes(frag.lo[f], frag.hi[f], int(frag.u[f]), int(frag.v[f])):
        if g.stacked:
            for layer in range(plo[0], phi[0]):
                pieces.append(((layer, *plo[1:]), (layer + 1, *phi[1:])))
        else:
            pieces.append((plo, phi))
    pos = start
    for state in g.states:
        isz = state.itemsize
        for plo, phi in pieces:
            slo, shi, ss = _piece_shard(multi, rlo, rhi, rs, plo[0])
            shard = index[(state.key, slo, shi, ss)]
            st = box_strides(slo, shi)
            elem = box_offset(slo, shi, plo) - ss
            sizes = [b - a for a, b in zip(plo, phi)]
            nbytes = _prod(sizes) * isz
            sizes[-1] *= isz
            out.add(shard, elem * isz, sizes, (st[0] * isz, st[1] * isz, 1), pos, nbytes)
            pos += nbytes
    if pos - start != int(plan.transfers.nbytes[k]):
        raise ValueError(f"transfer {k}: segments cover {pos - start} bytes, the plan says "
                         f"{int(plan.transfers.nbytes[k])}")
    return pos


def compile_program(plan: MigrationPlan, device: int, staging_bytes: int = DEFAULT_STAGING_BYTES,
                    direct_min_bytes: int = DIRECT_MIN_BYTES) -> Program:
    """This device's part of ``plan``: shards, message segments, local copies and steps.

    Every process of the migration group compiles the same global step list; only its own
    messages get segments. Pure and deterministic (no torch). ``staging_bytes`` and
    ``direct_min_bytes`` must be the same on every process (they fix chunks and operations).
    """
    if direct_min_bytes < 1:
        raise ValueError(f"direct_min_bytes must be positive, got {direct_min_bytes}")
    devices = group_devices(plan)
    if device not in devices:
        raise ValueError(f"device {device} takes no part in this migration "
                         f"(old devices {plan.old.devices}, new devices {plan.new.devices}"
                         + (f", lost devices {plan.lost}" if plan.lost else "") + ")")
    chunk = chunk_bytes_for(staging_bytes)
    old_rank = _layout_rank(plan.old.devices, device)
    new_rank = _layout_rank(plan.new.devices, device)
    old_specs = tuple(shard_specs(plan.catalog, plan.old_regions, old_rank))
    new_specs = tuple(shard_specs(plan.catalog, plan.new_regions, new_rank))
    old_index = {sp.key: i for i, sp in enumerate(old_specs)}
    new_index = {sp.key: i for i, sp in enumerate(new_specs)}
    group_rank = {d: i for i, d in enumerate(devices)}

    t, m = plan.transfers, plan.messages
    sends: dict[int, Side] = {}
    recvs: dict[int, Side] = {}
    for k in np.flatnonzero((m.src == device) | (m.dst == device)).tolist():
        sending = int(m.src[k]) == device
        b = _SegmentBuilder()
        for tr in range(int(m.start[k]), int(m.end[k])):
            _transfer_segments(plan, tr, sending, old_index if sending else new_index, b,
                               int(t.offset[tr]))
        peer = int(m.dst[k] if sending else m.src[k])
        side = Side(k, int(m.src[k]), int(m.dst[k]), group_rank[peer], int(m.nbytes[k]),
                    int(m.round[k]), num_chunks(int(m.nbytes[k]), chunk), b.build())
        (sends if sending else recvs)[k] = side

    src_b, dst_b = _SegmentBuilder(), _SegmentBuilder()
    local = np.flatnonzero((t.src == device) & (t.dst == device))
    pos = 0
    for tr in local.tolist():
        if int(t.src_rank[tr]) != old_rank or int(t.dst_rank[tr]) != new_rank:
            raise ValueError(f"local transfer {tr} on device {device} names old rank "
                             f"{int(t.src_rank[tr])} / new rank {int(t.dst_rank[tr])}, the "
                             f"device holds old rank {old_rank} / new rank {new_rank}")
        _transfer_segments(plan, tr, True, old_index, src_b, pos)
        pos = _transfer_segments(plan, tr, False, new_index, dst_b, pos)

    steps = _steps(m.round, m.nbytes, chunk,
                   {s.round: k for k, s in sends.items()}, {s.round: k for k, s in recvs.items()})
    local_src, local_dst = src_b.build(), dst_b.build()
    kept = _kept_whole(old_specs, new_specs, local_src, local_dst)
    return Program(device, devices, old_rank, new_rank, old_specs, new_specs, chunk, sends,
                   recvs, local_src, local_dst, steps,
                   program_digest(plan, chunk, direct_min_bytes), direct_min_bytes,
                   stats={"local_bytes": pos,
                          "kept_whole_bytes": sum(new_specs[j].nbytes for j in kept)},
                   kept=kept)


def _kept_whole(old_specs, new_specs, src: Segments, dst: Segments) -> dict[int, int]:
    """New shards whose local copies are the identity from one old shard that equals them
    (same key and size, every byte copied to the same offset): ``{new index: old index}``."""
    old_index = {sp.key: i for i, sp in enumerate(old_specs)}
    out: dict[int, int] = {}
    for j in np.unique(dst.shard).tolist():
        i = old_index.get(new_specs[j].key)
        if i is None or old_specs[i].nbytes != new_specs[j].nbytes:
            continue
        rows = dst.shard == j
        if (np.all(src.shard[rows] == i) and np.array_equal(src.offset[rows], dst.offset[rows])
                and np.array_equal(src.sizes[rows], dst.sizes[rows])
                and np.array_equal(src.strides[rows], dst.strides[rows])
                and int(dst.nbytes[rows].sum()) == new_specs[j].nbytes):
            out[j] = i
    return out


def _steps(rounds: np.ndarray, nbytes: np.ndarray, chunk: int, send_of_round: dict,
           recv_of_round: dict) -> tuple[Step, ...]:
    if not len(rounds):
        return ()
    per_round = np.zeros(int(rounds.max()) + 1, np.int64)
    np.maximum.at(per_round, rounds, -(-nbytes // chunk))
    steps: list[Step] = []
    for r, n in enumerate(per_round.tolist()):
        for j in range(n):
            send = send_of_round.get(r)
            recv = recv_of_round.get(r)
            if send is not None and j >= num_chunks(int(nbytes[send]), chunk):
                send = None
            if recv is not None and j >= num_chunks(int(nbytes[recv]), chunk):
                recv = None
            steps.append(Step(len(steps), r, j, send, recv))
    return tuple(steps)

"""Peer copies: what a node lost without grace held, kept in memory on another node.

dp replicas rebuild parameters when a node dies; the distributed optimizer's shards and every
shard of a dp=1 layout have no replica. For those, every ``every`` steps each rank of the
layout (in-memory checkpointing to peers, as Gemini and CheckFreq do):

1. snapshots its whole state (parameters, fp32 main parameters, Adam moments; the Adam step,
   torch's and megatron's RNG, the trainer's step, consumed samples and scheduler) into one
   flat host buffer: :class:`Snapshot`;
2. sends a copy to its buddy, a rank on another node (``plan.lost.peer_buddies``), and keeps
   the copy its own ward sends. It keeps its own snapshot too, so that every rank can roll
   back to the same step.

Both go over the layout's training group (gloo point to point): a peer that dies meanwhile
fails the exchange like any collective and the trainer waits for the resize naming it.

When is a snapshot no longer needed: once a rank finished a training step after the
exchange of step ``s``, every rank finished that exchange (the step's loss all-reduce spans
every rank, and each entered it only after its exchange), so snapshots and copies older than
``s`` are dropped. Between refreshes a rank holds one own snapshot and one copy per ward; at a
refresh, until the next step ends, two of each.

On a loss without grace whose state no survivor replicates, the survivors publish what they
hold (``holdings``) and agree on the newest step ``s_b`` that every survivor has a snapshot of
and every lost rank a copy of (``plan.lost.rollback_step``); each restores its own snapshot
(:meth:`PeerCopies.restore`, the data position included) and, for each lost ward, a thread
of this process stands in for the dead rank in the migration (:func:`stand_in`): it takes
part as that old rank, sends the copy's shards and step/RNG, and leaves. Steps ``s_b + 1`` to
the last trained are lost and replayed on the same samples.

Every snapshot carries its fingerprint, taken when it was copied: per shard, the sum of its
elements' bit patterns (as integers: exact, so the same over any cut of a tensor into
shards). A state rebuilt from copies is checked against it before training goes on
(:func:`fingerprint_totals`, :func:`fingerprint_mismatch`): a copy corrupted in memory or on
the wire, or a rebuild that put the wrong bytes anywhere, stops the job with one line
instead of training on (Megatron-LM #5281: a state rebuilt from replicas, never checked, gave
NaN three steps later). The sum does not see elements swapped inside one tensor.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from slurm_etc.migrate.shards import LocalShard, box3
from slurm_etc.plan.plan import MigrationPlan
from slurm_etc.protocol.values import decode_value, encode_value

logger = logging.getLogger(__name__)

_ALIGN = 64  # every shard starts at a multiple of this in the flat buffer (dtype views)


@dataclass
class Snapshot:
    """One rank's whole state at one step, in host memory.

    Attributes:
        step: the trainer step the snapshot was taken after.
        flat: all shards, each at ``index[i][5]`` bytes, ``_ALIGN``-aligned.
        index: per shard ``(state_key, lo, hi, s, dtype name, offset, numel)``.
        meta: Adam step, CPU RNG, megatron RNG extras, trainer state (kilobytes).
        sums: per shard (as ``index``), its fingerprint (:func:`shard_fingerprint`) when
            the snapshot was taken.
    """

    step: int
    flat: torch.Tensor
    index: list[tuple]
    meta: dict
    sums: list[int] = field(default_factory=list)

    def fingerprint(self) -> list[list]:
        """``[state_key, lo, hi, s, sum]`` per shard (what :func:`fingerprint_totals` adds)."""
        return [[k, list(lo), list(hi), s, v]
                for (k, lo, hi, s, _d, _o, _n), v in zip(self.index, self.sums, strict=True)]

    @property
    def nbytes(self) -> int:
        return int(self.flat.numel())

    def shards(self) -> list[LocalShard]:
        """The shards as LocalShard views of the buffer (the executor's old shards)."""
        out = []
        for key, lo, hi, s, dtype, off, numel in self.index:
            dt = getattr(torch, dtype)
            size = numel * dt.itemsize
            out.append(LocalShard(key, lo, hi, s, self.flat[off:off + size].view(dt)))
        return out


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}


def shard_fingerprint(tensor: torch.Tensor) -> int:
    """The sum of a tensor's elements' bit patterns as integers (an 8-byte element counts as
    its two 4-byte words): exact, whatever order the elements are added in, so the totals of
    a state tensor over the shards of any layout agree bit for bit."""
    t = tensor.detach().reshape(-1)
    if t.numel() == 0:
        return 0
    return int(t.view(_BITS[t.element_size()]).sum(dtype=torch.int64))


def shards_fingerprint(shards: list[LocalShard]) -> list[list]:
    """``[state_key, lo, hi, s, sum]`` for each of a live state's shards."""
    return [[sh.state_key, list(box3(sh.lo)), list(box3(sh.hi)), int(sh.s),
             shard_fingerprint(sh.tensor)] for sh in shards]


def fingerprint_totals(rows: Any) -> dict[str, int]:
    """Per state tensor, the sum of its shards' fingerprints, each shard counted once (dp
    replicas hold the same shard: the same key, the same bytes)."""
    seen: dict[tuple, int] = {}
    for key, lo, hi, s, value in rows:
        seen.setdefault((str(key), tuple(lo), tuple(hi), int(s)), int(value))
    out: dict[str, int] = {}
    for (key, *_box), value in seen.items():
        out[key] = out.get(key, 0) + value
    return out


def fingerprint_mismatch(expected: dict[str, int], got: dict[str, int]) -> str | None:
    """What differs between the fingerprint a rebuilt state should have and its own (the
    first tensors by name, and how many), or None when they agree."""
    bad = sorted(k for k in set(expected) | set(got) if expected.get(k) != got.get(k))
    if not bad:
        return None
    missing = [k for k in bad if k not in got]
    extra = [k for k in bad if k not in expected]
    named = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    what = (f"{len(missing)} tensor(s) missing" if missing else
            f"{len(extra)} tensor(s) unexpected" if extra else "different bytes")
    return f"{len(bad)} of {len(expected)} state tensors differ ({what}): {named}"


def layout_of(shards: list[LocalShard]) -> tuple[list[tuple], int]:
    """Index and total bytes of a flat buffer holding ``shards`` in their order."""
    index, off = [], 0
    for sh in shards:
        t = sh.tensor
        nbytes = t.numel() * t.element_size()
        index.append((sh.state_key, box3(sh.lo), box3(sh.hi), int(sh.s),
                      str(t.dtype).removeprefix("torch."), off, int(t.numel())))
        off += -(-nbytes // _ALIGN) * _ALIGN
    return index, off


@dataclass
class PeerCopies:
    """This rank's snapshots and the copies it keeps for its wards, for one layout.

    Attributes:
        every: refresh every this many steps (>= 1).
        rank, buddy, wards: this rank, where its copy goes, whose copies it keeps.
        own: step -> this rank's snapshot.
        copies: ward rank -> {step -> that ward's snapshot}.
        stale_copies: a planted bug for the oracle's self-test: keep the tensors of the copy
            received one refresh earlier (and their fingerprint) under the new step's step,
            RNG and data position.
        corrupt_copies: a planted fault for the fingerprint check's self-test: a byte of
            every shard of every copy received is changed after its fingerprint was taken.
    """

    every: int
    rank: int
    buddy: int
    wards: tuple[int, ...]
    own: dict[int, Snapshot] = field(default_factory=dict)
    copies: dict[int, dict[int, Snapshot]] = field(default_factory=dict)
    stale_copies: bool = False
    corrupt_copies: bool = False
    _threads: list[threading.Thread] = field(default_factory=list)
    _free: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    _errors: list[BaseException] = field(default_factory=list)

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def refresh(self, step: int, shards: list[LocalShard], meta: dict) -> None:
        """Snapshot this rank's state after ``step`` and exchange copies with the buddy and
        wards over the default (training) group. Collective over the layout."""
        self.prune(step)
        snap = self._take(step, shards, meta)
        self.own[step] = snap
        head = encode_value((snap.index, snap.meta, snap.sums))
        # copies live in host memory (another node's, off the device): gloo moves them
        ops, sizes = [], {w: torch.zeros(2, dtype=torch.int64, device="cpu") for w in self.wards}
        mine = torch.tensor([len(head), snap.nbytes], dtype=torch.int64, device="cpu")
        ops.append(dist.P2POp(dist.isend, mine, self.buddy))
        ops += [dist.P2POp(dist.irecv, sizes[w], w) for w in self.wards]
        _wait(dist.batch_isend_irecv(ops))
        heads = {w: torch.empty(int(sizes[w][0]), dtype=torch.uint8, device="cpu")
                 for w in self.wards}
        flats = {w: self._buffer(w, int(sizes[w][1])) for w in self.wards}
        ops = [dist.P2POp(dist.isend, torch.frombuffer(bytearray(head), dtype=torch.uint8),
                          self.buddy),
               dist.P2POp(dist.isend, snap.flat, self.buddy)]
        for w in self.wards:
            ops += [dist.P2POp(dist.irecv, heads[w], w), dist.P2POp(dist.irecv, flats[w], w)]
        _wait(dist.batch_isend_irecv(ops))
        for w in self.wards:
            index, wmeta, sums = _head(decode_value(heads[w].numpy().tobytes()))
            kept = self.copies.setdefault(w, {})
            if self.stale_copies and kept:
                prev = kept[max(kept)]
                kept[step] = Snapshot(step, prev.flat, prev.index, wmeta, prev.sums)
                continue
            if self.corrupt_copies:  # after the ward fingerprinted it
                for (_k, _lo, _hi, _s, _d, off, numel) in index:
                    if numel:
                        flats[w][off] += 1
            kept[step] = Snapshot(step, flats[w], index, wmeta, sums)

    def prune(self, finished_step: int) -> None:
        """A training step ended after ``finished_step - 1``: drop what the newest finished
        exchange makes unnecessary (see the module doc)."""
        done = [s for s in self.own if s < finished_step]
        if not done:
            return
        newest = max(done)
        dropped = [v for s, v in self.own.items() if s < newest]
        self.own = {s: v for s, v in self.own.items() if s >= newest}
        for w, kept in self.copies.items():
            dropped += [v for s, v in kept.items() if s < newest]
            self.copies[w] = {s: v for s, v in kept.items() if s >= newest}
        live = {v.flat.data_ptr() for v in self.own.values()} | {
            v.flat.data_ptr() for k in self.copies.values() for v in k.values()}
        for snap in dropped:  # reused by the next refresh (no page faults on fresh memory)
            if snap.flat.data_ptr() not in live:
                self._free.setdefault(snap.nbytes, []).append(snap.flat)

    def reserve(self) -> None:
        """One more buffer of the size of each snapshot and copy held, its memory touched:
        what the next refresh takes instead of fresh pages (a refresh holds two of each
        anyway), so that a copy can be timed as it costs once running."""
        sizes = [v.nbytes for v in self.own.values()]
        sizes += [v.nbytes for k in self.copies.values() for v in k.values()]
        for n in sizes:
            self._free.setdefault(n, []).append(
                torch.zeros(n, dtype=torch.uint8, device="cpu"))

    def holdings(self) -> dict:
        """What this rank can roll back to and rebuild (published on a loss)."""
        return {"own": sorted(self.own),
                "copies": {w: sorted(k) for w, k in self.copies.items()}}

    def fingerprints(self) -> dict:
        """The fingerprint of every snapshot and copy held, as they were taken: ``own``:
        step -> rows, ``copies``: ward -> step -> rows (published with the holdings on a
        loss, so that every rank knows what the rebuilt state must add up to)."""
        return {"own": {s: v.fingerprint() for s, v in self.own.items()},
                "copies": {w: {s: v.fingerprint() for s, v in k.items()}
                           for w, k in self.copies.items()}}

    def host_bytes(self) -> int:
        """Bytes of host memory the snapshots and copies hold now, the buffers kept for
        reuse included (each buffer counted once)."""
        seen: dict[int, int] = {}
        for snap in [*self.own.values(), *(s for k in self.copies.values()
                                           for s in k.values())]:
            seen[snap.flat.data_ptr()] = snap.nbytes
        for bufs in self._free.values():
            seen.update({b.data_ptr(): int(b.numel()) for b in bufs})
        return sum(seen.values())

    def restore(self, state_shards: list[LocalShard], step: int) -> dict:
        """Write this rank's snapshot of ``step`` back into the live shards; its meta."""
        snap = self.own[step]
        by_key = {sh.key: sh for sh in snap.shards()}
        if set(by_key) != {sh.key for sh in state_shards}:
            raise RuntimeError(f"rank {self.rank}: the snapshot of step {step} does not hold "
                               "the shards of the live state")
        with torch.no_grad():
            for sh in state_shards:
                sh.tensor.copy_(by_key[sh.key].tensor)
        return snap.meta

    def start_stand_in(self, ward: int, step: int, publish: Any, **kwargs: Any) -> None:
        """A thread that takes part in the migration as lost old rank ``ward``;
        ``publish(meta)`` first (in this thread) puts the ward's trainer state and RNG extras
        where the new ranks read them."""
        snap = self.copies[ward][step]
        publish(snap.meta)

        def run() -> None:
            try:
                stand_in(snap, **kwargs)
            except BaseException as err:  # surfaced by join_stand_ins
                logger.exception("stand-in for lost rank %d failed", ward)
                self._errors.append(err)

        th = threading.Thread(target=run, name=f"stand-in-{ward}", daemon=True)
        th.start()
        self._threads.append(th)

    def join_stand_ins(self, timeout_s: float) -> list[BaseException]:
        """Wait for the stand-ins; their errors (the migration's votes already told every
        rank whether it committed)."""
        for th in self._threads:
            th.join(timeout_s)
        errors, self._errors, self._threads = self._errors, [], []
        return errors

    def _take(self, step: int, shards: list[LocalShard], meta: dict) -> Snapshot:
        index, total = layout_of(shards)
        flat = self._recycled(total)
        with torch.no_grad():
            for sh, (_k, _lo, _hi, _s, _dt, off, _n) in zip(shards, index, strict=True):
                src = sh.tensor.detach().reshape(-1).view(torch.uint8)
                flat[off:off + src.numel()].copy_(src)
        snap = Snapshot(step, flat, index, meta)
        snap.sums = [shard_fingerprint(sh.tensor) for sh in snap.shards()]
        return snap

    def _recycled(self, nbytes: int) -> torch.Tensor:
        """A buffer of this size that prune dropped, else a new one."""
        free = self._free.get(nbytes)
        return free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, device="cpu")

    def _buffer(self, ward: int, nbytes: int) -> torch.Tensor:
        return self._recycled(nbytes)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _head(value: Any) -> tuple[list[tuple], dict, list[int]]:
    """A ward's (index, meta, fingerprint) as :meth:`PeerCopies.refresh` sent it (over gloo,
    whose connections are not authenticated: checked, never unpickled)."""
    index, meta, sums = value
    out = []
    for key, lo, hi, s, dtype, off, numel in index:
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"a peer copy's head names dtype {str(dtype)[:20]!r}")
        out.append((str(key), box3(lo), box3(hi), int(s), str(dtype), int(off), int(numel)))
    if not isinstance(meta, dict):
        raise ValueError("a peer copy's head carries no meta")
    if not isinstance(sums, list) or len(sums) != len(out) or \
            not all(isinstance(v, int) for v in sums):
        raise ValueError("a peer copy's head carries no fingerprint of each shard")
    return out, meta, sums


def own_client(store: Any, timeout_s: float) -> Any:
    """A connection of its own to a TCPStore: a client's blocking wait holds its socket, so
    two threads waiting through one client (the rank and its stand-in, in one rendezvous)
    would deadlock. The job's :class:`~slurm_etc.protocol.store.StoreClient` gives each
    thread a socket of its own: it is shared as it is."""
    from datetime import timedelta

    if isinstance(store, dist.TCPStore):
        return dist.TCPStore(store.host, store.port, is_master=False,
                             timeout=timedelta(seconds=timeout_s))
    return store


def stand_in(snap: Snapshot, *, plan: MigrationPlan, device: int, store: Any, tag: str,
             options: Any, timeout_s: float) -> None:
    """Take part in ``plan``'s migration as the lost old rank on ``device``, from its peer
    copy: connect the migration group, exchange step and RNG, send its shards, vote, leave.
    """
    import dataclasses

    from slurm_etc.megatron.resize import prepare_resize
    from slurm_etc.megatron.state import ResumeState, exchange_resume_state
    from slurm_etc.migrate.executor import execute_migration

    store = own_client(store, timeout_s)
    opts = dataclasses.replace(options, measure_memory=False)
    prepared = prepare_resize(plan, device, store, tag=tag, options=opts,
                              group_timeout_s=timeout_s, prefault=False)
    try:
        transport = prepared.group.transport()
        exchange_resume_state(plan, transport, device,
                              ResumeState(snap.meta["adam_step"], snap.meta["rng"]))
        execute_migration(plan, transport, device, snap.shards(), options=opts,
                          program=prepared.program, destinations=prepared.destinations)
    finally:
        prepared.group.destroy()

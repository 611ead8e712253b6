# mypy: disable-error-code="misc, has-type"
"""What a node lost without grace can be rebuilt from, kept as training goes: after a step,
this layout's peer copies refreshed (:mod:`.redundancy`; their interval chosen once where it
is "auto") and the periodic checkpoint written when due (:mod:`.checkpoints`).

A mixin of :class:`~slurm_etc.worker.trainer.ElasticTrainer`: the copies hold its state,
RNG and trainer state of a step."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..protocol.messages import CopiesChosen
from ..protocol.recovery import AUTO, CopyInterval, peer_copy_interval
from .extras import rng_extras
from .redundancy import PeerCopies

if TYPE_CHECKING:
    from .trainer import ElasticTrainer

logger = logging.getLogger(__name__)

# peer copies every "auto" steps: steps timed after the first copy before choosing
AUTO_TIMED_STEPS = 2


class RecoveryPoints:
    """Peer copies and periodic checkpoints of
    :class:`~slurm_etc.worker.trainer.ElasticTrainer`."""

    # trainer fields these steps set to another type than mypy would infer from them here
    # (ElasticTrainer.__init__ sets them first)
    peers: PeerCopies | None
    _choosing: tuple[int, float, int, int] | None
    copy_interval: CopyInterval | None

    def _after_step(self: ElasticTrainer) -> None:
        """After a step: refresh the peer copies and write the periodic checkpoint when due
        (both collective over the layout)."""
        if self.peer_copy_every == AUTO:
            self._choose_peer_copies()
        peers = self._peer_copies() if self.peer_copy_every else None
        if peers is not None:
            peers.prune(self.step)
            if self.peer_copy_every > 0 and peers.due(self.step):
                self._refresh(peers)
            for err in peers.join_stand_ins(0.0):
                self._log("a stand-in of the last resize failed: %s", err)
        if self.checkpoint_every and self.step % self.checkpoint_every == 0:
            self._save_periodic()

    def _refresh(self: ElasticTrainer, peers: PeerCopies) -> None:
        from slurm_etc.megatron.state import local_shards

        state, _cfg = self._live()
        peers.refresh(self.step, local_shards(state, self._catalog()), self._snapshot_meta())

    def _choose_peer_copies(self: ElasticTrainer) -> None:
        """Peer copies every "auto" steps: in the first layout on two nodes or more, take a
        copy at once (its buffers allocated, one more of each reserved), time the next
        ``AUTO_TIMED_STEPS`` steps, then a second copy (on the reserved buffers: timed as
        it costs once running); every rank agrees on the slowest rank's figures (one
        all-reduce) and chooses the interval
        (:func:`~slurm_etc.protocol.recovery.peer_copy_interval`): every rank the same,
        carried to later layouts and joiners in the trainer state. Where the copies do not
        fit host memory they are dropped; with a checkpoint directory and no
        ``checkpoint_every``, one checkpoint is timed and the same rule chooses its
        interval. Rank 0 says the choice once (to the coordinator: its log and the record)."""
        peers = self._peer_copies()
        if peers is None:  # one node: no copy would outlive it; choose in a wider layout
            return
        peers.prune(self.step)
        got = self._choosing
        if got is None or got[0] != self.generation:
            self._refresh(peers)
            peers.reserve()
            self._choosing = (self.generation, 0.0, peers.own[self.step].nbytes, self.step)
            return
        _gen, _s, copy_bytes, taken = got
        timed = [h.ended - h.started for h in self.history
                 if h.step > taken and h.generation == self.generation and h.ended]
        if len(timed) < AUTO_TIMED_STEPS:
            return
        t0 = time.perf_counter()
        self._refresh(peers)
        copy_s = time.perf_counter() - t0
        layout, proc = self.layout, self._proc()
        if layout is None:
            return
        node = proc.topology.node(proc.vrank)
        here = sum(1 for d in layout.devices if proc.topology.node(d) == node)
        host = (host_memory_available() + peers.host_bytes()) // max(here, 1)
        figures = torch.tensor([copy_s, sorted(timed)[len(timed) // 2], float(copy_bytes),
                                -float(host)], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the slowest, the least memory
        copy_s, step_s, nbytes, neg_host = figures.tolist()
        choice = peer_copy_interval(copy_s, step_s, int(nbytes), int(-neg_host))
        self.copy_interval = choice
        self.peer_copy_every = choice.every
        line = choice.line
        if choice.fits:
            peers.every = choice.every
        else:
            self.peers = None  # the copies do not fit: none kept
            if self.checkpoint_dir and not self.checkpoint_every:
                t0 = time.perf_counter()
                self._save_periodic()
                save = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(save, op=dist.ReduceOp.MAX)
                ck = peer_copy_interval(float(save[0]), step_s, 0, 0)
                self.checkpoint_every = ck.every
                line += (f"; a checkpoint every {ck.every} steps instead (one takes "
                         f"{float(save[0]):.2f} s)")
            else:
                line += ("; no checkpoint directory (--checkpoint-dir): a node lost where no "
                         "replica holds its state ends the job")
        if layout.devices.index(proc.vrank) == 0:  # the coordinator says it (once)
            logger.debug("[job %s gen %d vrank %d] %s", proc.job, self.generation, proc.vrank,
                         line)
            proc.control.report(CopiesChosen(
                proc.job, self.generation, proc.vrank, choice.every, self.checkpoint_every,
                copy_s, step_s, choice.held_bytes, choice.host_bytes, line[:400]))

    def _peer_copies(self: ElasticTrainer) -> PeerCopies | None:
        """This layout's PeerCopies (a new layout starts with none: a resize drops them);
        None when the layout is on one node (no copy would outlive it)."""
        from slurm_etc.plan.lost import peer_buddies

        layout, proc = self.layout, self._proc()
        if layout is None:
            raise RuntimeError("peer copies without a layout")
        if len({proc.topology.node(d) for d in layout.devices}) < 2:
            self.peers = None
            return None
        rank = layout.devices.index(proc.vrank)
        if self.peers is None or self.peers.rank != rank or self._peers_gen != self.generation:
            buddies = peer_buddies(layout.devices, proc.topology.gpus_per_node)
            self.peers = PeerCopies(max(self.peer_copy_every, 1), rank, buddies[rank],
                                    tuple(r for r, b in enumerate(buddies) if b == rank),
                                    stale_copies=self.hooks.stale_peer_copies,
                                    corrupt_copies=self.hooks.corrupt_peer_copies)
            self._peers_gen = self.generation
        return self.peers

    def _snapshot_meta(self: ElasticTrainer) -> dict:
        from slurm_etc.megatron.state import optimizer_step

        state, _cfg = self._live()
        return {"adam_step": optimizer_step(state),
                "rng": bytes(torch.get_rng_state().numpy().tobytes()),
                "extras": rng_extras(), "trainer": self._trainer_state()}


def host_memory_available() -> int:
    """Bytes of host memory this node can still give (``MemAvailable``), 0 if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no psutil, or it cannot read: unknown
        return 0

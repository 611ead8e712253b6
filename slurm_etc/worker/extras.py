# mypy: disable-error-code="misc, has-type"
"""What a resize carries beside the executor's tensors: the trainer state (step, consumed
samples, scheduler, grad scalers, the peer-copy choice), identical on every old rank and
published by the lowest surviving one, and each old rank's RNG extras (CUDA generators,
megatron's tensor-parallel tracker), taken by the new rank that continues it.

A mixin of :class:`~slurm_etc.worker.trainer.ElasticTrainer`: the trainer state is the
trainer's own fields."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from slurm_etc.megatron.state import sub_optimizers
from slurm_etc.plan import Layout, MigrationPlan
from slurm_etc.protocol.rendezvous import GenerationKeys
from slurm_etc.protocol.store import StoreUnreachable
from slurm_etc.protocol.values import decode_value, encode_value

from ..protocol.recovery import AUTO

if TYPE_CHECKING:
    from .trainer import ElasticTrainer


class TrainerExtras:
    """Publishing and adopting the trainer state and RNG extras of
    :class:`~slurm_etc.worker.trainer.ElasticTrainer`."""

    # trainer fields these steps set to another type than mypy would infer from them here
    # (ElasticTrainer.__init__ sets them first)
    _held_extras: tuple[dict, dict]

    def _publish_extras(self: ElasticTrainer, keys: GenerationKeys, old: Layout
                        ) -> dict[str, bytes]:
        """Old ranks: trainer state (rank 0) and per-rank RNG extras into the store;
        returns what was set (key -> value)."""
        proc = self._proc()
        if self.layout is None or proc.vrank not in old.devices:
            return {}
        rank = old.devices.index(proc.vrank)
        trainer, rng = (self._held_extras if self._held is not None
                        else (self._trainer_state(), rng_extras()))
        out: dict[str, bytes] = {}
        if proc.vrank == self._publisher(old):
            out[keys.trainer] = encode_value(trainer)
            if self.resumption.ended_in is not None:  # where the joiners' training gap begins
                out[keys.last_ended] = repr(self.resumption.ended_in[1]).encode()
        out[keys.rng(rank)] = encode_value(rng)
        for key, value in out.items():
            proc.store.set(key, value)
        return out

    def _trainer_state(self: ElasticTrainer) -> dict:
        state, _cfg = self._live()
        return {"step": self.step, "consumed_samples": self.consumed_samples,
                # an "auto" choice, made once: joiners and later layouts keep it
                "peer_copy_every": self.peer_copy_every,
                "checkpoint_every": self.checkpoint_every,
                "scheduler": self.scheduler.state_dict(),
                "grad_scalers": [getattr(sub, "grad_scaler", None) and
                                 sub.grad_scaler.state_dict()
                                 for sub in sub_optimizers(state.optimizer)]}

    def _adopt_extras(self: ElasticTrainer, keys: GenerationKeys, old: Layout, new: Layout,
                      plan: MigrationPlan) -> None:
        """The trainer state and RNG extras the old ranks published, once committed; a
        store that stopped answering (its coordinator died) is waited out, and the old
        ranks publish them again on the restarted one (:meth:`_await_restart`)."""
        proc = self._proc()
        src = surviving_rng_source(old, new, new.devices.index(proc.vrank), plan, self._lost)
        while True:
            try:
                trainer = decode_value(proc.store.get(keys.trainer))
                rng = decode_value(proc.store.get(keys.rng(src)))
                break
            except StoreUnreachable as err:
                self._await_restart(err)
        self._restore_trainer_state(trainer)
        set_rng_extras(rng)
        self._held_extras = ({}, {})

    def _restore_trainer_state(self: ElasticTrainer, saved: dict) -> None:
        chosen = saved.get("peer_copy_every", AUTO)
        if self.peer_copy_every == AUTO and chosen != AUTO:
            self.peer_copy_every = int(chosen)
            if not self.checkpoint_every and self.checkpoint_dir:
                self.checkpoint_every = int(saved.get("checkpoint_every", 0))
        self.step = saved["step"]
        self.consumed_samples = saved["consumed_samples"]
        state, _cfg = self._live()
        self.scheduler = self._make_scheduler(state.optimizer)
        self.scheduler.load_state_dict(saved["scheduler"])
        for sub, scaler in zip(sub_optimizers(state.optimizer), saved["grad_scalers"],
                               strict=False):
            if scaler is not None and getattr(sub, "grad_scaler", None) is not None:
                sub.grad_scaler.load_state_dict(scaler)


def surviving_rng_source(old: Layout, new: Layout, new_rank: int, plan: MigrationPlan,
                         lost: frozenset[int]) -> int:
    """The old rank whose RNG extras ``new_rank`` continues (a survivor's)."""
    from slurm_etc.megatron.state import rng_source

    src = rng_source(old.config, new.config, new_rank, plan.catalog.model.num_layers)
    return _surviving_peer(old, src, lost) if old.devices[src] in lost else src


def _surviving_peer(old: Layout, rank: int, lost: frozenset[int]) -> int:
    """The surviving old rank with ``rank``'s tensor and pipeline coordinates and the lowest
    dp (its replica), else the lowest surviving rank."""
    t, _d, p = old.config.coords(rank)
    same = [old.config.rank(t, d, p) for d in range(old.config.dp)]
    alive = [r for r in same if old.devices[r] not in lost] or \
        [r for r in range(old.config.world) if old.devices[r] not in lost]
    return alive[0]


def rng_extras() -> dict:
    """RNG state beyond torch's CPU generator (which the migration's control exchange moves):
    CUDA generators and megatron's tensor-parallel RNG tracker, where they exist."""
    from megatron.core import tensor_parallel

    out: dict[str, Any] = {}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states() if getattr(tracker, "is_initialized", lambda: True)() else {}
    if states:
        out["tracker"] = states
    return out


def set_rng_extras(extras: dict) -> None:
    from megatron.core import tensor_parallel

    if "cuda" in extras and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(extras["cuda"])
    if "tracker" in extras:
        tensor_parallel.get_cuda_rng_tracker().set_states(extras["tracker"])

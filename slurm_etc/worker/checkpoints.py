# mypy: disable-error-code="misc, has-type"
"""megatron-core checkpoints of the elastic trainer: the checkpoint-restart path a resize is
held against, and the periodic checkpoints a lost node's state falls back to (written as
``step-N.partial``, renamed once complete, the oldest deleted), each with its shards'
fingerprints.

A mixin of :class:`~slurm_etc.worker.trainer.ElasticTrainer`: a checkpoint holds the
trainer's whole state."""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from slurm_etc.plan import ParallelConfig
from slurm_etc.plan.catalog import Catalog

from ..protocol.recovery import checkpoint_steps, checkpoints_to_delete, newest_checkpoint
from .extras import rng_extras, set_rng_extras
from .redundancy import fingerprint_totals, shards_fingerprint

if TYPE_CHECKING:
    from .trainer import ElasticTrainer


class Checkpoints:
    """Saving and loading the state of :class:`~slurm_etc.worker.trainer.ElasticTrainer`."""

    def save_checkpoint(self: ElasticTrainer, directory: str) -> dict:
        """megatron ``dist_checkpointing`` save of model and optimizer, plus the trainer's
        own state (rank 0: step, consumed samples, scheduler, grad scalers, layout) and
        every rank's RNG, as Megatron-LM's checkpoints hold them. Collective."""
        from slurm_etc.megatron.checkpoint import save_checkpoint

        state, cfg = self._live()
        out = save_checkpoint(state, directory)
        rank = dist.get_rank()
        if rank == 0:
            torch.save({**self._trainer_state(), "config": str(cfg),
                        "num_layers": self.tf_template.num_layers},
                       os.path.join(directory, "trainer.pt"))
        os.makedirs(os.path.join(directory, "rng"), exist_ok=True)
        torch.save({"cpu": torch.get_rng_state(), **rng_extras()},
                   os.path.join(directory, "rng", f"{rank}.pt"))
        # what a state loaded from it must add up to (checked before training on it)
        os.makedirs(os.path.join(directory, FINGERPRINT_DIR), exist_ok=True)
        with open(os.path.join(directory, FINGERPRINT_DIR, f"{rank}.json"), "w") as f:
            json.dump(shards_fingerprint(local_shards_of(state, self._catalog())), f)
        dist.barrier()
        return out

    def _load_checkpoint(self: ElasticTrainer, directory: str) -> None:
        from slurm_etc.megatron.checkpoint import load_checkpoint
        from slurm_etc.megatron.state import rng_source

        state, cfg = self._live()
        load_checkpoint(state, directory, optimizer=True)
        saved = torch.load(os.path.join(directory, "trainer.pt"), weights_only=True)
        self._restore_trainer_state(saved)
        old = ParallelConfig.parse(saved["config"].replace(",dist-opt", ""),
                                   cfg.distributed_optimizer)
        src = rng_source(old, cfg, dist.get_rank(), saved["num_layers"])
        rng = torch.load(os.path.join(directory, "rng", f"{src}.pt"), weights_only=True)
        torch.set_rng_state(rng.pop("cpu"))
        set_rng_extras(rng)

    def _save_periodic(self: ElasticTrainer) -> None:
        """megatron-core checkpoint of this step into ``checkpoint_dir/step-N``.

        Written as ``step-N.partial`` and renamed by rank 0 once every rank wrote its part
        and it is synced, so a ``step-N`` is always complete; only then are the complete
        ones older than the newest ``keep_checkpoints`` deleted (the newest never). A step
        below the newest complete checkpoint is not written: a job resumed from it (or
        replaying steps after a rollback) never puts an older step beside a newer one."""
        import shutil

        root = str(self.checkpoint_dir)
        newest = newest_checkpoint(root)  # every rank reads the same: nothing is renamed now
        if newest is not None and newest > self.step:
            self._log("step %d: no checkpoint (the directory has the newer step %d)",
                      self.step, newest)
            return
        final = os.path.join(root, f"step-{self.step}")
        partial = final + ".partial"
        rank = dist.get_rank()
        if rank == 0:  # a save that died half-way left its files behind
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()
        self.save_checkpoint(partial)  # ends with a barrier: every rank wrote its part
        if rank == 0:
            old = final + ".old"
            if os.path.isdir(final):  # the same step again (replayed after a rollback)
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(partial, final)
            _fsync_dir(root)
            shutil.rmtree(old, ignore_errors=True)
            tmp = os.path.join(root, "latest.tmp")
            with open(tmp, "w") as f:
                f.write(str(self.step))
            os.replace(tmp, os.path.join(root, "latest"))
            for step in checkpoints_to_delete(checkpoint_steps(root), self.keep_checkpoints):
                shutil.rmtree(os.path.join(root, f"step-{step}"), ignore_errors=True)
        # nobody reads the directory before this rank renamed it
        dist.barrier()

    def _latest_checkpoint(self: ElasticTrainer) -> int | None:
        """The newest complete periodic checkpoint's step (None: none, or they are off)."""
        if not self.checkpoint_every:
            return None
        return newest_checkpoint(str(self.checkpoint_dir))


FINGERPRINT_DIR = "fingerprint"  # in a checkpoint: <rank>.json, its shards' fingerprints


def checkpoint_fingerprint(directory: str) -> dict[str, int] | None:
    """What a state loaded from the checkpoint in ``directory`` must add up to, per state
    tensor (None: a checkpoint written before fingerprints, not checked)."""
    where = os.path.join(directory, FINGERPRINT_DIR)
    try:
        names = sorted(n for n in os.listdir(where) if n.endswith(".json"))
    except OSError:
        return None
    rows: list = []
    for name in names:
        with open(os.path.join(where, name)) as f:
            rows += json.load(f)
    return fingerprint_totals(rows) if names else None


def local_shards_of(state: Any, catalog: Catalog) -> list:
    from slurm_etc.megatron.state import local_shards

    return local_shards(state, catalog)


def _fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

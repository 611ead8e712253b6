"""megatron-core's checkpoint path: the way users resize a job today, and a reference.

Save a distributed checkpoint in the old configuration (``dist_checkpointing.save``,
``torch_dist``); stop the processes; start fresh ones in the new configuration, build the
model and optimizer, ``dist_checkpointing.load``. :func:`save_checkpoint` /
:func:`load_checkpoint` are the two ends: model and optimizer (DistributedOptimizer:
``dp_reshardable``), plus step and RNG. Durability: megatron fsyncs its ``.distcp`` data files
and torch's writer the ``.metadata`` file; the rest (``common.pt``, sharded-object files,
``metadata.json``) and the directories are not synced, so :func:`save_checkpoint` fsyncs them
(timed separately). ``slurm-etc bench migrate`` times this path against the in-place resize
(:mod:`.experiments`); ``slurm-etc verify`` uses it as one oracle.
"""
from __future__ import annotations

import os
import time
from typing import Any

from slurm_etc.plan import ParallelConfig

DIST_OPT_SHARDING = "dp_reshardable"
# The non-distributed optimizer's tensors are keyed by parameter alone (megatron's
# ``chained_optim_avoid_prefix``), so a MoE checkpoint loads across ep = 1 <-> ep > 1, where
# the experts' own optimizer appears or goes (see :func:`_regroup_optimizer`).
_OPT_METADATA = {True: {"distrib_optim_sharding_type": DIST_OPT_SHARDING},
                 False: {"chained_optim_avoid_prefix": True}}


# -- checkpoint path ------------------------------------------------------------------------

def _checkpoint_state_dict(state: Any, *, loading: bool, optimizer: bool) -> dict:
    model_sd = state.model_sharded_state_dict()
    out = {"model": model_sd}
    if optimizer:
        if loading and state.config.distributed_optimizer:
            # megatron's DistributedOptimizer.state_dict() needs an initialised Adam state
            # (it reads the common step); a fresh optimizer has none before its first step.
            for sub in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
                if not sub.optimizer.state:
                    sub._init_optimizer_states_with_dummy_values()
        out["optimizer"] = state.optimizer.sharded_state_dict(
            model_sd, is_loading=loading, metadata=_OPT_METADATA[
                bool(state.config.distributed_optimizer)])
    return out


def _fsync_tree(directory: str) -> int:
    """fsync every file and directory under ``directory``; returns the bytes in files."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return total


def save_checkpoint(state: Any, directory: str, *, fsync: bool = True) -> dict:
    """megatron ``dist_checkpointing.save`` of model, optimizer, step and RNG; then durable.

    Collective over the state's default group. Step and rank 0's CPU RNG state travel as
    common state. Returns seconds of the save and of the extra fsync, and the bytes on
    disk (rank 0).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from .state import optimizer_step

    os.makedirs(directory, exist_ok=True)
    dist.barrier()
    t0 = time.perf_counter()
    sd = _checkpoint_state_dict(state, loading=False, optimizer=True)
    # Common state must be equal on every rank (megatron validates it; rank 0 writes it):
    # the checkpoint keeps rank 0's generator, as Megatron-LM does when it cannot reshard
    # per-rank RNG states.
    rng = torch.get_rng_state()
    dist.broadcast(rng, src=0)
    sd["resume"] = {"step": optimizer_step(state), "rng_state": rng}
    dist_checkpointing.save(sd, directory)
    t1 = time.perf_counter()
    nbytes = 0
    if fsync:
        dist.barrier()
        if dist.get_rank() == 0:
            nbytes = _fsync_tree(directory)
        dist.barrier()
    t2 = time.perf_counter()
    return {"save": t1 - t0, "fsync": t2 - t1, "seconds": t2 - t0, "bytes": nbytes}


def load_checkpoint(state: Any, directory: str, *, optimizer: bool = True) -> dict:
    """megatron ``dist_checkpointing.load`` into ``state`` (built for any configuration
    megatron can reshard to: any for the model and the non-distributed optimizer; only dp
    changes for the DistributedOptimizer). Restores step and RNG when ``optimizer``."""
    import torch
    from megatron.core import dist_checkpointing

    from .state import set_optimizer_step

    t0 = time.perf_counter()
    sd = _checkpoint_state_dict(state, loading=True, optimizer=optimizer)
    loaded = dist_checkpointing.load(sd, directory)
    state.load_model_state_dict(loaded["model"])
    if optimizer:
        # the DistributedOptimizer copies into fp32 main params that are views of the model's
        # leaf parameters, which autograd refuses outside no_grad
        with torch.no_grad():
            state.optimizer.load_state_dict(_regroup_optimizer(loaded["optimizer"],
                                                               state.optimizer))
        # With torch's Adam, the DistributedOptimizer's dp_reshardable load copies each
        # parameter's *current* step over the loaded one (the step travels as a local
        # non-persistent object), so a fresh optimizer would resume at its dummy step.
        set_optimizer_step(state, loaded["resume"]["step"])
        torch.set_rng_state(loaded["resume"]["rng_state"])
    return {"seconds": time.perf_counter() - t0}


def _regroup_optimizer(loaded: dict, optimizer: Any) -> dict:
    """The loaded optimizer state in the live optimizer's structure.

    A MoE model with ep > 1 has a ChainedOptimizer (dense parameters, then the experts': a
    state dict per sub-optimizer, keyed 0, 1); with ep = 1 one optimizer. The tensors load by
    parameter key either way, but the common part (the step, the param groups'
    hyperparameters) comes back in the saved structure beside the live one's tensors; here it
    is moved into the live structure: each live param group takes the hyperparameters of the
    saved group with its (wd_mult, lr_mult, is_decoupled_lr), keeping its own
    is_expert_parallel (megatron matches groups on all four)."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    chained_saved = [k for k in loaded if isinstance(k, int)] if len(subs) == 1 else []
    if len(subs) > 1 and "param_groups" not in loaded or len(subs) == 1 and not chained_saved:
        return loaded  # saved in the live structure
    if chained_saved:
        saved = [loaded.pop(k) for k in sorted(chained_saved)]
        saved_groups = [g for s in saved for g in s["param_groups"]]
        step = saved[0]["state"].get("common_step")
        entries = [loaded]
    else:
        saved_groups = loaded.pop("param_groups")
        step = loaded.pop("state").get("common_step")
        entries = [loaded[i] for i in range(len(subs))]

    def ident(g: dict) -> tuple:
        return g["wd_mult"], g["lr_mult"], g["is_decoupled_lr"]

    by_ident = {ident(g): g for g in saved_groups}
    for sub, entry in zip(subs, entries):
        for live, group in zip(sub.optimizer.param_groups, entry["param_groups"]):
            group.update({k: v for k, v in by_ident[ident(live)].items() if k != "params"},
                         is_expert_parallel=live["is_expert_parallel"])
        if step is not None:
            entry["state"]["common_step"] = step
    return entries[0] if chained_saved else dict(enumerate(entries))


# -- worker-side phases (run on every worker) -----------------------------------------------


def megatron_reshards_optimizer(old: ParallelConfig, new: ParallelConfig) -> bool:
    """Whether megatron-core's checkpoint path can reshard the optimizer state on CPU:
    always for the non-distributed optimizer; for the DistributedOptimizer only its
    ``dp_reshardable`` format works here, which allows dp changes alone (``fully_reshardable``
    warns of zero-padded data on save and fails to load with torch's Adam: KeyError 'step').
    An ep change alone fails too: the experts' optimizer is a second buffer keyed
    ``chained_1`` that ep = 1 does not have (KeyError on load)."""
    if not old.distributed_optimizer:
        return True
    return (old.tp, old.pp, old.ep, old.vpp, old.cp) == (new.tp, new.pp, new.ep, new.vpp,
                                                         new.cp)

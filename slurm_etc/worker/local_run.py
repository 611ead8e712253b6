"""Run a user's elastic training on local processes through a scripted resize sequence.

What ``examples/train_gpt.py`` calls when it runs on one machine without a coordinator::

    run_local(make_trainer, "dp=2,tp=1,pp=2 -> dp=1,tp=2,pp=1 -> dp=4,tp=1,pp=1",
              steps=5)

Worker 0 first builds the user's model once (tp = pp = 1) so that the model description the
resizes are planned with comes from the live model; then every process runs its trainer,
and the logs show each resize (old layout, new layout, bytes moved, pause).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from slurm_etc.plan.model import ModelDesc
from slurm_etc.pool.local import LocalWorkers, WorkerContext

from .sequence import PRELOAD, ResizeSequence, parse_sequence, w_elastic


def w_describe(ctx: WorkerContext, factory: Callable[[int], Any]) -> dict | None:
    """Worker 0: the ModelDesc of the user's model, read off a tp = pp = 1 build."""
    if ctx.index:
        return None
    import torch
    from megatron.core import parallel_state

    from slurm_etc.megatron import build, cpu_compat
    from slurm_etc.megatron.live import model_desc_of

    if not torch.cuda.is_available():
        cpu_compat.install()
    trainer = factory(0)
    ctx.init_group(f"describe-{os.getpid()}-{time.monotonic_ns()}", 0, 1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        gpt = trainer.model_provider(trainer.tf_template, pre_process=True, post_process=True)
        return {"desc": model_desc_of(trainer.tf_template, gpt, trainer.name).to_json(),
                "global_batch": trainer.global_batch, "micro_batch": trainer.micro_batch}
    finally:
        build.teardown()
        ctx.drop()


def run_local(factory: Callable[[int], Any], sequence: str, *, steps: int,
              distributed_optimizer: bool = False, log_level: int = logging.INFO) -> dict:
    """Train through ``sequence`` on local processes, ``steps`` steps per layout.

    Returns every step's record (loss, LR, consumed samples, layout) and every resize's.

    Raises:
        ConfigError: a malformed sequence, or a layout that does not fit the model or the
            global batch (before anything starts training).
    """
    configs = parse_sequence(sequence, distributed_optimizer)
    processes = max(c.world for c in configs)
    with LocalWorkers(processes, preload=PRELOAD, log_level=log_level) as workers:
        info = workers.run(w_describe, factory)[0]
        seq = ResizeSequence(ModelDesc.from_json(info["desc"], info["desc"]["name"]),
                             tuple(configs), steps, info["global_batch"], info["micro_batch"],
                             factory=factory)
        layouts, digests = seq.layouts()
        job = f"local-{os.getpid()}"
        results = workers.run(w_elastic, seq, layouts, digests, job)
    history = sorted({h["step"]: h for r in results for h in r["history"]}.values(),
                     key=lambda h: h["step"])
    resizes: dict[int, dict] = {}
    for r in results:
        for rz in r["resizes"]:
            have = resizes.setdefault(rz["generation"], rz)
            have["pause_seconds"] = max(have["pause_seconds"], rz["pause_seconds"])
    return {"history": history, "resizes": [resizes[g] for g in sorted(resizes)]}

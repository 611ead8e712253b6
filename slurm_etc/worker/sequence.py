"""``slurm-etc verify --sequence``: a training run through several resizes, held against the
same run through megatron-core's checkpoint-restart at every resize.

Elastic path: ``processes`` local workers (the most any layout needs) run the
:class:`~slurm_etc.worker.trainer.ElasticTrainer` of a preset; the first layout trains
``steps`` steps, then a scripted order (told to one old rank and to the joining processes:
the trainer's agreement spreads it) resizes in place, and so on. Checkpoint path: for every
layout a fresh set of processes builds (first layout) or loads megatron's checkpoint of the
previous layout, trains the same ``steps`` steps and saves. Then every step's loss, LR,
consumed samples and step are compared, and the final states bit for bit.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slurm_etc.plan import Layout, ParallelConfig, Topology, plan_migration
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import ModelDesc
from slurm_etc.pool.local import LocalWorkers, WorkerContext

from .data import check_interleaving

logger = logging.getLogger(__name__)

PRELOAD = ("megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing", "slurm_etc.worker.trainer",
           "slurm_etc.migrate.executor")


def parse_sequence(text: str, distributed_optimizer: bool = False) -> list[ParallelConfig]:
    """``"dp=2,tp=1,pp=2 -> dp=1,tp=2,pp=1 -> ..."`` as configurations (ConfigError with the
    part that is wrong)."""
    parts = [p.strip() for p in text.split("->")]
    if len(parts) < 2 or any(not p for p in parts):
        raise ConfigError(f"cannot parse sequence {text!r}: expected layouts separated by "
                          "'->', e.g. 'dp=2,tp=1,pp=2 -> dp=1,tp=2,pp=1'")
    return [ParallelConfig.parse(p, distributed_optimizer) for p in parts]


@dataclass(frozen=True)
class ResizeSequence:
    """A model trained ``steps`` steps in each of ``configs``, resized in between.

    ``factory(train_steps)`` makes the ElasticTrainer (a module-level function: it travels
    to the workers by reference); default: the preset trainer of ``model``. ``ends``: the
    step at which each layout ends, when the layouts do not train ``steps`` steps each (a
    run the coordinator resized when its events came); ``total_steps``: the trainer's
    ``train_steps`` when not ``steps * len(configs)``.
    """

    model: ModelDesc
    configs: tuple[ParallelConfig, ...]
    steps: int
    global_batch: int
    micro_batch: int = 1
    seed: int = 1234
    factory: Callable[[int], Any] | None = None
    ends: tuple[int, ...] = ()
    total_steps: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"--steps must be at least 1, got {self.steps}")
        for cfg in self.configs:
            cfg.validate_for(self.model)
            check_interleaving(self.global_batch, self.micro_batch, cfg.dp, cfg.pp, cfg.vpp)
        for a, b in zip(self.configs, self.configs[1:], strict=False):
            if a == b:
                raise ConfigError(f"the sequence resizes {a} to itself")

    @property
    def processes(self) -> int:
        return max(c.world for c in self.configs)

    @property
    def train_steps(self) -> int:
        return self.total_steps or self.steps * len(self.configs)

    def end_of(self, generation: int) -> int:
        """The step at which ``generation``'s layout stops training."""
        if self.ends:
            return self.ends[generation]
        return self.steps * (generation + 1)

    def layouts(self) -> tuple[list[Layout], list[str]]:
        """The layout of every generation (the planner places each new layout on the
        processes, keeping the most bytes in place) and each resize's plan digest."""
        from ..plan.fingerprint import plan_digest

        topo = Topology(gpus_per_node=self.processes)
        layouts = [Layout(self.configs[0], tuple(range(self.configs[0].world)))]
        digests = [""]
        for cfg in self.configs[1:]:
            plan = plan_migration(self.model, layouts[-1], cfg, range(self.processes), topo,
                                  keep_tp_in_node=False)
            layouts.append(plan.new)
            digests.append(plan_digest(plan))
        return layouts, digests


def default_global_batch(configs: list[ParallelConfig], micro_batch: int = 1,
                         at_least: int = 8) -> int:
    gb = math.lcm(*(c.dp * micro_batch for c in configs))
    return gb * -(-at_least // gb)


# -- worker phases ------------------------------------------------------------------------

def _trainer(seq: ResizeSequence) -> Any:
    from .gpt import preset_trainer

    if seq.factory is not None:
        trainer = seq.factory(seq.train_steps)
        if (trainer.global_batch, trainer.micro_batch) != (seq.global_batch, seq.micro_batch):
            raise ConfigError(f"the trainer's batch ({trainer.global_batch}, micro "
                              f"{trainer.micro_batch}) is not the sequence's "
                              f"({seq.global_batch}, micro {seq.micro_batch})")
        return trainer
    return preset_trainer(seq.model, distributed_optimizer=seq.configs[0].distributed_optimizer,
                          seed=seq.seed, global_batch=seq.global_batch,
                          micro_batch=seq.micro_batch, train_steps=seq.train_steps)


def _script(seq: ResizeSequence, job: str, layouts: list[Layout], digests: list[str]) -> list:
    from ..protocol.messages import LayoutSpec, Resize
    from .scripted import ScriptEntry

    out = []
    for g in range(1, len(layouts)):
        old, new = layouts[g - 1], layouts[g]
        told = {old.devices[0]} | (set(new.devices) - set(old.devices))
        out.append(ScriptEntry(seq.steps * g, Resize(job, g, LayoutSpec.of(old),
                                                     LayoutSpec.of(new), digests[g],
                                                     pool=tuple(range(seq.processes)),
                                                     reason=f"scripted resize {g}"),
                               frozenset(told)))
    return out


def _clock(trainer: Any) -> Callable[[], int]:
    return lambda: int(trainer.step)


def w_elastic(ctx: WorkerContext, seq: ResizeSequence, layouts: list[Layout],
              digests: list[str], job: str) -> dict:
    """Every worker: its stints in the sequence (a process may leave and join again)."""
    from .scripted import ScriptedControl
    from .trainer import WorkerProcess

    script = _script(seq, job, layouts, digests)
    out: dict[str, Any] = {"history": [], "resizes": [], "exits": [], "digest": None}
    after = -1
    while True:
        start = next((g for g, lay in enumerate(layouts)
                      if g > after and ctx.index in lay.devices), None)
        if start is None:
            return out
        trainer = _trainer(seq)
        control = ScriptedControl(script, ctx.index, clock=_clock(trainer),
                                  after_generation=after)
        proc = WorkerProcess(job, ctx.index, ctx.store, control,
                             layout=layouts[0] if start == 0 else None,
                             topology=Topology(gpus_per_node=seq.processes),
                             keep_tp_in_node=False, timeout_s=ctx.timeout_s)
        why = trainer.run(proc)
        out["history"] += [vars(r) for r in trainer.history]
        out["resizes"] += [vars(r) for r in trainer.resizes]
        out["exits"].append(why)
        if why == "left":
            after = trainer.generation
            continue
        out["digest"] = {"rank": layouts[-1].devices.index(ctx.index),
                         "shards": _digest(trainer)}
        trainer.close()
        return out


def w_checkpoint_segment(ctx: WorkerContext, seq: ResizeSequence, generation: int,
                         load_from: str | None, save_to: str | None, job: str) -> dict | None:
    """Fresh processes of one layout: build or load, train ``steps`` steps, save."""
    from ..protocol.messages import Stop
    from .scripted import ScriptedControl, ScriptEntry
    from .trainer import WorkerProcess

    cfg = seq.configs[generation]
    if ctx.index >= cfg.world:
        return None
    trainer = _trainer(seq)
    end = seq.end_of(generation)
    script = [ScriptEntry(end, Stop(job, generation + 1, "end of segment"))]
    control = ScriptedControl(script, ctx.index, clock=_clock(trainer))
    proc = WorkerProcess(job, ctx.index, ctx.store, control,
                         layout=Layout(cfg, tuple(range(cfg.world))), generation=generation,
                         timeout_s=ctx.timeout_s)
    t0 = time.perf_counter()
    trainer.run(proc, resume_from=load_from)
    out = {"history": [vars(r) for r in trainer.history], "seconds": time.perf_counter() - t0,
           "digest": _digest(trainer) if save_to is None else None}
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    trainer.close()
    return out


def _digest(trainer: Any) -> dict:
    """sha1 of every shard of the trainer's live state (the adapter's view)."""
    from slurm_etc.megatron.oracles import shard_bits
    from slurm_etc.megatron.state import local_shards

    bits = shard_bits(local_shards(trainer.state, trainer.catalog))
    return {repr(k): hashlib.sha1(v.tobytes()).hexdigest() for k, v in bits.items()}


# -- the experiment -----------------------------------------------------------------------

def verify_sequence(seq: ResizeSequence, *, workers: LocalWorkers | None = None,
                    progress: Any = None, log_level: int = logging.WARNING,
                    workdir: str | None = None) -> dict:
    """Run both paths and compare (see the module doc). Returns the report
    ``slurm-etc verify --sequence --json`` prints.

    ``workers``: a pool of at least ``seq.processes`` for the elastic path (default: one of
    its own); the checkpoint path always starts fresh processes for every layout."""
    from slurm_etc.megatron.checkpoint import megatron_reshards_optimizer

    say = progress or (lambda _m: None)
    for a, b in zip(seq.configs, seq.configs[1:], strict=False):
        if not megatron_reshards_optimizer(a, b):
            raise ConfigError(f"megatron-core cannot reshard the distributed optimizer from {a} "
                              f"to {b} on CPU, so the checkpoint reference does not exist for "
                              "this sequence; with --distributed-optimizer change dp only")
    layouts, digests = seq.layouts()
    job = f"verify-seq-{os.getpid()}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    say(f"elastic path: {seq.processes} processes, {' -> '.join(map(str, seq.configs))}")
    if workers is None:
        with LocalWorkers(seq.processes, preload=PRELOAD, log_level=log_level) as own:
            elastic = own.run(w_elastic, seq, layouts, digests, job)
    else:
        if workers.size < seq.processes:
            raise ConfigError(f"the sequence needs {seq.processes} processes, the pool has "
                              f"{workers.size}")
        elastic = workers.run(w_elastic, seq, layouts, digests, job)
    elastic_s = time.perf_counter() - t0
    ckpt = checkpoint_path(seq, job, progress=say, log_level=log_level, workdir=workdir)
    return _compare(seq, layouts, elastic, ckpt, elastic_s, time.perf_counter() - t0)


def checkpoint_path(seq: ResizeSequence, job: str, *, progress: Any = None,
                    log_level: int = logging.WARNING, workdir: str | None = None
                    ) -> list[dict]:
    """The sequence through megatron's checkpoint-restart: for every layout, fresh
    processes build (first) or load the previous layout's checkpoint, train to the
    layout's end and save. Returns each segment's worker results."""
    say = progress or (lambda _m: None)
    tmp = tempfile.mkdtemp(prefix="slurm-etc-seq-", dir=workdir)
    out: list[dict] = []
    try:
        for g, cfg in enumerate(seq.configs):
            say(f"checkpoint path: fresh processes for {cfg}"
                + (" (load the previous layout's checkpoint)" if g else ""))
            load = os.path.join(tmp, f"g{g - 1}") if g else None
            save = os.path.join(tmp, f"g{g}") if g + 1 < len(seq.configs) else None
            with LocalWorkers(cfg.world, preload=PRELOAD, log_level=log_level) as fresh:
                out.append({"results": fresh.run(w_checkpoint_segment, seq, g, load, save,
                                                 f"{job}-ckpt{g}")})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def checkpoint_losses(seq: ResizeSequence, **kwargs: Any) -> dict[int, dict]:
    """step -> {loss, lr, consumed_samples, layout} of the checkpoint-restart path."""
    segments = checkpoint_path(seq, f"ref-{os.getpid()}-{time.monotonic_ns()}", **kwargs)
    return _steps([h for seg in segments for r in seg["results"] if r for h in r["history"]])


def _steps(history: list[dict]) -> dict[int, dict]:
    """step -> record, checking every rank that trained it saw the same values."""
    out: dict[int, dict] = {}
    for rec in history:
        have = out.setdefault(rec["step"], rec)
        if (have["loss"], have["lr"], have["consumed_samples"]) != \
                (rec["loss"], rec["lr"], rec["consumed_samples"]):
            raise RuntimeError(f"ranks disagree on step {rec['step']}: {have} vs {rec}")
    return out


def _compare(seq: ResizeSequence, layouts: list[Layout], elastic: list[dict],
             ckpt: list[dict], elastic_s: float, seconds: float) -> dict:
    el = _steps([h for r in elastic for h in r["history"]])
    ck = _steps([h for seg in ckpt for r in seg["results"] if r for h in r["history"]])
    rows, max_rel = [], 0.0
    for step in range(1, seq.train_steps + 1):
        a, b = el.get(step), ck.get(step)
        if a is None or b is None:
            rows.append({"step": step, "missing": "elastic" if a is None else "checkpoint"})
            max_rel = math.inf
            continue
        rel = abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-30)
        max_rel = max(max_rel, rel)
        rows.append({"step": step, "layout": a["layout"], "generation": a["generation"],
                     "loss_elastic": a["loss"], "loss_checkpoint": b["loss"],
                     "bit_equal": a["loss"] == b["loss"], "lr_elastic": a["lr"],
                     "lr_checkpoint": b["lr"], "consumed_elastic": a["consumed_samples"],
                     "consumed_checkpoint": b["consumed_samples"]})
    same_meta = all("missing" not in r and r["lr_elastic"] == r["lr_checkpoint"]
                    and r["consumed_elastic"] == r["consumed_checkpoint"] for r in rows)
    final = {r["digest"]["rank"]: r["digest"]["shards"] for r in elastic if r["digest"]}
    fresh = [r["digest"] for r in ckpt[-1]["results"] if r]
    mismatches = []
    for rank, want in enumerate(fresh):
        got = final.get(rank, {})
        for key in sorted(set(got) | set(want)):
            if got.get(key) != want.get(key):
                mismatches.append({"new_rank": rank, "shard": key,
                                   "problem": "missing" if key not in got else
                                   "unexpected" if key not in want else "differs"})
    resizes: dict[int, dict] = {}
    for r in elastic:
        for rz in r["resizes"]:
            entry = resizes.setdefault(rz["generation"], {**rz, "pause_seconds": 0.0,
                                                          "outcomes": set()})
            entry["pause_seconds"] = max(entry["pause_seconds"], rz["pause_seconds"])
            entry["outcomes"].add(rz["outcome"])
    resize_rows = [{"generation": g, "from": r["old"], "to": r["new"], "at_step": r["step"],
                    "moved_bytes": r["moved_bytes"], "pause_seconds": r["pause_seconds"],
                    "outcomes": sorted(r["outcomes"])} for g, r in sorted(resizes.items())]
    committed = all("aborted" not in r["outcomes"] for r in resize_rows) \
        and len(resize_rows) == len(layouts) - 1
    losses_equal = all(r.get("bit_equal") for r in rows)
    return {
        "model": seq.model.name, "sequence": [str(c) for c in seq.configs],
        "layouts": [{"config": str(lay.config), "devices": list(lay.devices)} for lay in layouts],
        "processes": seq.processes, "steps": seq.steps, "train_steps": seq.train_steps,
        "global_batch": seq.global_batch, "micro_batch": seq.micro_batch,
        "resizes": resize_rows,
        "losses_elastic": [r.get("loss_elastic") for r in rows],
        "losses_checkpoint": [r.get("loss_checkpoint") for r in rows],
        "loss_max_rel_diff": max_rel, "losses_bit_equal": losses_equal,
        "lr_and_consumed_equal": same_meta,
        "per_step": rows,
        "state_shards_compared": sum(len(d) for d in fresh),
        "state_mismatches": len(mismatches), "first_state_mismatch":
            mismatches[0] if mismatches else None,
        "verified": committed and losses_equal and same_meta and not mismatches
        and bool(fresh),
        "elastic_seconds": elastic_s, "seconds": seconds,
    }

"""``slurm-etc verify --sequence``: a training run through several resizes, held against the
same run through megatron-core's checkpoint-restart at every resize.

Elastic path: ``processes`` local workers (the most any layout needs) run the
:class:`~slurm_etc.worker.trainer.ElasticTrainer` of a preset; the first layout trains
``steps`` steps, then a scripted order (told to one old rank and to the joining processes:
the trainer's agreement spreads it) resizes in place, and so on. Checkpoint path: for every
layout a fresh set of processes builds (first layout) or loads megatron's checkpoint of the
previous layout, trains the same ``steps`` steps and saves. Then every step's loss, LR,
consumed samples and step are compared, and the final states bit for bit.

Where megatron-core cannot reshard a resize's optimizer on CPU (the distributed optimizer
across a tp, pp, ep, vpp or cp change: :func:`~slurm_etc.megatron.checkpoint.
megatron_reshards_optimizer`), no checkpoint reference exists; the sequence is then held
against the **no-resize reference**: fresh processes train every step in the first layout
without a resize. The same arithmetic reduced in another order (tp splits the matmuls, dp
the gradient reduction), so the losses agree within ``LOSS_RTOL`` and the final state,
every full tensor read through megatron-core's ``sharded_state_dict()`` (model, fp32 main
parameters and Adam moments by parameter: :mod:`slurm_etc.harness.reference`, no code of
the resize), within ``STATE_RTOL`` of the tensor's norm; LR, consumed samples and every
parameter's Adam step exactly.
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

import numpy as np

from slurm_etc.plan import Layout, ParallelConfig, Topology, plan_migration
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import ModelDesc
from slurm_etc.pool.local import LocalWorkers, WorkerContext

from .data import check_interleaving

logger = logging.getLogger(__name__)

CHECKPOINT_REFERENCE = "checkpoint-restart"
NO_RESIZE_REFERENCE = "no-resize"
# Losses of the no-resize reference: the tolerance of the single-resize verify
# (harness/verify.py LOSS_RTOL). State: a full tensor's difference over its norm (L2).
# Measured (docs/verify.md): 1e-7-3e-7 for every tensor but one, the QKV bias at 7e-5: the
# key bias's true gradient is zero (it adds the same to every score of a query), so its
# gradient is rounding noise, which Adam normalises into steps of +-lr whose signs follow
# the reduction order. A shard in the wrong place or of another rank differs by O(1).
LOSS_RTOL = {"fp32": 1e-6, "bf16": 1e-4}
STATE_RTOL = {"fp32": 1e-3, "bf16": 1e-2}

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
                                                     pool_runs=((0, seq.processes),),
                                                     reason=f"scripted resize {g}"),
                               frozenset(told)))
    return out


def _clock(trainer: Any) -> Callable[[], int]:
    return lambda: int(trainer.step)


def w_elastic(ctx: WorkerContext, seq: ResizeSequence, layouts: list[Layout],
              digests: list[str], job: str, view: bool = False) -> dict:
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
        if view:
            out["view"] = _view(trainer)
        trainer.close()
        return out


def w_checkpoint_segment(ctx: WorkerContext, seq: ResizeSequence, generation: int,
                         load_from: str | None, save_to: str | None, job: str,
                         view: bool = False) -> dict | None:
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
           "digest": _digest(trainer) if save_to is None else None,
           "view": _view(trainer) if view else None}
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    trainer.close()
    return out


def _view(trainer: Any) -> dict:
    """The trainer's state as megatron-core and torch hold it (collective over its dp
    groups with a DistributedOptimizer): what the no-resize reference compares."""
    from slurm_etc.harness.reference import megatron_view

    return megatron_view(trainer.state)


def _digest(trainer: Any) -> dict:
    """sha1 of every shard of the trainer's live state (the adapter's view)."""
    from slurm_etc.harness.oracles import shard_bits
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
    say = progress or (lambda _m: None)
    reference = reference_of(seq)
    no_resize = reference == NO_RESIZE_REFERENCE
    layouts, digests = seq.layouts()
    job = f"verify-seq-{os.getpid()}-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    say(f"elastic path: {seq.processes} processes, {' -> '.join(map(str, seq.configs))}")
    if workers is None:
        with LocalWorkers(seq.processes, preload=PRELOAD, log_level=log_level) as own:
            elastic = own.run(w_elastic, seq, layouts, digests, job, no_resize)
    else:
        if workers.size < seq.processes:
            raise ConfigError(f"the sequence needs {seq.processes} processes, the pool has "
                              f"{workers.size}")
        elastic = workers.run(w_elastic, seq, layouts, digests, job, no_resize)
    elastic_s = time.perf_counter() - t0
    if no_resize:
        ref = no_resize_path(seq, job, progress=say, log_level=log_level)
    else:
        ref = checkpoint_path(seq, job, progress=say, log_level=log_level, workdir=workdir)
    return _compare(seq, layouts, elastic, ref, elastic_s, time.perf_counter() - t0,
                    reference)


def reference_of(seq: ResizeSequence) -> str:
    """What the sequence is held against: megatron's checkpoint-restart where megatron
    reshards every resize's optimizer, else the no-resize reference (module doc)."""
    from slurm_etc.megatron.checkpoint import megatron_reshards_optimizer

    if all(megatron_reshards_optimizer(a, b)
           for a, b in zip(seq.configs, seq.configs[1:], strict=False)):
        return CHECKPOINT_REFERENCE
    return NO_RESIZE_REFERENCE


def no_resize_path(seq: ResizeSequence, job: str, *, progress: Any = None,
                   log_level: int = logging.WARNING) -> list[dict]:
    """Fresh processes train every step of the sequence in its first layout (no resize)
    and read their final state through megatron-core; returned as one segment."""
    say = progress or (lambda _m: None)
    first = seq.configs[0]
    whole = ResizeSequence(seq.model, (first,), seq.train_steps, seq.global_batch,
                           seq.micro_batch, seq.seed, seq.factory)
    say(f"no-resize reference: fresh processes train {seq.train_steps} steps in {first}")
    with LocalWorkers(first.world, preload=PRELOAD, log_level=log_level) as fresh:
        return [{"results": fresh.run(w_checkpoint_segment, whole, 0, None, None,
                                      f"{job}-ref", True)}]


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
             ckpt: list[dict], elastic_s: float, seconds: float,
             reference: str = CHECKPOINT_REFERENCE) -> dict:
    """The report: every step's loss, LR and consumed samples, and the final state, of the
    elastic path against ``ckpt`` (the reference's segments)."""
    exact = reference == CHECKPOINT_REFERENCE
    loss_rtol = 0.0 if exact else LOSS_RTOL[seq.model.param_dtype]
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
                     "bit_equal": a["loss"] == b["loss"],
                     "ok": a["loss"] == b["loss"] or (not exact and rel <= loss_rtol),
                     "lr_elastic": a["lr"],
                     "lr_checkpoint": b["lr"], "consumed_elastic": a["consumed_samples"],
                     "consumed_checkpoint": b["consumed_samples"]})
    same_meta = all("missing" not in r and r["lr_elastic"] == r["lr_checkpoint"]
                    and r["consumed_elastic"] == r["consumed_checkpoint"] for r in rows)
    state_rel = None
    if exact:
        final = {r["digest"]["rank"]: r["digest"]["shards"] for r in elastic if r["digest"]}
        fresh = [r["digest"] for r in ckpt[-1]["results"] if r]
        compared = sum(len(d) for d in fresh)
        mismatches = []
        for rank, want in enumerate(fresh):
            got = final.get(rank, {})
            for key in sorted(set(got) | set(want)):
                if got.get(key) != want.get(key):
                    mismatches.append({"new_rank": rank, "shard": key,
                                       "problem": "missing" if key not in got else
                                       "unexpected" if key not in want else "differs"})
    else:
        mismatches, compared, state_rel = _compare_full_tensors(
            [r.get("view") for r in elastic], [r["view"] for r in ckpt[-1]["results"] if r],
            STATE_RTOL[seq.model.param_dtype], seq.train_steps)
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
    losses_ok = all(r.get("ok") for r in rows)
    return {
        "model": seq.model.name, "sequence": [str(c) for c in seq.configs],
        "reference": reference, "loss_tolerance": loss_rtol,
        "state_tolerance": None if exact else STATE_RTOL[seq.model.param_dtype],
        "state_max_rel_diff": state_rel,
        "layouts": [{"config": str(lay.config), "devices": list(lay.devices)} for lay in layouts],
        "processes": seq.processes, "steps": seq.steps, "train_steps": seq.train_steps,
        "global_batch": seq.global_batch, "micro_batch": seq.micro_batch,
        "resizes": resize_rows,
        "losses_elastic": [r.get("loss_elastic") for r in rows],
        "losses_checkpoint": [r.get("loss_checkpoint") for r in rows],
        "loss_max_rel_diff": max_rel, "losses_bit_equal": losses_equal,
        "losses_within_tolerance": losses_ok,
        "lr_and_consumed_equal": same_meta,
        "per_step": rows,
        "state_shards_compared": compared,
        "state_mismatches": len(mismatches), "first_state_mismatch":
            mismatches[0] if mismatches else None,
        "verified": committed and losses_ok and same_meta and not mismatches
        and compared > 0,
        "elastic_seconds": elastic_s, "seconds": seconds,
    }


def _compare_full_tensors(elastic: list[dict | None], reference: list[dict | None],
                          rtol: float, steps: int | None = None
                          ) -> tuple[list[dict], int, float]:
    """Every full tensor of the elastic path's final layout against the no-resize
    reference's: (mismatches, tensors compared, the largest relative difference), a
    tensor's difference over its norm. Each side is assembled from its own ranks' megatron
    views (every element held, every replica bit-identical); ``steps``: every parameter's
    Adam step on every rank of both sides."""
    from slurm_etc.harness.reference import assemble

    got, want = assemble(elastic, "elastic"), assemble(reference, "no-resize reference")
    mismatches: list[dict] = [{"new_rank": p.get("rank", -1), "shard": p["state_key"],
                               "problem": p["problem"]} for p in got.problems + want.problems]
    if steps is not None:
        for side, views in (("elastic", elastic), ("no-resize reference", reference)):
            seen = sorted({x for v in views if v is not None for x in v.get("steps", [])})
            if seen != [float(steps)]:
                mismatches.append({"new_rank": -1, "shard": "Adam step", "problem":
                                   f"{side}: {seen}, expected {steps}"})
    worst = 0.0
    for key in sorted(set(got.tensors) | set(want.tensors)):
        a, b = got.tensors.get(key), want.tensors.get(key)
        if a is None or b is None or a.shape != b.shape:
            mismatches.append({"new_rank": -1, "shard": key, "problem":
                               "missing" if a is None else "unexpected" if b is None
                               else f"shape {a.shape} against {b.shape}"})
            continue
        x, y = _floats(a), _floats(b)
        scale = float(np.linalg.norm(y))
        rel = float(np.linalg.norm(x - y)) / scale if scale else float(np.linalg.norm(x))
        worst = max(worst, rel)
        if not rel <= rtol:
            mismatches.append({"new_rank": -1, "shard": key,
                               "problem": f"differs by {rel:.3g} of its norm "
                                          f"(tolerance {rtol:g})"})
    return mismatches, len(want.tensors), worst


def _floats(bits: np.ndarray) -> np.ndarray:
    """The values of raw bits as megatron's views hold them: fp32 (32-bit words) or bf16
    (16-bit words), as float64."""
    if bits.dtype.itemsize == 4:
        return bits.view(np.float32).astype(np.float64)
    if bits.dtype.itemsize == 2:
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    raise ValueError(f"a {bits.dtype.itemsize}-byte element is neither fp32 nor bf16")

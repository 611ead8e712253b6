"""``slurm-etc demo``: a small GPT trains through a grow, a preemption and a node loss on local
processes, coordinated as on Slurm (embedded defaults: local backend, per-job SQLite).

Simulated cluster: 3 nodes of 2 devices; the job starts on the anchor node. After a fifth
of its steps node n1 is granted; after two fifths it is preempted with a grace; after three
n2 is granted; after four n2 fails without notice; at the end of its steps training ends.
The steps are counted while no resize is in flight (the old layout trains on through each
grow's warm-up, a few to a few hundred steps by the machine's speed, and they count for
none of the events), so the four events always happen, each after as much training as the
one before; the workers' own budget (``DEMO_BUDGET`` times the steps) bounds the run. Each
time the coordinator decides, plans and has the workers move the state in memory.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_etc.alloc.chooser import Hardware
from slurm_etc.migrate.faults import KillSpec
from slurm_etc.plan.model import ModelDesc
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.testing.hooks import INJECT_ENV

from ..coordinator.job import JobSpec
from ..coordinator.job_model import provisional_job
from .script import EventsScript, script_from_dict

# The workers' train_steps, in the demo's steps: room for the steps trained through the two
# grows' warm-ups (joiners cold-import torch and megatron-core on shared cores: 10-25 s,
# 100-250 steps, on this 2-core machine), which the demo's steps do not count.
DEMO_BUDGET = 5

# CPU "devices": compute dominates, so more devices train faster (the chooser grows).
DEMO_HARDWARE = Hardware(gpus_per_node=2, memory_gib=2.0, tflops=0.01, intra_node_gbps=10.0,
                         inter_node_gbps=5.0, reserved_gib=0.5)


@dataclass(frozen=True)
class StepSeen:
    """One step as the coordinator heard of it: when it began and ended on the layout's
    rank 0 (seconds since the demo's start; when heard of, where the worker did not say)."""

    started: float
    ended: float
    step: int
    loss: float
    layout: str
    generation: int


@dataclass
class Timeline:
    """What the demo saw, for the progress display and the PNG."""

    t0: float = field(default_factory=time.time)
    steps: list[StepSeen] = field(default_factory=list)

    def progress(self, p: dict[str, Any]) -> None:
        heard = time.time() - self.t0
        ended = p["ended"] - self.t0 if p.get("ended") else heard
        started = p["started"] - self.t0 if p.get("started") else ended
        self.steps.append(StepSeen(started, ended, p["step"], p["loss"], p["layout"],
                                   p["generation"]))


def demo_script(steps: int, grace_s: float = 60.0, *, settled_steps: bool = False,
                parts: int = 6, end: bool = False) -> EventsScript:
    """The scripted cluster of the demo: four events at 1, 2, 3 and 4 ``parts`` of ``steps``
    (``settled_steps``: counted in steps trained while settled, so the steps trained through
    a grow's warm-up move the later events back; ``end``: training ends at ``steps``, so
    counted; see :mod:`~slurm_etc.local.script`)."""
    q = max(steps // parts, 2)
    return script_from_dict({
        "nodes": 3, "gpus_per_node": 2, "initial_nodes": 1, "grace_s": grace_s,
        "settled_steps": settled_steps, "end_step": max(steps, 4 * q) if end else None,
        "events": [
            {"at_step": q, "grant": ["n1"], "reason": "an idle node"},
            {"at_step": 2 * q, "preempt": ["n1"], "grace_s": grace_s,
             "reason": "a higher-priority job"},
            {"at_step": 3 * q, "grant": ["n2"], "reason": "an idle node"},
            {"at_step": 4 * q, "lose": ["n2"], "reason": "node failure"},
        ]}, "<demo>")


def demo_spec(job_id: str, model: ModelDesc, steps: int, global_batch: int = 8,
              inject: str | None = None, data: str = "seeded") -> JobSpec:
    """The demo's job. ``inject``: a kill spec (:class:`~slurm_etc.migrate.faults.KillSpec`,
    e.g. ``mid-transfer``): a worker kills itself (SIGKILL) at that phase of a resize.
    ``data``: ``seeded`` random tokens (what the equality tests replay) or ``text``, bytes
    the model learns (:mod:`slurm_etc.worker.text_data`: the loss falls)."""
    # a fault to inject: the preset worker with its hooks set (slurm_etc.testing)
    worker = "slurm_etc.testing.worker" if inject else "slurm_etc.worker.preset_worker"
    argv = (sys.executable, "-m", worker, "--model", model.name,
            "--global-batch", str(global_batch), "--train-steps", str(steps),
            "--data", data)
    # one thread per worker process: several share a core here (and the reference path's
    # workers run so too, so losses compare bit for bit)
    env = {"OMP_NUM_THREADS": "1"}
    if inject:
        KillSpec.parse(inject)  # a bad spec fails here, before any worker starts
        env[INJECT_ENV] = inject  # read by slurm_etc.testing.worker only
    return JobSpec(job_id, "demo", argv, provisional_job(model, global_batch, 1, False),
                   EffectivePolicy(grow=False), DEMO_HARDWARE, worker_timeout_s=120.0,
                   env=env)


def timeline_png(path: Path, detail: Any, timeline: Timeline) -> None:
    """Devices training and loss over time: every step drawn where it ran (rank 0's start
    and end), so a resize's pause shows as devices idle, and training that went on while
    the resize was prepared as training; each measured pause and its preparation marked,
    events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = timeline.t0
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True,
                                   gridspec_kw={"height_ratios": [1, 1.3]})
    sizes = {g.number: g.world_size for g in detail.generations}
    for g in detail.generations:
        ran = [s for s in timeline.steps if s.generation == g.number]
        for s in ran:
            ax1.hlines(g.world_size, s.started, s.ended, linewidth=6, color="tab:blue")
        if ran:
            mid = (ran[0].started + ran[-1].ended) / 2
            ax1.text(mid, g.world_size + 0.15, f"gen {g.number}\n{g.layout}", ha="center",
                     va="bottom", fontsize=7)
    # from the first step: the workers' start-up before it is no pause
    left = max(0.0, timeline.steps[0].started - 2.0) if timeline.steps else 0.0
    colours = {"grant": "tab:green", "preempt-notice": "tab:orange", "loss": "tab:red"}
    for e in detail.events:
        x = e.received_at.timestamp() - t0
        if e.kind in colours and x >= left:
            for ax in (ax1, ax2):
                ax.axvline(x, color=colours[e.kind], linestyle="--", linewidth=1)
            ax1.text(x, 0.3, e.kind, rotation=90, fontsize=7, color=colours[e.kind])
    for m in detail.migrations:
        if m.paused_at is None or m.resumed_at is None:
            continue
        paused, resumed = m.paused_at.timestamp() - t0, m.resumed_at.timestamp() - t0
        prepared = paused - (m.preparation_seconds or 0.0)
        for ax in (ax1, ax2):
            ax.axvspan(paused, resumed, color="tab:red", alpha=0.25, linewidth=0)
            if paused > prepared:
                ax.axvspan(prepared, paused, color="gold", alpha=0.25, linewidth=0)
        # the devices of the old layout, idle through the gap
        idle = sizes.get(m.from_generation, 0)
        ax1.hlines(idle, paused, resumed, linewidth=6, color="lightgrey")
        ax1.text((paused + resumed) / 2, 0.9, f"pause {m.pause_seconds:.2f} s", ha="center",
                 fontsize=7, color="tab:red", rotation=90)
    ax1.set_ylabel("devices training")
    ax1.set_ylim(0, max(sizes.values(), default=1) + 1.5)
    ax1.set_title(f"job {detail.job.job_id}: blue steps; red the measured pause (devices "
                  "idle); yellow preparation (trained through)", fontsize=9)
    for g in detail.generations:  # one line per layout: none drawn across a pause
        ran = [s for s in timeline.steps if s.generation == g.number]
        if ran:
            ax2.plot([s.ended for s in ran], [s.loss for s in ran], marker=".", color="black")
    ax2.set_xlim(left=left)
    ax2.set_ylabel("training loss")
    ax2.set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

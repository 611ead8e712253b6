"""``slurm-etc demo``: a small GPT trains through a grow, a preemption and a node loss on local
processes, coordinated as on Slurm (embedded defaults: local backend, per-job SQLite).

Simulated cluster: 3 nodes of 2 devices; the job starts on the anchor node. At step
``grow_at`` node n1 is granted; at ``preempt_at`` it is preempted with a grace; at
``regrow_at`` node n2 is granted; at ``lose_at`` n2 fails without notice. Each time the
coordinator decides, plans and has the workers move the state in memory.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.migrate.faults import INJECT_ENV, KillSpec
from slurm_etc.plan.model import ModelDesc
from slurm_etc.policy.rules import EffectivePolicy

from .events import EventsScript, script_from_dict
from .loop import JobSpec

# CPU "devices": compute dominates, so more devices train faster (the chooser grows).
DEMO_HARDWARE = Hardware(gpus_per_node=2, memory_gib=2.0, tflops=0.01, intra_node_gbps=10.0,
                         inter_node_gbps=5.0, reserved_gib=0.5)


@dataclass
class Timeline:
    """What the demo saw, for the progress display and the PNG."""

    t0: float = field(default_factory=time.time)
    steps: list[tuple[float, int, float, str, int]] = field(default_factory=list)

    def progress(self, p: dict) -> None:
        self.steps.append((time.time() - self.t0, p["step"], p["loss"], p["layout"],
                           p["generation"]))


def demo_script(steps: int, grace_s: float = 60.0) -> EventsScript:
    """The scripted cluster of the demo (events spread over ``steps``)."""
    q = max(steps // 6, 2)
    return script_from_dict({
        "nodes": 3, "gpus_per_node": 2, "initial_nodes": 1, "grace_s": grace_s,
        "events": [
            {"at_step": q, "grant": ["n1"], "reason": "an idle node"},
            {"at_step": 2 * q, "preempt": ["n1"], "grace_s": grace_s,
             "reason": "a higher-priority job"},
            {"at_step": 3 * q, "grant": ["n2"], "reason": "an idle node"},
            {"at_step": 4 * q, "lose": ["n2"], "reason": "node failure"},
        ]}, "<demo>")


def demo_spec(job_id: str, model: ModelDesc, steps: int, global_batch: int = 8,
              inject: str | None = None) -> JobSpec:
    """The demo's job. ``inject``: a kill spec (:class:`~slurm_etc.migrate.faults.KillSpec`,
    e.g. ``mid-transfer``): a worker kills itself (SIGKILL) at that phase of a resize."""
    argv = (sys.executable, "-m", "slurm_etc.worker.preset_worker", "--model", model.name,
            "--global-batch", str(global_batch), "--train-steps", str(steps))
    # one thread per worker process: several share a core here (and the reference path's
    # workers run so too, so losses compare bit for bit)
    env = {"OMP_NUM_THREADS": "1"}
    if inject:
        KillSpec.parse(inject)  # a bad spec fails here, before any worker starts
        env[INJECT_ENV] = inject
    return JobSpec(job_id, "demo", argv, TrainingJob(model, global_batch, 1, False),
                   EffectivePolicy(grow=False), DEMO_HARDWARE, worker_timeout_s=120.0,
                   env=env)


def timeline_png(path: Path, detail: Any, timeline: Timeline) -> None:
    """Devices in the layout and loss over time, generations labelled, resizes and events
    marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = timeline.t0
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True,
                                   gridspec_kw={"height_ratios": [1, 1.3]})
    end = time.time() - t0
    for g in detail.generations:
        start = g.started_at.timestamp() - t0
        stop = (g.ended_at.timestamp() - t0) if g.ended_at else end
        ax1.hlines(g.world_size, start, stop, linewidth=6, color="tab:blue")
        ax1.text((start + stop) / 2, g.world_size + 0.15, f"gen {g.number}\n{g.layout}",
                 ha="center", va="bottom", fontsize=7)
    colours = {"grant": "tab:green", "preempt-notice": "tab:orange", "loss": "tab:red"}
    for e in detail.events:
        if e.kind in colours:
            x = e.received_at.timestamp() - t0
            for ax in (ax1, ax2):
                ax.axvline(x, color=colours[e.kind], linestyle="--", linewidth=1)
            ax1.text(x, 0.3, e.kind, rotation=90, fontsize=7, color=colours[e.kind])
    for m in detail.migrations:
        if m.ended_at is not None:
            for ax in (ax1, ax2):
                ax.axvspan(m.started_at.timestamp() - t0, m.ended_at.timestamp() - t0,
                           color="grey", alpha=0.2)
    ax1.set_ylabel("devices training")
    ax1.set_ylim(0, max((g.world_size for g in detail.generations), default=1) + 1.5)
    ax1.set_title(f"slurm-etc demo: job {detail.job.job_id} (grey: migrations)")
    if timeline.steps:
        xs = [s[0] for s in timeline.steps]
        ax2.plot(xs, [s[2] for s in timeline.steps], marker=".", color="black")
    ax2.set_ylabel("training loss")
    ax2.set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Side-by-side numbers and the occupancy plot of a compact vs naive replay."""
from __future__ import annotations

from pathlib import Path

from .engine import SimResult

# (summary key, label, format, better: "higher" | "lower" | "")
ROWS = (
    ("occupancy_pct", "GPU occupancy (busy / up GPUs)", "{:.1f} %", "higher"),
    ("elastic_share_pct", "  of it: elastic jobs training", "{:.1f} %", ""),
    ("idle_held_gpus", "idle devices held by elastic jobs (avg)", "{:.1f}", "lower"),
    ("partial_nodes", "partially used nodes (avg)", "{:.1f}", "lower"),
    ("split_tp_groups", "tensor-parallel groups across nodes (avg)", "{:.1f}", "lower"),
    ("resizes", "resizes", "{:d}", ""),
    ("moved_tib", "bytes migrated", "{:.2f} TiB", "lower"),
    ("pauses", "pauses (no configuration fits)", "{:d}", "lower"),
    ("rigid_jobs_started", "rigid jobs started", "{:d}", "higher"),
    ("rigid_mean_wait_h", "rigid jobs' mean wait", "{:.2f} h", "lower"),
    ("preempted_gpus", "GPUs preempted from elastic jobs", "{:d}", ""),
)


def comparison(compact: SimResult, naive: SimResult) -> dict:
    """Both summaries plus the headline differences."""
    a, b = dict(compact.summary), dict(naive.summary)
    for s in (a, b):
        s["moved_tib"] = s["moved_bytes"] / 2 ** 40
    return {
        "compact": a,
        "naive": b,
        "occupancy_gain_pp": a["occupancy_pct"] - b["occupancy_pct"],
        "partial_nodes_ratio": _ratio(a["partial_nodes"], b["partial_nodes"]),
        "idle_held_ratio": _ratio(a["idle_held_gpus"], b["idle_held_gpus"]),
        "moved_bytes_ratio": _ratio(a["moved_bytes"], b["moved_bytes"]),
    }


def _ratio(x: float, y: float) -> float | None:
    return None if y == 0 else x / y


def rows(result: dict) -> list[tuple[str, str, str]]:
    """(label, compact, naive) for the human table."""
    out = []
    for key, label, fmt, _ in ROWS:
        out.append((label, fmt.format(result["compact"][key]), fmt.format(result["naive"][key])))
    return out


def plot(compact: SimResult, naive: SimResult, path: str | Path, title: str) -> None:
    """Occupancy, idle devices held and partially used nodes over time, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, idle, partial) = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True,
                                             gridspec_kw={"height_ratios": [3, 1.5, 1.5]})
    for r, color, name in ((compact, "tab:blue", "slurm-etc (compact)"),
                           (naive, "tab:orange", "naive (first-fit)")):
        hours = [t / 3600 for t in r.times]
        s = r.summary
        top.step(hours, [100 * o for o in r.occupancy], where="post", color=color,
                 label=f"{name}: {s['occupancy_pct']:.1f} % avg")
        idle.step(hours, r.idle_held, where="post", color=color,
                  label=f"{name}: {s['idle_held_gpus']:.1f} avg")
        partial.step(hours, r.partial_nodes, where="post", color=color,
                     label=f"{name}: {s['partial_nodes']:.1f} avg")
    top.set_ylabel("GPU occupancy (%)")
    top.set_ylim(0, 100)
    top.set_title(title)
    idle.set_ylabel("idle devices\nheld")
    partial.set_ylabel("partially\nused nodes")
    partial.set_xlabel("hours")
    for ax in (top, idle, partial):
        ax.legend(loc="lower right" if ax is top else "upper left", fontsize="small")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

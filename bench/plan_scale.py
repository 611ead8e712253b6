"""Planning time, peak memory and plan quality from 1,024 to 131,072 GPUs.

Each case runs in a fresh process, so its peak RSS (``VmHWM`` of /proc/self/status, reset as
the process starts: ``ru_maxrss`` keeps the high-water mark of the process that forked it,
a gigabyte when a long test run starts the case; interpreter and imports included) is its
own. Time is the whole ``plan_migration`` call, the plan's validation
included: wall seconds, and the CPU seconds the process used (what to compare on a shared
machine; run with ``OMP_NUM_THREADS=1`` so the two measure the same single thread).
Series: dp shrinks by 1/8 (the last dp replicas of every stage are released), dp grows
by 8/7 (whole nodes appended) and reshapes (gpt-175b pp16 -> pp8 with dp doubled;
llama-70b tp8 -> tp4 with dp doubled), for gpt-175b (tp8 pp16) and llama-70b (tp8 pp8),
and expert-parallel changes of qwen3-235b-a22b (tp4 pp2: ep32 -> ep64 on the same GPUs, and
a dp shrink by 1/8 with ep64 -> ep32), distributed optimizer on except where the name says
otherwise. Targets: 1 s at 16,384 GPUs, 10 s and 2 GiB at 131,072.

    python bench/plan_scale.py [--max-gpus N] [--min-gpus N] [--series TEXT] [--json]
                               [--png docs/plan_scale.png] [--save F]
    python bench/plan_scale.py --case '["qwen3-235b-a22b",[256,4,2,32],[256,4,2,64],true]'

A case's layouts are ``[dp, tp, pp, ep, cp, vpp]`` (trailing degrees default to 1) or layout
strings (``"dp=256,tp=4,pp=2,ep=32"``).
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slurm_etc.plan import ParallelConfig

SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
# (series, model, tp, pp, kind, distributed optimizer)
SERIES = [
    ("gpt-175b dp shrink", "gpt-175b", 8, 16, "shrink", True),
    ("gpt-175b dp grow", "gpt-175b", 8, 16, "grow", True),
    ("llama-70b dp shrink", "llama-70b", 8, 8, "shrink", True),
    ("llama-70b dp grow", "llama-70b", 8, 8, "grow", True),
    ("gpt-175b pp16->pp8 (no ZeRO)", "gpt-175b", 8, 16, "pp", False),
    ("llama-70b tp8->tp4", "llama-70b", 8, 8, "tp", True),
    ("qwen3-235b ep32->ep64", "qwen3-235b-a22b", 4, 2, "ep", True),
    ("qwen3-235b dp shrink, ep64->ep32", "qwen3-235b-a22b", 4, 2, "ep-shrink", True),
]
MOE_SIZES = (2048, 4096, 8192, 16384)   # the expert series: ep 64 needs dp >= 64
TARGETS = {16384: (1.0, None), 131072: (10.0, 2048.0)}   # GPUs: (seconds, MiB)
GPN = 8


Degrees = tuple[int, ...]


def case_configs(tp: int, pp: int, kind: str, gpus: int) -> tuple[Degrees, Degrees]:
    """(old, new) as (dp, tp, pp[, ep]) for a series at ``gpus`` GPUs (the larger side)."""
    dp = gpus // (tp * pp)
    if kind == "ep":
        return (dp, tp, pp, 32), (dp, tp, pp, 64)
    if kind == "ep-shrink":
        return (dp, tp, pp, 64), (dp - dp // 8, tp, pp, 32)
    if kind == "shrink":
        return (dp, tp, pp), (dp - dp // 8, tp, pp)
    if kind == "grow":
        return (dp - dp // 8, tp, pp), (dp, tp, pp)
    if kind == "pp":
        return (dp, tp, pp), (2 * dp, tp, pp // 2)
    if kind == "tp":
        return (dp, tp, pp), (2 * dp, tp // 2, pp)
    raise ValueError(f"unknown kind {kind!r}")


def drop_last_replicas(old: Degrees, new: Degrees, gpn: int = GPN) -> list[int]:
    """Nodes holding the dp replicas a shrink gives up: the last ones of every stage."""
    dp, tp, pp = old[:3]
    per_stage = dp * tp // gpn
    keep = new[0] * new[1] // gpn
    return [p * per_stage + i for p in range(pp) for i in range(keep, per_stage)] \
        if new[2] == pp and new[1] == tp and new[0] < dp else []


def parse_layout(spec: object, dist: bool) -> ParallelConfig:
    """A ParallelConfig from ``[dp, tp, pp, ep, cp, vpp]`` (a prefix) or a layout string."""
    from slurm_etc.plan import ParallelConfig
    from slurm_etc.plan.config import DEGREE_NAMES

    if isinstance(spec, str):
        return ParallelConfig.parse(spec, dist)
    if not isinstance(spec, (list, tuple)) or not 1 <= len(spec) <= len(DEGREE_NAMES):
        raise SystemExit(f"a case layout is [dp, tp, pp, ep, cp, vpp] or a string, "
                         f"got {spec!r}")
    return ParallelConfig(distributed_optimizer=dist, **dict(zip(DEGREE_NAMES, spec)))


def run_case(model: str, old: object, new: object, dist: bool) -> dict:
    from slurm_etc.plan import (
        PRESETS,
        Layout,
        Topology,
        default_pool,
        plan_migration,
    )
    oc, nc = parse_layout(old, dist), parse_layout(new, dist)
    oc.validate_for(PRESETS[model])
    nc.validate_for(PRESETS[model])
    layout = Layout(oc, tuple(range(oc.world)))
    topo = Topology(gpus_per_node=GPN)
    drop = (drop_last_replicas((oc.dp, oc.tp, oc.pp), (nc.dp, nc.tp, nc.pp))
            if oc.cp == nc.cp == 1 else [])
    pool = default_pool(layout, nc, topo, drop_nodes=drop)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = plan_migration(PRESETS[model], layout, nc, pool, topo)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = plan.summary()
    s["wall_seconds"] = wall
    s["cpu_seconds"] = cpu  # what the planner used of the CPU: robust on a shared machine
    s["peak_rss_mib"] = peak_rss_mib()
    return s


def reset_peak_rss() -> None:
    """Forget the peak RSS this process inherited from the one that forked it (Linux keeps
    it across fork and exec): writing 5 to clear_refs resets VmHWM to the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    """This process's peak RSS since :func:`reset_peak_rss` (ru_maxrss where /proc is not
    readable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cases(max_gpus: int, min_gpus: int = 0, series: str = ""
          ) -> list[tuple[str, str, int, tuple, tuple, bool]]:
    out = []
    for name, model, tp, pp, kind, dist in SERIES:
        if series not in name:
            continue
        for gpus in (MOE_SIZES if kind.startswith("ep") else SIZES):
            if min_gpus <= gpus <= max_gpus:
                old, new = case_configs(tp, pp, kind, gpus)
                out.append((name, model, gpus, old, new, dist))
    return out


def slope(rows: list[dict], key: str) -> float | None:
    """Exponent of ``key`` against GPUs between the two largest sizes of a series."""
    if len(rows) < 2:
        return None
    a, b = rows[-2], rows[-1]
    if a[key] <= 0 or b[key] <= 0:
        return None
    return math.log(b[key] / a[key]) / math.log(b["gpus"] / a["gpus"])


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name in dict.fromkeys(r["series"] for r in rows):
        sel = [r for r in rows if r["series"] == name]
        g = [r["gpus"] for r in sel]
        ax_t.plot(g, [r["cpu_seconds"] for r in sel], "o-", label=name)
        ax_m.plot(g, [r["peak_rss_mib"] for r in sel], "o-", label=name)
    main = [r for r in rows if r["series"] == SERIES[0][0]]
    if main:
        g0, t0 = main[0]["gpus"], main[0]["cpu_seconds"]
        g = [r["gpus"] for r in main]
        ref = [t0 * (x * math.log(x)) / (g0 * math.log(g0)) for x in g]
        ax_t.plot(g, ref, "k--", label="n log n (from the first gpt-175b shrink)")
    for ax, what in ((ax_t, "planning CPU seconds"), (ax_m, "peak RSS MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs (larger side of the resize)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.axhline(10.0, color="r", lw=0.8, ls=":")
    ax_m.axhline(2048.0, color="r", lw=0.8, ls=":")
    ax_t.legend(fontsize=7)
    ax_t.set_title("planning time (target 10 s at 131,072)")
    ax_m.set_title("peak memory of the planning process (target 2 GiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        reset_peak_rss()
        model, old, new, dist = json.loads(sys.argv[2])
        print(json.dumps(run_case(model, tuple(old), tuple(new), dist)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-gpus", type=int, default=max(SIZES))
    ap.add_argument("--min-gpus", type=int, default=0)
    ap.add_argument("--series", default="", help="only the series whose name holds this")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--png", default=None, help="write the log-log figure here")
    ap.add_argument("--save", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    todo = cases(args.max_gpus, args.min_gpus, args.series)
    for i, (name, model, gpus, old, new, dist) in enumerate(todo):
        print(f"[{i + 1}/{len(todo)}] {name} {gpus} ...", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, "--case",
                              json.dumps([model, old, new, dist])],
                             capture_output=True, text=True, check=True)
        s = json.loads(out.stdout.strip().splitlines()[-1])
        s.update(series=name, gpus=gpus)
        rows.append(s)
    if args.png:
        plot(rows, args.png)
    if args.save:
        with open(args.save, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| case | GPUs | from -> to | wall s | CPU s | target s | peak RSS MiB | moved GiB "
          "| moved / lower bound | messages | rounds | est s / bound s | sketch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in rows:
        target = TARGETS.get(s["gpus"], (None, None))[0]
        ratio = s["moved_over_lower_bound"]
        print(f"| {s['series']} | {s['gpus']} | {s['from']} -> {s['to']} | "
              f"{s['wall_seconds']:.2f} | {s['cpu_seconds']:.2f} | {target or ''} | "
              f"{s['peak_rss_mib']:.0f} | "
              f"{s['moved_bytes'] / 2**30:.1f} | {'-' if ratio is None else f'{ratio:.4f}'} | "
              f"{s['messages']} | {s['rounds']} | "
              f"{s['est_seconds']:.2f} / {s['lower_bound_seconds']:.2f} | {s['sketch']}"
              f"{'' if s['lower_bound_exact'] else ', relaxed bound'} |")
    print()
    for name in dict.fromkeys(r["series"] for r in rows):
        sel = [r for r in rows if r["series"] == name]
        e_t, e_m = slope(sel, "cpu_seconds"), slope(sel, "peak_rss_mib")
        if e_t is not None:
            print(f"{name}: CPU time ~ n^{e_t:.2f}, memory ~ n^{e_m:.2f} between "
                  f"{sel[-2]['gpus']} and {sel[-1]['gpus']} GPUs")


if __name__ == "__main__":
    main()

"""Planning time, peak memory and plan quality at cluster scale.

Each case runs in a fresh process so its peak RSS is its own. Targets (2-core machine):
at most 1 s at 1,024 GPUs and 10 s at 16,384 GPUs.

    python bench/plan_scale.py [--json]
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

CASES = [
    # name, model, from, to, distributed optimizer, shrink drops the last dp replicas per stage
    ("llama-70b 1024->896", "llama-70b", (16, 8, 8), (14, 8, 8), True),
    ("llama-70b 1024->896 (no ZeRO)", "llama-70b", (16, 8, 8), (14, 8, 8), False),
    ("gpt-175b 4096->3072", "gpt-175b", (32, 8, 16), (24, 8, 16), True),
    ("gpt-175b 16384->14336", "gpt-175b", (128, 8, 16), (112, 8, 16), True),
    ("gpt-175b 16384->16384 pp16->pp8", "gpt-175b", (128, 8, 16), (256, 8, 8), False),
]
TARGET_S = {1024: 1.0, 16384: 10.0}


def drop_last_replicas(old, new, gpn=8):
    """Nodes holding the dp replicas a shrink gives up: the last ones of every stage."""
    dp, tp, pp = old
    per_stage = dp * tp // gpn
    keep = new[0] * new[1] // gpn
    return [p * per_stage + i for p in range(pp) for i in range(keep, per_stage)] \
        if new[2] == pp and new[0] < dp else []


def run_case(model, old, new, dist):
    from slurm_etc.plan import (
        PRESETS,
        Layout,
        ParallelConfig,
        Topology,
        default_pool,
        plan_migration,
    )
    oc = ParallelConfig(*old, distributed_optimizer=dist)
    nc = ParallelConfig(*new, distributed_optimizer=dist)
    layout = Layout(oc, tuple(range(oc.world)))
    topo = Topology(gpus_per_node=8)
    pool = default_pool(layout, nc, topo, drop_nodes=drop_last_replicas(old, new))
    t0 = time.perf_counter()
    plan = plan_migration(PRESETS[model], layout, nc, pool, topo)
    wall = time.perf_counter() - t0
    s = plan.summary()
    s["wall_seconds"] = wall
    s["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return s


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        name, model, old, new, dist = CASES[int(sys.argv[2])]
        print(json.dumps(run_case(model, old, new, dist)))
        return
    rows = []
    for i, (name, *_rest) in enumerate(CASES):
        print(f"[{i + 1}/{len(CASES)}] {name} ...", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, "--case", str(i)], capture_output=True,
                             text=True, check=True)
        s = json.loads(out.stdout.strip().splitlines()[-1])
        s["case"] = name
        rows.append(s)
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=2))
        return
    print("| case | GPUs | plan s | target s | peak RSS MiB | moved GiB | moved / lower bound "
          "| moved / identity | messages | rounds | est s / bound s | sketch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in rows:
        gpus = s["old_devices"]
        target = TARGET_S.get(gpus, "")
        ratio = s["moved_over_lower_bound"]
        naive = s["moved_over_naive"]
        print(f"| {s['case']} | {gpus} | {s['plan_seconds']:.2f} | {target} | "
              f"{s['peak_rss_mib']:.0f} | {s['moved_bytes'] / 2**30:.1f} | "
              f"{'-' if ratio is None else f'{ratio:.3f}'} | "
              f"{'-' if naive is None else f'{naive:.3f}'} | {s['messages']} | {s['rounds']} | "
              f"{s['est_seconds']:.2f} / {s['lower_bound_seconds']:.2f} | {s['sketch']}"
              f"{'' if s['lower_bound_exact'] else ', relaxed bound'} |")


if __name__ == "__main__":
    main()

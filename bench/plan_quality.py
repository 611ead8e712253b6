"""Plan quality over a suite of transitions: moved bytes against the byte lower bound.

For each transition: the unconstrained plan (must equal the bound), the plan with
tensor-parallel groups kept inside a node (target: within 5% of the bound), and identity
placement (new rank i on device i) for comparison.

    python bench/plan_quality.py [--json]
"""
from __future__ import annotations

import json
import sys

from slurm_etc.plan import PRESETS, Layout, ParallelConfig, Topology, default_pool, plan_migration

SUITE = [
    # model, from (dp, tp, pp), to, distributed optimizer, gpus per node
    ("gpt-1.3b", (8, 2, 2), (6, 2, 2), False, 8),     # dp shrink (preemption of 8 GPUs)
    ("gpt-1.3b", (8, 2, 2), (6, 2, 2), True, 8),
    ("gpt-1.3b", (4, 2, 2), (8, 2, 2), True, 8),      # dp grow
    ("gpt-1.3b", (8, 2, 2), (4, 4, 2), False, 8),     # tp change
    ("gpt-1.3b", (8, 2, 2), (4, 4, 2), True, 8),
    ("gpt-1.3b", (8, 2, 2), (4, 2, 4), True, 8),      # pp change
    ("llama-7b", (4, 4, 2), (3, 4, 2), True, 8),      # uneven dp
    ("llama-7b", (4, 4, 2), (2, 8, 2), False, 8),
    ("llama-7b", (4, 4, 2), (4, 2, 4), True, 8),      # tp -> pp
    ("llama-7b", (2, 8, 2), (3, 8, 2), True, 8),      # grow by one node per stage
    ("llama-13b", (4, 8, 2), (2, 8, 4), False, 8),    # pp grow, dp shrink
    ("llama-13b", (8, 4, 2), (6, 4, 2), True, 8),
    ("llama-70b", (4, 8, 8), (3, 8, 8), True, 8),     # shrink a 256-GPU job
    ("llama-70b", (2, 8, 8), (2, 8, 10), False, 8),   # pp 8 -> 10 on 32 more GPUs
]


def run(model, old, new, dist, gpn):
    oc, nc = ParallelConfig(*old, dist), ParallelConfig(*new, dist)
    layout = Layout(oc, tuple(range(oc.world)))
    topo = Topology(gpus_per_node=gpn)
    pool = default_pool(layout, nc, topo)
    free = plan_migration(PRESETS[model], layout, nc, pool, topo, keep_tp_in_node=False)
    tp = plan_migration(PRESETS[model], layout, nc, pool, topo, keep_tp_in_node=True)
    lb = free.lower_bound_moved_bytes
    return {
        "model": model, "from": str(oc), "to": str(nc), "gpus": f"{oc.world}->{nc.world}",
        "lower_bound_gib": lb / 2**30,
        "unconstrained_over_bound": free.moved_bytes / lb if lb else 1.0,
        "tp_in_node_over_bound": tp.moved_bytes / lb if lb else (1.0 if not tp.moved_bytes
                                                                 else float("inf")),
        "identity_over_bound": tp.naive_moved_bytes / lb if lb else None,
        "saved_vs_identity_gib": (tp.naive_moved_bytes - tp.moved_bytes) / 2**30,
        "plan_seconds": tp.plan_seconds,
    }


def main() -> None:
    rows = [run(*case) for case in SUITE]
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=2))
        return
    print("| model | transition | GPUs | lower bound GiB | unconstrained / bound "
          "| TP-in-node / bound | identity / bound | saved vs identity GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ident = "-" if r["identity_over_bound"] is None else f"{r['identity_over_bound']:.3f}"
        print(f"| {r['model']} | {r['from']} -> {r['to']} | {r['gpus']} | "
              f"{r['lower_bound_gib']:.1f} | {r['unconstrained_over_bound']:.3f} | "
              f"{r['tp_in_node_over_bound']:.3f} | {ident} | {r['saved_vs_identity_gib']:.1f} |")
    worst = max(r["tp_in_node_over_bound"] for r in rows)
    exact = all(abs(r["unconstrained_over_bound"] - 1) < 1e-12 for r in rows)
    print(f"\nunconstrained plans at the bound: {exact}; worst TP-in-node ratio: {worst:.3f}")


if __name__ == "__main__":
    main()

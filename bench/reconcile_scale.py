"""The coordinator's bookkeeping per worker message, from 1,024 to 65,536 ranks.

For each N, one resize in flight takes N ``answered`` (every rank commits), N ``told`` and N
``became_ready`` (every rank a joiner), each a new value replacing the old one, as the
coordinator's loop does: ``after`` is the real functions of slurm_etc/coordinator/reconcile.py
(persistent maps and sets: O(log n) a message); ``before`` is the way they were, reproduced
here and measured in the same run: the same frozen dataclass of 21 fields replaced whole, its
``reports`` dict and ``told`` and ``ready`` frozensets copied at each message (O(n) a message,
so O(N^2) a resize). Both end with the same answers, told and ready (checked).

Printed per N: the CPU seconds of the 3N calls (the process's own, what to compare on a
shared machine; the wall seconds are in ``--json``), before and after, their ratio, and the
microseconds per call. ``after`` per call stays flat as N grows (linear in N); ``before``
per call grows with N.

    .venv/bin/python bench/reconcile_scale.py [--sizes 1024,4096,16384,65536] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from slurm_etc.coordinator import reconcile
from slurm_etc.coordinator.reconcile import InflightResize, answer
from slurm_etc.protocol.messages import LayoutSpec, Resize, Resized

SIZES = (1024, 4096, 16384, 65536)
ORDER = Resize("bench", 2, LayoutSpec.make("dp=1,tp=1,pp=1", (0,)),
               LayoutSpec.make("dp=2,tp=1,pp=1", (0, 1)))


@dataclass(frozen=True)
class Before:
    """InflightResize as it was: the same fields, ``reports`` a dict, the sets frozensets."""

    order: Resize
    plan: Any
    migration_id: int
    participants: frozenset[int]
    joiners: frozenset[int]
    vranks: Mapping[int, Any]
    release: frozenset[Any]
    started: float
    stayers: frozenset[int] = frozenset()
    reports: Mapping[int, Resized] = field(default_factory=dict)
    told: frozenset[int] = frozenset()
    sent_at: float = 0.0
    dead: frozenset[int] = frozenset()
    rebuild: bool = False
    early: tuple[Any, ...] = ()
    never_joined: Mapping[int, str] = field(default_factory=dict)
    decided_at: float = 0.0
    ready: frozenset[int] = frozenset()
    step_at_launch: int = 0


def answered_before(resize: Before, vrank: int, report: Resized) -> Before:
    return replace(resize, reports={**resize.reports,
                                    vrank: answer(resize.reports.get(vrank), report)})


def told_before(resize: Before, vrank: int) -> Before:
    return replace(resize, told=resize.told | {vrank})


def became_ready_before(resize: Before, vrank: int) -> Before:
    return replace(resize, ready=resize.ready | {vrank})


def run(start: Any, answered: Callable[..., Any], told: Callable[..., Any],
        became_ready: Callable[..., Any], reports: list[Resized]) -> tuple[Any, float, float]:
    """The 3N messages on ``start``: the last value, CPU and wall seconds."""
    cpu, wall = time.process_time(), time.perf_counter()
    fl = start
    for r in reports:
        fl = answered(fl, r.vrank, r)
    for r in reports:
        fl = told(fl, r.vrank)
    for r in reports:
        fl = became_ready(fl, r.vrank)
    return fl, time.process_time() - cpu, time.perf_counter() - wall


def case(n: int) -> dict[str, Any]:
    vranks = frozenset(range(n))
    common: dict[str, Any] = dict(order=ORDER, plan=None, migration_id=1, participants=vranks,
                                  joiners=vranks, vranks={}, release=frozenset(),
                                  started=0.0)
    reports = [Resized("bench", 2, v, "committed", 9) for v in range(n)]  # type: ignore[arg-type]
    old, old_cpu, old_wall = run(Before(**common), answered_before, told_before,
                                 became_ready_before, reports)
    new, new_cpu, new_wall = run(InflightResize(**common), reconcile.answered, reconcile.told,
                                 reconcile.became_ready, reports)
    if not (new.reports == old.reports and new.told == old.told and new.ready == old.ready):
        raise SystemExit(f"N={n}: the persistent resize ended unlike the copied one")
    calls = 3 * n
    return {"n": n, "calls": calls, "before_cpu_s": old_cpu, "after_cpu_s": new_cpu,
            "before_wall_s": old_wall, "after_wall_s": new_wall,
            "ratio": old_cpu / new_cpu if new_cpu else None,
            "before_us_per_call": 1e6 * old_cpu / calls,
            "after_us_per_call": 1e6 * new_cpu / calls}


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)),
                   help="comma-separated rank counts (default %(default)s)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        print(f"--sizes: comma-separated integers, not {args.sizes!r}", file=sys.stderr)
        return 2
    rows = []
    for n in sizes:
        rows.append(case(n))
        if not args.json:
            r = rows[-1]
            if len(rows) == 1:
                print(f"{'N':>7}  {'before s':>9}  {'after s':>8}  {'ratio':>7}  "
                      f"{'before us/call':>14}  {'after us/call':>13}")
            print(f"{r['n']:>7,}  {r['before_cpu_s']:>9.3f}  {r['after_cpu_s']:>8.3f}  "
                  f"{r['ratio']:>6.1f}x  {r['before_us_per_call']:>14.2f}  "
                  f"{r['after_us_per_call']:>13.2f}", flush=True)
    if args.json:
        print(json.dumps({"clock": "process CPU seconds (wall in *_wall_s)",
                          "calls": "N answered + N told + N became_ready", "rows": rows},
                         indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

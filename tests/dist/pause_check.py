"""The training gaps of a run from its workers' own per-step log lines, and the check that a
record's pauses are those gaps (the measured-pause tests; importable by a bench too).

Every rank logs ``[job J gen G vrank V] step S loss ... started T0 ended T1`` for each step
it trains (unix seconds). A resize into generation ``g`` stopped training from the end of
a process's last step in ``g - 1`` (a process that joined with it: the old layout's, on its
lowest vrank) to the start of its first step in ``g``; the resize's training gap is the
largest over the processes of ``g``.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

STEP_LINE = re.compile(r"\[job \S+ gen (\d+) vrank (\d+)\] step (\d+) loss \S+ lr \S+ "
                       r"consumed \d+ started ([\d.]+) ended ([\d.]+)")
RESIZED_LINE = re.compile(r"\[job \S+ gen (\d+) vrank (\d+)\] resized .* pause ([\d.]+) s,")
# logged when a stayer built the new world at one step boundary (not a thread: it swaps
# torch's and megatron's globals), training stopped meanwhile: the record's stall
WORLD_LINE = re.compile(r"built the new world of generation \d+ at a step boundary: [\d.]+ s "
                        r"\(training stopped; unix ([\d.]+) to ([\d.]+)\)")

# logged when a collective failed (a peer died) after the process's last trained step
FAILED_LINE = re.compile(r"\[job \S+ gen (\d+) vrank (\d+)\] a collective failed after step "
                         r"\d+ at unix ([\d.]+)")


@dataclass(frozen=True)
class Step:
    generation: int
    vrank: int
    step: int
    started: float
    ended: float


def steps_from_logs(log_dir: Path) -> list[Step]:
    out = []
    for log in sorted(Path(log_dir).glob("*.log")):
        for m in STEP_LINE.finditer(log.read_text(errors="replace")):
            g, v, s, t0, t1 = m.groups()
            out.append(Step(int(g), int(v), int(s), float(t0), float(t1)))
    return out


def world_builds(log_dir: Path) -> list[tuple[float, float]]:
    """When stayers built the new world at a step boundary: (start, end), unix seconds."""
    return [(float(m.group(1)), float(m.group(2)))
            for log in sorted(Path(log_dir).glob("*.log"))
            for m in WORLD_LINE.finditer(log.read_text(errors="replace"))]


def worker_timed_pauses(log_dir: Path) -> dict[int, float]:
    """What the record held before the pause was measured at the step boundaries: the
    largest of the workers' own timings around the resize code, per new generation."""
    out: dict[int, float] = {}
    for log in sorted(Path(log_dir).glob("*.log")):
        for m in RESIZED_LINE.finditer(log.read_text(errors="replace")):
            g, p = int(m.group(1)), float(m.group(3))
            out[g] = max(out.get(g, 0.0), p)
    return out


def interrupted_steps(log_dir: Path, steps: list[Step]) -> dict[int, float]:
    """Of every resize's training gap (keyed by the new generation), the part before the
    widest-gap process's step in flight failed (a peer lost; 0 where it logged no failure):
    from its last old step's end to the failure, as its log lines give them."""
    failed: dict[tuple[int, int], float] = {}
    for log in sorted(Path(log_dir).glob("*.log")):
        for m in FAILED_LINE.finditer(log.read_text(errors="replace")):
            key = (int(m.group(1)), int(m.group(2)))
            failed.setdefault(key, float(m.group(3)))  # the first failure
    out: dict[int, float] = {}
    for g, (v, last, first) in _widest(steps).items():
        at = failed.get((g - 1, v))
        out[g] = 0.0 if at is None else min(max(0.0, at - last.ended), first.started - last.ended)
    return out


def _widest(steps: list[Step]) -> dict[int, tuple[int, Step, Step]]:
    """Each resize's widest-gap process (lowest vrank on a tie): (vrank, last old step,
    first new step), keyed by the new generation."""
    by = defaultdict(list)
    for s in steps:
        by[(s.generation, s.vrank)].append(s)
    out: dict[int, tuple[int, Step, Step]] = {}
    first_gen = min((s.generation for s in steps), default=0)
    for g in sorted({s.generation for s in steps} - {first_gen}):
        old = {v: max(xs, key=lambda s: s.ended) for (gg, v), xs in by.items() if gg == g - 1}
        new = {v: min(xs, key=lambda s: s.started) for (gg, v), xs in by.items() if gg == g}
        if old and new:
            publisher = old[min(old)]
            out[g] = max(((v, old.get(v, publisher), f) for v, f in sorted(new.items())),
                         key=lambda t: (t[2].started - t[1].ended, -t[0]))
    return out


def training_gaps(steps: list[Step], *, from_start: bool = False) -> dict[int, float]:
    """The training gap of every resize (keyed by the new generation, from the one before
    it), from the per-step times. ``from_start``: measure from the last old step's start
    instead of its end (a planted error, for the check's own test)."""
    gaps: dict[int, float] = {}
    for g in sorted({s.generation for s in steps}):
        if g == min(s.generation for s in steps):
            continue
        gap = gap_between(steps, g - 1, g, from_start=from_start)
        if gap is not None:
            gaps[g] = gap
    return gaps


def gap_between(steps: list[Step], old_gen: int, new_gen: int, *,
                from_start: bool = False) -> float | None:
    """The training gap of the resize from generation ``old_gen`` to ``new_gen`` (not
    always the one before: an aborted resize's generation trains nothing), or None where
    either side has no step: over the new layout's processes, its first new step's start
    less its last old step's end (a joiner's: the old layout's lowest vrank's)."""
    last: dict[int, Step] = {}
    first: dict[int, Step] = {}
    for s in steps:
        if s.generation == old_gen and (s.vrank not in last or s.ended > last[s.vrank].ended):
            last[s.vrank] = s
        if s.generation == new_gen and (s.vrank not in first
                                        or s.started < first[s.vrank].started):
            first[s.vrank] = s
    if not last or not first:
        return None
    publisher = last[min(last)]
    return max(f.started - (old.started if from_start else old.ended)
               for v, f in first.items() for old in [last.get(v, publisher)])


def preparation_stalls(steps: list[Step], windows: dict[int, tuple[float, float]]
                       ) -> dict[int, float]:
    """The stall of every resize (keyed by the new generation) from the per-step times: the
    widest gap between two consecutive old-layout steps of a process of the new layout
    inside the resize's preparation, ``windows[g] = (decided, paused)`` in unix seconds
    (0 where no two steps lie in it: a loss, a joiner)."""
    by = defaultdict(list)
    for s in steps:
        by[(s.generation, s.vrank)].append(s)
    out: dict[int, float] = {}
    for g, (decided, paused) in sorted(windows.items()):
        stayers = {v for (gg, v) in by if gg == g} & {v for (gg, v) in by if gg == g - 1}
        worst = 0.0
        for v in stayers:
            old = sorted(by[(g - 1, v)], key=lambda s: s.started)
            for a, b in zip(old, old[1:]):
                if a.ended >= decided - 0.05 and b.started <= paused + 0.05:
                    worst = max(worst, b.started - a.ended)
        out[g] = worst
    return out


def mismatches(recorded: dict[int, float | None], gaps: dict[int, float],
               tolerance_s: float = 0.05) -> list[str]:
    """Why the recorded pauses are not the gaps (empty: they are, within ``tolerance_s``)."""
    out = []
    for g, gap in sorted(gaps.items()):
        got = recorded.get(g)
        if got is None or abs(got - gap) > tolerance_s:
            out.append(f"resize into generation {g}: recorded pause {got}, training gap from "
                       f"the per-step times {gap:.3f} s")
    for g in sorted(set(recorded) - set(gaps)):
        out.append(f"resize into generation {g}: recorded, but no step times either side")
    return out


def against_record(log_dir: Path, migrations: list[dict]) -> tuple[list[dict], list[str]]:
    """Every committed resize of a run (``slurm-etc status --json``'s migrations) beside its
    training gap from the per-step times in ``log_dir``'s logs: rows to print and why the
    record is not the gaps (empty: every recorded pause is its gap within 0.05 s). A row's
    ``within`` says whether the gap's part after any step in flight is at most the data
    phase + 0.15 s (the zero-stall target; printed, not asserted: a figure of this machine)."""
    steps = steps_from_logs(log_dir)
    cut = interrupted_steps(log_dir, steps)
    committed = [m for m in migrations if m["outcome"] == "committed"]
    recorded = {m["to_generation"]: m["pause_seconds"] for m in committed}
    gaps = {m["to_generation"]: gap for m in committed
            if (gap := gap_between(steps, m["from_generation"], m["to_generation"]))
            is not None}
    rows = []
    for m in committed:
        g = m["to_generation"]
        gap, data = gaps.get(g), m["data_seconds"] or 0.0
        in_flight = cut.get(g, 0.0)
        rows.append({"generation": g, "gap": gap, "recorded": m["pause_seconds"],
                     "data": data, "in_flight": in_flight,
                     "within": gap is not None and gap - in_flight <= data + 0.15})
    return rows, mismatches(recorded, gaps)


def format_rows(rows: list[dict]) -> str:
    return "\n".join(
        f"  resize into generation {r['generation']}: gap {r['gap']:.3f} s from the step times, "
        f"recorded {r['recorded']:.3f} s, data {r['data']:.3f} s, in flight "
        f"{r['in_flight']:.3f} s: gap - in flight {'<=' if r['within'] else '>'} data + 0.15"
        for r in rows if r["gap"] is not None and r["recorded"] is not None)

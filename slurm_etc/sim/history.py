"""A site's own job history, from Slurm's accounting (``sacct -P``), for ``slurm-etc simulate
--sacct``: what happened (GPU-hours used and idle, work preempted, queue wait), and the same
rigid work replayed with elastic jobs beside it (pure: text in, figures and a trace out).

The history the docs ask admins for (one allocation per line; ``-X`` leaves the steps out)::

    sacct -a -X -P -S 2026-11-01 -E 2026-12-01 \\
        --format=JobID,JobName,Partition,State,Submit,Start,End,Elapsed,NNodes,AllocTRES

Columns are found by their header name, in any order; others are ignored. A comma-separated
file in the column layout of SenseTime's Helios trace (``job_id, gpu_num, node_num, state,
submit_time, start_time, end_time``) reads the same. What a line may be:

* a step (``123.batch``, ``123.extern``, ``123.0``): skipped (its allocation is the job);
* an array element (``123_4``) or a heterogeneous component (``123+0``): a job of its own; a
  pending array (``123_[5-9]``) never ran;
* ``CANCELLED by 1000`` is CANCELLED; ``PREEMPTED``, ``NODE_FAIL`` end a run like any state;
* ``Unknown``/``None`` start: never ran (skipped); ``Unknown`` end: still running at the
  history's end;
* no GPUs in AllocTRES (``gres/gpu=N`` or ``gres/gpu:type=N``) or AllocGRES: a CPU job,
  counted apart.

A malformed line is one :class:`HistoryError` naming its line number.
"""
from __future__ import annotations

import csv
import io
import math
import random
import re
import statistics
from dataclasses import dataclass
from datetime import datetime

from ..errors import InputError
from .synthetic import HOUR, elastic_events, elastic_jobs
from .trace import ClusterSpec, Event, Trace

# our name -> the header names that give it (sacct's, then Helios's)
COLUMNS = {
    "job_id": ("jobid", "job_id"),
    "state": ("state",),
    "submit": ("submit", "submit_time"),
    "start": ("start", "start_time"),
    "end": ("end", "end_time"),
    "nodes": ("nnodes", "node_num"),
    "gpus": ("alloctres", "gpu_num", "allocgres", "reqtres"),
}
REQUIRED = ("job_id", "state", "start", "end")
NEVER = ("", "unknown", "none", "n/a")
_GPUS = re.compile(r"gres/gpu(?::[^=,]+)?=(\d+)|\bgpu(?::[^:,=]+)?[:=](\d+)")
_STEP = re.compile(r"^\d+(?:_\d+|\+\d+)?\.")


class HistoryError(InputError, ValueError):
    """A history that cannot be read: where (file and line) and what."""


@dataclass(frozen=True)
class HistoryJob:
    """One allocation that ran: times in seconds from the history's first submission."""

    job_id: str
    state: str
    submit: float
    start: float
    end: float
    gpus: int
    nodes: int

    @property
    def gpu_hours(self) -> float:
        return self.gpus * (self.end - self.start) / HOUR


@dataclass(frozen=True)
class History:
    """The jobs that ran, and what the reading skipped."""

    jobs: tuple[HistoryJob, ...]
    cpu_jobs: int
    steps_skipped: int
    never_ran: int
    origin: datetime | None

    @property
    def gpu_jobs(self) -> tuple[HistoryJob, ...]:
        return tuple(j for j in self.jobs if j.gpus > 0)


def read_history(text: str, source: str = "history") -> History:
    """Every line of ``text`` (``sacct -P`` or a Helios-layout CSV), as described above."""
    lines = text.splitlines()
    if not lines or not lines[0].strip():
        raise HistoryError(f"{source}: empty: expected sacct -P output with its header line "
                           "(see docs/simulate-history.md)")
    delimiter = "|" if "|" in lines[0] else ","
    rows = list(csv.reader(io.StringIO(text), delimiter=delimiter))
    header = [h.strip().lower() for h in rows[0]]
    where = {name: next((header.index(h) for h in names if h in header), None)
             for name, names in COLUMNS.items()}
    missing = [n for n in REQUIRED if where[n] is None]
    if missing:
        raise HistoryError(f"{source}:1: no {', '.join(missing)} column in the header "
                           f"({', '.join(rows[0][:12])}): run sacct with --format="
                           "JobID,State,Submit,Start,End,NNodes,AllocTRES")
    raw: list[tuple[str, str, datetime | None, datetime, datetime | None, int, int]] = []
    cpu = steps = never = 0
    for lineno, row in enumerate(rows[1:], start=2):
        if not row or not any(c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise HistoryError(f"{source}:{lineno}: {len(row)} fields, the header has "
                               f"{len(header)} (a '{delimiter}' inside a value? run sacct "
                               "with -P)")

        def cell(name: str, row: list[str] = row) -> str:
            i = where[name]
            return row[i].strip() if i is not None else ""

        job_id = cell("job_id")
        if _STEP.match(job_id):
            steps += 1
            continue
        start = _time(cell("start"), source, lineno)
        if start is None or "[" in job_id:
            never += 1
            continue
        gpus = _gpus(cell("gpus"), source, lineno)
        if gpus == 0:
            cpu += 1
            continue
        state = (cell("state").split() or ["UNKNOWN"])[0].upper()
        raw.append((job_id, state, _time(cell("submit"), source, lineno), start,
                    _time(cell("end"), source, lineno), gpus,
                    _count(cell("nodes"), "nodes", source, lineno) or 1))
    if not raw:
        return History((), cpu, steps, never, None)
    origin = min(min(s or st for _, _, s, st, _, _, _ in raw), min(r[3] for r in raw))
    last = max(max((e for *_, e, _, _ in raw if e is not None), default=origin),
               max(r[3] for r in raw))

    def rel(t: datetime) -> float:
        return (t - origin).total_seconds()

    jobs = tuple(HistoryJob(j, state, rel(s or st), rel(st), rel(e or last), g, n)
                 for j, state, s, st, e, g, n in raw)
    return History(jobs, cpu, steps, never, origin)


def _time(text: str, source: str, lineno: int) -> datetime | None:
    if text.lower() in NEVER:
        return None
    if text.isdigit():  # a unix time (Helios' layout may carry them)
        return datetime.fromtimestamp(int(text))
    try:
        return datetime.fromisoformat(text.replace(" ", "T"))
    except ValueError:
        raise HistoryError(f"{source}:{lineno}: {text!r} is not a time (sacct's "
                           "2026-11-30T12:00:00, or Unknown)") from None


def _count(text: str, what: str, source: str, lineno: int) -> int:
    if not text:
        return 0
    if not text.isdigit() or len(text) > 9:
        raise HistoryError(f"{source}:{lineno}: {text!r} is not a number of {what}")
    return int(text)


def _gpus(text: str, source: str, lineno: int) -> int:
    """GPUs of AllocTRES/AllocGRES text, or a plain count (Helios' gpu_num)."""
    if text.isdigit():
        return _count(text, "GPUs", source, lineno)
    found = [int(a or b) for a, b in _GPUS.findall(text)]
    return max(found, default=0)


# -- what happened --------------------------------------------------------------------------

def what_happened(history: History, capacity_gpus: int) -> dict:
    """The history's own figures on a cluster of ``capacity_gpus`` GPUs."""
    jobs = history.gpu_jobs
    span = max((j.end for j in jobs), default=0.0)
    used = sum(j.gpu_hours for j in jobs)
    waits = sorted(j.start - j.submit for j in jobs)
    preempted = [j for j in jobs if j.state in ("PREEMPTED", "REQUEUED")]
    return {
        "jobs": len(jobs), "cpu_jobs": history.cpu_jobs, "steps_skipped": history.steps_skipped,
        "never_ran": history.never_ran, "hours": span / HOUR, "capacity_gpus": capacity_gpus,
        "gpu_hours_used": used,
        "gpu_hours_idle": max(capacity_gpus * span / HOUR - used, 0.0),
        "utilization": used / (capacity_gpus * span / HOUR) if span and capacity_gpus else 0.0,
        "preempted_jobs": len(preempted),
        "preempted_gpu_hours": sum(j.gpu_hours for j in preempted),
        "node_fail_jobs": sum(j.state == "NODE_FAIL" for j in jobs),
        "queue_wait_median_s": statistics.median(waits) if waits else 0.0,
        "queue_wait_p90_s": waits[min(len(waits) - 1, int(0.9 * len(waits)))] if waits else 0.0,
    }


def peak_gpus(history: History) -> int:
    """The most GPUs the history's jobs held at once (a lower bound of the cluster)."""
    edges = sorted([(j.start, j.gpus) for j in history.gpu_jobs]
                   + [(j.end, -j.gpus) for j in history.gpu_jobs], key=lambda e: (e[0], e[1]))
    held = peak = 0
    for _, delta in edges:
        held += delta
        peak = max(peak, held)
    return peak


def history_trace(history: History, cluster: ClusterSpec, elastic: int, seed: int = 0
                  ) -> Trace:
    """The history's GPU jobs as rigid submissions (at their submit time, for their run
    time; whole nodes where they took more than one node's GPUs) on ``cluster``, with
    ``elastic`` elastic jobs beside them (the synthetic trace's mix and rates)."""
    rng = random.Random(seed)
    end = max((j.end for j in history.gpu_jobs), default=HOUR)
    jobs, policies = elastic_jobs(rng, elastic, cluster.nodes)
    events: list[Event] = []
    g = cluster.gpus_per_node
    for j in history.gpu_jobs:
        duration = max(j.end - j.start, 1.0)
        if j.gpus <= g and j.nodes <= 1:
            events.append(Event(j.submit, "submit", job=f"sacct-{j.job_id}", gpus=j.gpus,
                                duration=duration))
        else:
            nodes = min(max(j.nodes, math.ceil(j.gpus / g)), cluster.nodes)
            events.append(Event(j.submit, "submit", job=f"sacct-{j.job_id}", nodes=nodes,
                                duration=duration))
    events += elastic_events(rng, jobs, end)
    events.sort(key=lambda e: e.t)
    return Trace(cluster, jobs, tuple(events), end, policies)

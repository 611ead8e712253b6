"""Elastic jobs as OpenMetrics, for the Prometheus an HPC site already scrapes:
``slurm-etc status --format openmetrics`` (e.g. into node_exporter's textfile collector from
a timer), and a running coordinator's own endpoint (``slurm-etc run --metrics-port``,
:func:`serve`).

Names and units follow Prometheus's conventions, prefixed ``slurm_etc_``; every series has
``job_id`` (the elastic job's id; ``job`` is Prometheus's own target label) and ``owner``
labels. Read from the job's record alone
(:class:`~slurm_etc.store.jobs.JobDetail`), so it is what ``status`` shows:

* ``slurm_etc_job`` (info: state, backend, model, layout), ``slurm_etc_job_generation``,
  ``slurm_etc_job_world_size``, ``slurm_etc_job_devices{state}``;
* ``slurm_etc_job_steps`` (the newest step heard), ``slurm_etc_job_steps_per_second`` (the
  current generation's);
* ``slurm_etc_resizes_total{outcome}``; ``slurm_etc_resize_pause_seconds`` and
  ``slurm_etc_resize_stall_seconds`` (histograms over committed resizes);
* ``slurm_etc_migrated_bytes_total`` and ``slurm_etc_migration_lower_bound_bytes_total``
  (committed resizes), ``slurm_etc_lost_steps_total`` (trained again after a loss).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from slurm_etc.store.jobs import JobDetail

LABELS = ["job_id", "owner"]  # not "job": Prometheus names its scrape job so
# a resize's pause: tens of ms on the real paths, seconds for a loss or a cold start
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def openmetrics(jobs: Sequence[JobDetail], now: datetime) -> str:
    """``jobs`` in the OpenMetrics text format (ends with ``# EOF``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Jobs(lambda: jobs, lambda: now))
    return generate_latest(registry).decode()


def serve(read: Callable[[], Sequence[JobDetail]], bind: str, port: int) -> Any:
    """An HTTP endpoint (``/metrics``, on ``bind``:``port``; port 0: any free one) that
    reads the jobs anew at every scrape; its server has ``server_port`` and ``shutdown``."""
    from prometheus_client.exposition import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Jobs(read, lambda: datetime.now(timezone.utc)))
    server, _thread = start_http_server(port, addr=bind, registry=registry)
    return server


class _Jobs(Collector):
    def __init__(self, read: Callable[[], Sequence[JobDetail]],
                 clock: Callable[[], datetime]) -> None:
        self.read, self.clock = read, clock

    def collect(self) -> Iterator[Metric]:
        jobs, now = self.read(), self.clock()
        info = InfoMetricFamily("slurm_etc_job", "An elastic job: its state and layout.",
                                labels=LABELS)
        generation = GaugeMetricFamily("slurm_etc_job_generation",
                                       "The job's current generation.", labels=LABELS)
        world = GaugeMetricFamily("slurm_etc_job_world_size",
                                  "Devices in the current layout.", labels=LABELS)
        devices = GaugeMetricFamily("slurm_etc_job_devices",
                                    "Devices the job's record lists, by state.",
                                    labels=[*LABELS, "state"])
        steps = GaugeMetricFamily("slurm_etc_job_steps", "The newest training step heard.",
                                  labels=LABELS)
        rate = GaugeMetricFamily("slurm_etc_job_steps_per_second",
                                 "Training steps per second in the current generation.",
                                 labels=LABELS)
        resizes = CounterMetricFamily("slurm_etc_resizes", "Resizes by outcome.",
                                      labels=[*LABELS, "outcome"])
        moved = CounterMetricFamily("slurm_etc_migrated_bytes",
                                    "Bytes committed resizes moved between devices.",
                                    labels=LABELS, unit="bytes")
        bound = CounterMetricFamily("slurm_etc_migration_lower_bound_bytes",
                                    "The byte lower bound of the committed resizes.",
                                    labels=LABELS, unit="bytes")
        lost = CounterMetricFamily("slurm_etc_lost_steps",
                                   "Steps trained again after devices were lost.",
                                   labels=LABELS)
        pause = HistogramMetricFamily("slurm_etc_resize_pause_seconds",
                                      "Training paused by a committed resize.",
                                      labels=LABELS, unit="seconds")
        stall = HistogramMetricFamily("slurm_etc_resize_stall_seconds",
                                      "Training stopped before a committed resize's pause "
                                      "(its new world built at a step boundary).",
                                      labels=LABELS, unit="seconds")
        for d in jobs:
            key = [d.job.job_id, d.job.owner_name]
            info.add_metric(key, {"state": d.job.shown_state(now), "backend": d.job.backend,
                                  "model": d.job.model or "", "layout": d.job.layout or ""})
            generation.add_metric(key, float(d.job.generation or 0))
            world.add_metric(key, float(d.job.world_size))
            for state, n in sorted(Counter(dev.state for dev in d.devices).items()):
                devices.add_metric([*key, state], float(n))
            last = [g.last_step for g in d.generations if g.last_step is not None]
            steps.add_metric(key, float(max(last, default=0)))
            rate.add_metric(key, _rate(d, now))
            outcomes = Counter(m.outcome or "in-flight" for m in d.migrations)
            for outcome, n in sorted(outcomes.items()):
                resizes.add_metric([*key, outcome], float(n))
            done = [m for m in d.migrations if m.outcome == "committed"]
            moved.add_metric(key, float(sum(m.moved_bytes for m in done)))
            bound.add_metric(key, float(sum(m.lower_bound_bytes for m in done)))
            lost.add_metric(key, float(sum(b - a + 1 for m in done if m.lost_steps
                                           for a, b in [m.lost_steps])))
            _histogram(pause, key, [m.pause_seconds for m in done])
            _histogram(stall, key, [m.stall_seconds for m in done])
        yield from (info, generation, world, devices, steps, rate, resizes, moved, bound, lost,
                    pause, stall)


def _rate(d: JobDetail, now: datetime) -> float:
    current = [g for g in d.generations if g.number == d.job.generation]
    if not current:
        return 0.0
    g = current[-1]
    seconds = g.duration_seconds(now)
    return g.steps / seconds if seconds > 0 else 0.0


def _histogram(family: HistogramMetricFamily, key: list[str],
               values: Iterable[float | None]) -> None:
    seen = sorted(v for v in values if v is not None)
    buckets = [(repr(le), float(sum(v <= le for v in seen))) for le in PAUSE_BUCKETS]
    family.add_metric(key, [*buckets, ("+Inf", float(len(seen)))], sum_value=float(sum(seen)))

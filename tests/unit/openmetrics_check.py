"""Reads `slurm-etc status --format openmetrics` with prometheus_client's own OpenMetrics
parser (it shares no code with the exporter but the library's text format)."""
from __future__ import annotations

from prometheus_client.openmetrics.parser import text_string_to_metric_families


def families(text: str) -> dict[str, object]:
    """Every metric family by name; the parser raises on anything not OpenMetrics."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def pause_histogram(text: str, job: str) -> dict[str, float]:
    """The pause histogram of ``job``: its ``count``, ``sum`` and cumulative buckets."""
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "slurm_etc_resize_pause_seconds"]
    out: dict[str, float] = {}
    buckets = {}
    for s in family.samples:
        if s.labels.get("job_id") != job:
            continue
        if s.name.endswith("_count"):
            out["count"] = s.value
        elif s.name.endswith("_sum"):
            out["sum"] = s.value
        elif s.name.endswith("_bucket"):
            buckets[float(s.labels["le"])] = s.value
    out.update({f"le_{k:g}": v for k, v in sorted(buckets.items())})
    return out

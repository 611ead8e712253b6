"""Named device figures for the chooser (``slurm-etc run --hardware``), and the same figures
from a mapping (a user's JSON file). Pure: the caller reads the file.

The figures only rank layouts against each other (see alloc/chooser.py); they decide, e.g.,
whether a small model is worth spreading over more devices at all.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Mapping

from ..plan.errors import ConfigError
from .chooser import Hardware

PROFILES: dict[str, Hardware] = {
    # An H100-class node (the chooser's defaults): 80 GiB, NVLink, one NIC per GPU.
    "h100": Hardware(),
    # CPU processes standing in for devices (tests, the demo, laptops): a few GiB each and so
    # little compute that even a tiny model gains from every extra "device".
    "cpu": Hardware(memory_gib=2.0, tflops=0.01, intra_node_gbps=10.0, inter_node_gbps=5.0,
                    reserved_gib=0.5),
}

FIELDS = tuple(f.name for f in fields(Hardware) if f.name != "gpus_per_node")


def hardware_from(figures: Mapping[str, Any], what: str = "hardware file") -> Hardware:
    """Hardware from ``{"base": <profile>, <field>: <number>...}`` (fields not given: the
    base profile's, default h100). ``gpus_per_node`` is the cluster's, never the file's."""
    if not isinstance(figures, Mapping):
        raise ConfigError(f"{what}: expected a JSON object of device figures "
                          f"({', '.join(FIELDS)}; optional \"base\": a profile)")
    base_name = figures.get("base", "h100")
    if base_name not in PROFILES:
        raise ConfigError(f"{what}: base {base_name!r} is not a profile "
                          f"(one of {', '.join(PROFILES)})")
    unknown = sorted(set(figures) - set(FIELDS) - {"base"})
    if unknown:
        raise ConfigError(f"{what}: unknown field(s) {', '.join(map(repr, unknown))} "
                          f"(known: base, {', '.join(FIELDS)})")
    values: dict[str, Any] = {}
    for name in FIELDS:
        if name not in figures:
            continue
        v = figures[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 \
                or v == float("inf") or (v == 0 and name != "reserved_gib"):
            raise ConfigError(f"{what}: {name} must be a positive number, not {v!r}")
        values[name] = float(v)
    hw = replace(PROFILES[base_name], **values)
    if hw.reserved_gib >= hw.memory_gib:
        raise ConfigError(f"{what}: reserved_gib ({hw.reserved_gib:g}) must be below "
                          f"memory_gib ({hw.memory_gib:g})")
    return hw

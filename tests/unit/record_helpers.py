"""Helpers for tests that fill a job's record by hand (`slurm-etc status` tests)."""
from __future__ import annotations

from slurm_etc.alloc.topology import Device


def two_per_node(n: int) -> dict[int, Device]:
    """vranks 0..n-1 on nodes n001, n002, ... of two devices each."""
    return {v: Device(f"n{v // 2 + 1:03d}", v % 2) for v in range(n)}

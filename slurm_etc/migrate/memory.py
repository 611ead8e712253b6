"""Peak memory of a process during a migration.

CPU: the kernel's resident-set high-water mark (``VmHWM``), reset at the start by writing 5
to ``/proc/self/clear_refs`` (Linux >= 4.0), so the peak belongs to this migration and not
to whatever the process did before; tensors are invisible to tracemalloc, RSS sees them.
CUDA: the caching allocator's ``max_memory_allocated`` after ``reset_peak_memory_stats``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class PeakMemory:
    """Measures the growth of memory over a region of code (see module docstring).

    ``peak_delta`` is peak minus the value at :meth:`start` (RSS on CPU, allocated bytes on
    CUDA); ``reset`` says whether the CPU high-water mark could be reset (if not, the peak
    may predate the region and is an upper bound).
    """

    device: torch.device
    base: int | None = None
    peak: int | None = None
    reset: bool = False

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self.reset = True
        else:
            self.reset = reset_peak_rss()
            self.base = rss_bytes()

    def stop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak = peak_rss_bytes()

    @property
    def peak_delta(self) -> int | None:
        if self.base is None or self.peak is None:
            return None
        return self.peak - self.base

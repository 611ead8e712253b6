"""Where the runtime creates tensors: a check that runs on the CPU and says what a GPU run
would get wrong.

On a GPU every tensor the runtime makes must be on the worker's device or, on purpose, in
host memory (votes, values off the wire, peer copies). A factory call with no ``device``
lands on the CPU whatever the worker drives: on a CPU run nothing shows it, on a GPU the
first operation that mixes it with the model fails, or a transfer silently goes through
host memory. :class:`CreationRecorder` is a ``TorchFunctionMode`` that records every
tensor factory called from the runtime's own files (``slurm_etc/`` less the test and
harness packages) without an explicit ``device``, or with a device that is neither the
configured one nor the host. Modes are per thread: :func:`recording` installs the recorder
in every thread started while it is active too (the trainer prepares a resize in one). The
executor and the shard adapter turn torch function modes off for speed
(``torch._C.DisableTorchFunction``); while recording, that switch is a no-op, so their
creations are seen too.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

PACKAGE = Path(__file__).resolve().parents[1]
# test machinery and the harness (bench, verify) are not the runtime; megatron's CPU
# compatibility mode runs on the CPU only (it refuses to install where CUDA is) and forwards
# megatron's own calls, which are megatron's
NOT_RUNTIME = ("testing", "harness")
CPU_ONLY = ("megatron/cpu_compat.py",)
FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.arange,
                       torch.tensor, torch.rand, torch.randn, torch.randint, torch.empty_strided,
                       torch.linspace, torch.eye, torch.as_tensor})


def runtime_file(filename: str) -> str | None:
    """``filename`` relative to the package where it is a runtime module, else None."""
    try:
        rel = Path(filename).resolve().relative_to(PACKAGE)
    except ValueError:
        return None
    return None if rel.parts[0] in NOT_RUNTIME or str(rel) in CPU_ONLY else str(rel)


@dataclass
class CreationRecorder(TorchFunctionMode):
    """Records (``found``) each runtime factory call without a device or on a device other
    than ``expect`` and the host; ``seen`` counts the runtime calls checked."""

    expect: torch.device
    found: list[str] = field(default_factory=list)
    seen: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES:
            caller = sys._getframe(1)
            where = runtime_file(caller.f_code.co_filename)
            if where is not None:
                self._check(func, kwargs.get("device"), f"{where}:{caller.f_lineno}")
        return func(*args, **kwargs)

    def _check(self, func: Any, device: Any, where: str) -> None:
        what = None
        if device is None:
            what = f"{where}: torch.{func.__name__} without a device"
        elif torch.device(device) not in (self.expect, torch.device("cpu")):
            what = f"{where}: torch.{func.__name__} on {device}, the worker's is {self.expect}"
        with self._lock:
            self.seen += 1
            if what is not None and what not in self.found:
                self.found.append(what)


@contextlib.contextmanager
def recording(expect: torch.device | str = "cpu") -> Iterator[CreationRecorder]:
    """Record the runtime's tensor creations in this thread and every thread started
    inside (see the module docstring)."""
    recorder = CreationRecorder(torch.device(expect))
    run = threading.Thread.run

    def run_recorded(thread: threading.Thread) -> None:
        with recorder:
            run(thread)

    disable = torch._C.DisableTorchFunction
    setattr(threading.Thread, "run", run_recorded)  # noqa: B010 - a class attribute, typed
    setattr(torch._C, "DisableTorchFunction", contextlib.nullcontext)  # noqa: B010
    try:
        with recorder:
            yield recorder
    finally:
        setattr(threading.Thread, "run", run)  # noqa: B010
        setattr(torch._C, "DisableTorchFunction", disable)  # noqa: B010

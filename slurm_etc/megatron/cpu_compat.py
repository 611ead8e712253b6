"""Run megatron-core on CPU under gloo: the few CUDA assumptions it makes, patched away.

megatron-core 0.16.1 builds ``GPTModel`` on CPU with ``use_cpu_initialization=True``, but its
forward pass, pipeline schedules, ``DistributedDataParallel``, ``DistributedOptimizer`` and
``dist_checkpointing.save`` call CUDA directly. This module is the only place in slurm-etc that
papers over that, and only for CPU runs (tests, benchmarks, demos without GPUs). Never install it
in a process that trains on GPUs: it would silently move "cuda" tensors to the CPU.

Each patch and why it is needed:

* ``torch.cuda.current_device()`` returns ``"cpu"``: megatron passes it as ``device=`` when it
  allocates the global memory buffer, rotary embeddings, DDP's grad buffers and the
  distributed optimizer's buffers.
* ``torch.cuda.synchronize()`` is a no-op: called around collectives, timers and by
  ``dist_checkpointing.save``; on a CPU-only torch it raises.
* ``CudaRNGStatesTracker.fork()`` is a null context: attention and dropout regions fork the
  CUDA RNG state, which does not exist on CPU. Dropout is off in our configs, so no random
  numbers are drawn inside those regions.
* A ``TorchFunctionMode`` (:class:`CudaToCpuMode`) that
  - rewrites ``device="cuda"`` (or ``torch.device("cuda", i)``) arguments of tensor factories
    and ``Tensor.to`` to ``"cpu"``: the pipeline schedules, the loss/grad-norm helpers and
    the distributed optimizer create tensors with ``device="cuda"``;
  - makes ``Tensor.cuda()`` return the tensor itself: the embedding all-reduce and the
    optimizer's grad-norm code call it;
  - makes ``Tensor.type()`` (no argument) report ``torch.cuda.<Type>Tensor``: the mixed
    precision and distributed optimizers classify parameters by comparing that string with
    ``'torch.cuda.FloatTensor'`` / ``'torch.cuda.BFloat16Tensor'`` and reject anything else.

Usage: ``cpu_compat.install()`` once at process start (worker processes of CPU runs),
undone by ``cpu_compat.uninstall()``.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    return False


def _to_cpu(value: Any) -> Any:
    return _CPU if _is_cuda(value) else value


class CudaToCpuMode(TorchFunctionMode):
    """Redirect CUDA device requests to the CPU and let CPU tensors pass CUDA type checks.

    Integer ``device=`` arguments are left alone: on a CPU-only torch ``current_device()`` is
    patched to return ``"cpu"``, so megatron does not produce device indices here.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and "dtype" not in kwargs:
            return func(*args, **kwargs).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _Patches:
    """The installed state: originals to restore and the active function mode."""

    def __init__(self) -> None:
        from megatron.core.tensor_parallel import random as mcore_random

        self._random = mcore_random
        self._originals = {
            "current_device": torch.cuda.current_device,
            "synchronize": torch.cuda.synchronize,
            "fork": mcore_random.CudaRNGStatesTracker.fork,
        }
        self._mode = CudaToCpuMode()

    def apply(self) -> None:
        # megatron passes the result as device=: "cpu" is what makes its buffers CPU ones
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
        torch.cuda.synchronize = lambda device=None: None
        self._random.CudaRNGStatesTracker.fork = _null_fork
        self._mode.__enter__()

    def revert(self) -> None:
        self._mode.__exit__(None, None, None)
        torch.cuda.current_device = self._originals["current_device"]
        torch.cuda.synchronize = self._originals["synchronize"]
        self._random.CudaRNGStatesTracker.fork = self._originals["fork"]


def _null_fork(self, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager:
    """``CudaRNGStatesTracker.fork`` on CPU: no CUDA RNG state to swap in."""
    return contextlib.nullcontext()


_installed: _Patches | None = None


def install() -> None:
    """Apply the CPU patches in this process (idempotent).

    The function mode is entered on the calling thread; call this from the thread that runs
    megatron (the main thread of a worker process).

    Raises:
        RuntimeError: CUDA is available: these patches are for CPU-only runs.
    """
    global _installed
    if _installed is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("slurm_etc.megatron.cpu_compat is for CPU runs only, but CUDA is "
                           "available: run megatron-core on the GPUs without these patches")
    patches = _Patches()
    patches.apply()
    _installed = patches
    logger.info("megatron-core CPU compatibility patches installed")


def uninstall() -> None:
    """Undo :func:`install` (no-op if not installed)."""
    global _installed
    if _installed is None:
        return
    _installed.revert()
    _installed = None
    logger.info("megatron-core CPU compatibility patches removed")


def installed() -> bool:
    """Whether the CPU patches are active in this process."""
    return _installed is not None

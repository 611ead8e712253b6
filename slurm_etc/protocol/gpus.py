"""Which GPU a worker process drives: one per worker, chosen by its launcher.

Slurm's task wrapper and the local backend give each worker one GPU through
``CUDA_VISIBLE_DEVICES`` (the worker's ``cuda:0`` is then its own: NCCL refuses two ranks on
one GPU). Imports nothing of the package: the task wrapper of every Slurm step reads it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

VISIBLE_GPUS: Final = "CUDA_VISIBLE_DEVICES"
# present on a node with NVIDIA's driver loaded (whether or not this process sees a GPU)
NVIDIA_CONTROL: Final = "/dev/nvidiactl"


def one_gpu(visible: str | None, local: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of the worker on local device ``local``: entry ``local``
    of the node's list (``"0,1"``, ``"2,3"``: what Slurm gave the step), or ``local`` itself
    where none is set.

    Raises:
        ValueError: ``local`` is past the end of the node's list.
    """
    entries = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if not entries:
        return str(local)
    if local >= len(entries):
        raise ValueError(f"device {local} is not among this node's GPUs "
                         f"({VISIBLE_GPUS}={visible})")
    return entries[local]


def gpu_env(environ: Mapping[str, str], local: int, *, gpus: bool) -> dict[str, str]:
    """What a launcher adds to the environment of the worker on local device ``local``: its
    one GPU (:func:`one_gpu`) where the node has GPUs (``gpus``), nothing on a CPU node (the
    worker's environment stays as it was, which keeps preloaded forks possible there)."""
    return {VISIBLE_GPUS: one_gpu(environ.get(VISIBLE_GPUS), local)} if gpus else {}


def gpus_present(control: str = NVIDIA_CONTROL) -> bool:
    """Whether this node has NVIDIA GPUs (their driver's control device exists)."""
    return os.path.exists(control)

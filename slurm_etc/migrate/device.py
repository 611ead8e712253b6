"""Where a worker computes: its device, the backends of its process groups, and whether a
resize's new state fits beside the old one.

One worker process drives one device (``vrank`` = one GPU). On a GPU node that is the first
GPU it sees: Slurm narrows ``CUDA_VISIBLE_DEVICES`` per task (``--gpus-per-task=1``) and the
local backend and the test pool narrow it per worker the same way; where several are visible
anyway, ``LOCAL_RANK`` (then ``SLURM_LOCALID``) picks one. Without CUDA it is the CPU, and
nothing of the CPU path changes.

Backends (PyTorch's backend table: gloo has no GPU send/recv or all_gather):

* the training world (torch's default group and megatron's groups, which inherit it):
  ``"cpu:gloo,cuda:nccl"`` on a GPU, so CUDA tensors go over NCCL and host scalars (the
  step's loss, the agreement) over gloo; plain ``"gloo"`` on the CPU. NCCL communicators are
  created lazily at their first collective: no ``device_id`` is given, since with it later
  ``new_group`` calls split the old world's communicator, which joiners are not in.
* a migration's data group: NCCL on a GPU (:func:`data_backend`), gloo on the CPU; its votes
  always go over a gloo control group.

A dead peer must not take the survivors down: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``
(CleanUpOnly: the watchdog aborts the communicator of a timed-out collective and the waiting
rank gets an error, the process lives) unless the user set it; torch's default (3) kills the
process at the watchdog timeout.
"""
from __future__ import annotations

import os
from collections.abc import Collection, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from slurm_etc.migrate import connections
from slurm_etc.plan.errors import ConfigError

# torch's ProcessGroupNCCL reads it when a communicator is created: set before any
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_CLEANUP_ONLY = "2"
# torch's ProcessGroupGloo (torch >= 2.8) connects a pair of ranks at its first collective
# instead of every pair when the group starts: n(n+1) store requests a group otherwise
# (docs/rendezvous.md). On a GPU the world's gloo half carries nothing per step (the step's
# loss and gate go over NCCL), so it costs each rank one address written at the start.
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


@dataclass(frozen=True)
class Compute:
    """One worker's device and what its process groups run on."""

    device: torch.device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def world_backend(self) -> str:
        """The training world's backend string (default group, megatron's groups)."""
        return "cpu:gloo,cuda:nccl" if self.cuda else "gloo"

    @property
    def data_backend(self) -> str:
        """A migration's data group: where the state moves."""
        return "nccl" if self.cuda else "gloo"

    def __str__(self) -> str:
        return f"{self.device} ({self.world_backend})"


CPU = Compute(torch.device("cpu"))
_current: Compute = CPU


def current() -> Compute:
    """This process's compute (:func:`use` sets it; the CPU until then)."""
    return _current


def select(env: Mapping[str, str] | None = None, *, cuda: bool | None = None) -> Compute:
    """The device this worker drives (see the module docstring).

    Args:
        env: the environment (default ``os.environ``).
        cuda: whether CUDA is usable (default: ``torch.cuda.is_available()``).

    Raises:
        ConfigError: ``LOCAL_RANK``/``SLURM_LOCALID`` names a GPU this process does not see.
    """
    env = os.environ if env is None else env
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return CPU
    count = torch.cuda.device_count() if cuda is None else _visible_count(env)
    index = 0
    if count > 1:
        local = env.get("LOCAL_RANK") or env.get("SLURM_LOCALID") or "0"
        if not local.isdigit() or int(local) >= count:
            raise ConfigError(f"this worker sees {count} GPUs and LOCAL_RANK/SLURM_LOCALID is "
                              f"{local!r}: it must be one of 0-{count - 1} (or give each worker "
                              "one GPU: srun --gpus-per-task=1)")
        index = int(local)
    return Compute(torch.device("cuda", index))


def _visible_count(env: Mapping[str, str]) -> int:
    visible = env.get("CUDA_VISIBLE_DEVICES", "0")
    return len([d for d in visible.split(",") if d.strip()]) or 1


def use(compute: Compute, env: dict[str, str] | None = None) -> Compute:
    """Make ``compute`` this process's: set the current CUDA device and, on a GPU, NCCL's
    error handling and gloo's lazy start (``env``: default ``os.environ``; a value the user
    set stays)."""
    global _current
    if compute.cuda:
        torch.cuda.set_device(compute.device)
        into: MutableMapping[str, str] = os.environ if env is None else env
        into.setdefault(NCCL_ERROR_HANDLING, NCCL_CLEANUP_ONLY)
        into.setdefault(GLOO_LAZY_INIT, "1")
    _current = compute
    return compute


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or dicts, lists and tuples of them) with its tensors on
    ``device``; anything else as it is. A batch already there is not copied."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


# -- will the new state fit ---------------------------------------------------------------

@dataclass(frozen=True)
class MemoryNeed:
    """What a resize allocates on one device before its old state is released (bytes).

    Attributes:
        destinations: the new shards this process receives or builds (parameters, fp32
            main parameters, Adam moments; shards kept whole cost nothing).
        grads: the new layout's gradient buffers (DDP allocates them with the model).
        staging: the executor's send and receive staging buffers.
        free: what the device has free now (the allocator's cached but unused bytes
            included).
    """

    destinations: int
    grads: int
    staging: int
    free: int

    @property
    def total(self) -> int:
        return self.destinations + self.grads + self.staging


class DeviceMemoryError(ConfigError):
    """The new state and staging of a resize do not fit beside the old state."""


def check_fits(need: MemoryNeed, device: str) -> None:
    """Refuse, in one line and before anything is allocated, a resize whose new state and
    staging exceed what ``device`` has free beside the old state.

    Raises:
        DeviceMemoryError: ``need.total > need.free``, with the parts and the fix.
    """
    if need.total <= need.free:
        return
    raise DeviceMemoryError(
        f"the resize needs {_gib(need.total)} on {device} beside the old state "
        f"(new shards {_gib(need.destinations)} + gradient buffers {_gib(need.grads)} + "
        f"staging {_gib(need.staging)}) and {_gib(need.free)} is free: choose a layout with "
        "more devices, the distributed optimizer, or a smaller --staging-mib")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def free_bytes(device: torch.device) -> int | None:
    """Bytes free on ``device`` for new tensors (CUDA: the driver's free memory plus what
    torch's caching allocator holds unused); None on the CPU (host memory is not checked:
    the page cache and other processes make 'free' meaningless there)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + int(cached)


# -- releasing groups ---------------------------------------------------------------------

def end_world() -> None:
    """Release every process group of this process, the default one included: on a GPU
    all aborted together (``_abort_process_group``: every NCCL communicator in one group
    call, pytorch #119797; a destroy finalizes and waits for work a dead peer never
    completes, pytorch PR #141510), on the CPU destroyed as before."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    if current().cuda:
        c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def end_group(group: Any) -> None:
    """Release one group that torch no longer lists (retired at a switch): aborted on a GPU
    (a local call that never waits for peers, some of which may have exited: NCCL #863),
    shut down on the CPU."""
    if current().cuda:
        group.abort()
    else:
        group.shutdown()


def leave_groups(keep: Any = (), *, base: Collection[int] = (),
                 spare_ports: Collection[int] = (), keep_sockets: Collection[int] = ()) -> int:
    """Close the connections of every process group this process has registered (but
    ``keep``: a new world prepared beside them), leaving them registered: a peer blocked on
    this process in a collective fails at once instead of at the group's timeout, while
    ranks and sizes can still be asked (``dist.get_rank(group)``). NCCL's are aborted (never
    destroyed: that waits for the dead); gloo, which has no abort, gets its TCP connections
    shut down (:mod:`~slurm_etc.migrate.connections`: those opened since ``base``, less the
    coordinator's ``spare_ports`` and the kept world's ``keep_sockets``). How many groups
    (NCCL) or connections (gloo) were closed."""
    if not current().cuda:
        return connections.close_group_connections(base, spare_ports=spare_ports,
                                                    keep=keep_sockets)
    from torch.distributed import distributed_c10d as c10d

    kept = {id(g) for g in keep}
    closed = 0
    for group in list(c10d._world.pg_map):
        if id(group) in kept:
            continue
        try:
            group.abort()
        except RuntimeError:  # already closed, or a backend without the call
            continue
        closed += 1
    return closed

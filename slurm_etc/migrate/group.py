"""The migration group: every process of the old and the new layout, for one resize.

Its rank of a process is the position of the process's device in ``plan.participants``
(``sorted(old devices ∪ new devices)`` minus the devices the plan lists as lost: dead
processes take no part). Processes that join hold nothing before; processes that leave take
part until the commit vote and exit afterwards. Two process groups span it: the data group
(gloo on CPU, NCCL on GPU) that carries the state, and a gloo control group for the votes
(gloo closes a pair's connection when a wait on it times out; votes must survive that to
report it).

Two ways to build it:

* :func:`new_migration_group`: inside an existing default process group that contains every
  participant (a job-wide group, or a test pool): a collective over the default group.
* :func:`connect_migration_group`: from a rendezvous store (the coordinator's), when the
  participants share no group: two gloo backends of their own, outside the default group,
  so old ranks connect it while their training still owns the default group (and the new
  layout's default group can start before the state moves).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from .device import Compute, current
from .program import group_devices
from .transport import BackendTransport, TorchTransport

if TYPE_CHECKING:
    from slurm_etc.plan.plan import MigrationPlan

DEFAULT_GROUP_TIMEOUT_S = 300.0


@dataclass
class MigrationGroup:
    """Process groups over the plan's participants, seen from one process.

    Attributes:
        devices: the participants (old ∪ new minus lost), sorted (migration rank =
            position).
        device: this process's device.
        members: global rank (default group) of each migration rank (None: the groups are
            backends of their own, see :func:`connect_migration_group`).
        data: process group carrying the state.
        control: gloo process group carrying the votes.
    """

    devices: tuple[int, ...]
    device: int
    members: tuple[int, ...] | None
    data: object
    control: object
    accelerator: torch.device = torch.device("cpu")  # where the data group moves tensors
    warm: bool = False

    @property
    def rank(self) -> int:
        return self.devices.index(self.device)

    def transport(self, device: torch.device | str | None = None
                  ) -> TorchTransport | BackendTransport:
        """The executor's transport over these groups (staging on ``device``; default: CPU
        for gloo, the current CUDA device for NCCL)."""
        if self.members is None:
            return BackendTransport(self.data, self.control, self.accelerator)
        return TorchTransport(self.data, self.control, self.members, self.rank, device)

    def warm_up(self) -> None:
        """On NCCL, create the data group's communicator with one all-reduce over every
        participant, so the executor's batched rounds may involve only some ranks (NCCL:
        the first point-to-point call of a group must involve all its ranks otherwise).
        Collective, on the thread that launches the device's work (NCCL needs the same order
        of communicator creation and launches on every rank: never a preparation thread);
        once. Nothing on gloo."""
        if self.warm or self.accelerator.type != "cuda" or self.members is not None:
            self.warm = True
            return
        self.data.allreduce([torch.zeros(1, device=self.accelerator)]).wait()  # type: ignore[attr-defined]
        self.warm = True

    def abort(self) -> None:
        """Give the groups up after a failure: an NCCL communicator is aborted (never
        destroyed: a destroy waits for work that a dead peer never completes), gloo's are
        released as :meth:`destroy` does."""
        if self.accelerator.type == "cuda" and self.data is not None and self.members is None:
            self.data.abort()  # type: ignore[attr-defined]
        self.destroy()

    def destroy(self) -> None:
        """Release both groups (after a transport failure they must not be reused)."""
        import torch.distributed as dist

        if self.members is None:
            self.data = self.control = None  # backends of their own: closed when dropped
            return
        for pg in {id(self.data): self.data, id(self.control): self.control}.values():
            if isinstance(pg, dist.ProcessGroup) and pg is not dist.GroupMember.WORLD:
                dist.destroy_process_group(pg)


def _members(devices, rank_of_device) -> list[int]:
    if rank_of_device is None:
        return list(devices)
    if callable(rank_of_device):
        return [int(rank_of_device(d)) for d in devices]
    return [int(rank_of_device[d]) for d in devices]


def new_migration_group(plan: MigrationPlan, device: int | None, *,
                        rank_of_device: Mapping[int, int] | Callable[[int], int] | None = None,
                        backend: str | None = None,
                        timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> MigrationGroup | None:
    """Create the migration group of ``plan`` inside the current default process group.

    Collective: every process of the default group must call it, in the same order as its
    other ``new_group`` calls, with the same plan. Processes whose device takes no part in
    the migration (``device`` None or not in ``plan.participants``) get None. A plan with
    lost devices is the exception: the dead processes cannot call anything, so only the
    participants build the groups (``use_local_synchronization``); any other process may
    call it and gets None at once.

    Args:
        plan: the MigrationPlan.
        device: this process's device id.
        rank_of_device: default-group rank of each device (default: the device id itself).
        backend: data group backend (default: the default group's backend).
        timeout_s: default timeout of both groups' collectives.
    """
    import torch.distributed as dist

    devices = group_devices(plan)
    members = _members(devices, rank_of_device)
    timeout = timedelta(seconds=timeout_s)
    if plan.lost:
        if device is None or device not in devices:
            return None
        data = dist.new_group(members, timeout=timeout, backend=backend,
                              use_local_synchronization=True)
        control = dist.new_group(members, timeout=timeout, backend="gloo",
                                 use_local_synchronization=True)
        _warm_up(data)
        return MigrationGroup(devices, device, tuple(members), data, control)
    data = dist.new_group(members, timeout=timeout, backend=backend)
    control = dist.new_group(members, timeout=timeout, backend="gloo")
    if device is None or device not in devices:
        return None
    _warm_up(data)
    return MigrationGroup(devices, device, tuple(members), data, control)


def _warm_up(data) -> None:
    """NCCL: the first batch_isend_irecv on a group must involve every rank of it, and the
    executor's first step may not; one all_reduce over the group creates the communicator."""
    import torch.distributed as dist

    if str(dist.get_backend(data)) == "nccl":
        dist.all_reduce(torch.zeros(1, device=current().device), group=data)


def connect_migration_group(plan: MigrationPlan, device: int, store, *,
                            timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                            compute: Compute | None = None) -> MigrationGroup:
    """Connect the migration group of ``plan`` from a rendezvous ``store``.

    Every participant (``plan.participants``: old ∪ new minus lost devices) calls it
    (collective; it returns when all have connected); its rank is the position of
    ``device`` among them. Lost devices do not call it. The groups are backends of their
    own: the default process group, if any, is neither needed nor touched, so a running job
    connects while it trains and keeps its training groups until the pause. The control
    group is gloo; the data group gloo on the CPU, NCCL on a GPU (``compute``: default this
    process's, :func:`.device.current`), its communicator created lazily by
    :meth:`MigrationGroup.warm_up` (this may run on a preparation thread: it launches
    nothing on the device).
    """
    import torch.distributed as dist

    compute = compute or current()
    devices = group_devices(plan)
    if device not in devices:
        raise ValueError(f"device {device} takes no part in this migration (devices {devices})")
    rank = devices.index(device)
    timeout = timedelta(seconds=timeout_s)
    data_store = dist.PrefixStore("data", store)
    data = (_nccl_group(data_store, rank, len(devices), timeout, compute.device)
            if compute.cuda else
            dist.ProcessGroupGloo(data_store, rank, len(devices), timeout))
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, len(devices),
                                    timeout)
    return MigrationGroup(devices, device, None, data, control, compute.device)


def _nccl_group(store, rank: int, size: int, timeout: timedelta, device: torch.device):
    """A ``ProcessGroup`` over an NCCL backend of its own (registered nowhere in torch): the
    wrapper gives the coalesced group calls (``_start_coalescing``) batched rounds need."""
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    backend = dist.ProcessGroupNCCL(store, rank, size, options)
    group = dist.ProcessGroup(store, rank, size)
    nccl = dist.ProcessGroup.BackendType.NCCL
    group._set_default_backend(nccl)
    group._register_backend(device, nccl, backend)
    return group

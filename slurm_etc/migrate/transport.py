"""Transport seam of the executor: point-to-point exchanges plus a small control allgather.

The executor only needs three things from a transport, all in migration-group ranks
(position of a process's device in ``plan.participants``: the sorted union of old and new
devices, minus lost ones):

* ``exchange(sends, recvs, tag)``: post one step's sends and receives at once (at most one of
  each per rank and step in a migration) and get one :class:`Pending` per op, sends first;
* ``Pending.wait(timeout_s)``: bounded wait, raising :class:`TransportError` with the cause;
* ``allgather(payload, timeout_s)``: the fixed-size vote every rank casts between steps;
  ``start_allgather(payload)`` posts it and returns a :class:`PendingGather` to wait on later,
  so a vote can travel while the step's data does.

Implementations:

* :class:`TorchTransport`: torch.distributed. Data moves with ``batch_isend_irecv`` on the
  data group (gloo on CPU, NCCL on GPU); votes go over a separate gloo control group,
  because gloo closes a pair's connection when a wait on it times out, which would otherwise
  take the vote that reports the timeout down with it. Tensors passed to ``exchange`` must be
  contiguous (gloo cannot receive into non-contiguous views); the executor stages through
  contiguous buffers from :meth:`TorchTransport.empty`.
* :class:`BackendTransport`: the same over gloo backend objects that belong to no default
  group (``ProcessGroupGloo`` built straight from a store): the migration group a resize
  prepares while the training still owns the default group.
* :class:`ThreadTransport`: ranks are threads of one process joined by a :class:`ThreadHub`.
  It behaves like the real one (buffered sends, blocking receives with timeouts, size checks)
  and lets unit tests run the executor on many plans without starting processes.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

import torch

from ..errors import InternalError

# Polling interval of NCCL work completion (NCCL's wait() blocks the stream, not the host).
_POLL_S = 2e-4


class TransportError(InternalError, RuntimeError):
    """A send, receive or control allgather failed or timed out (``timed_out``).

    After one, the data group may be unusable (gloo closes the pair; NCCL needs an abort):
    the executor reports it and the caller builds a fresh group for a retry.
    """

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


class Pending(Protocol):
    def wait(self, timeout_s: float) -> None:
        """Block until the op completed; raise TransportError on failure or timeout."""


class PendingGather(Protocol):
    def wait(self, timeout_s: float) -> torch.Tensor:
        """Block until every rank's payload arrived: (size, n); TransportError otherwise."""


class Transport(Protocol):
    """What the executor needs (see module docstring)."""

    rank: int
    size: int
    device: torch.device
    backend: str

    def empty(self, nbytes: int) -> torch.Tensor:
        """A contiguous uint8 staging buffer on the transport's device."""

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, torch.Tensor]], tag: int) -> list[Pending]:
        """Post sends and receives (peer, contiguous tensor); one Pending each, sends first."""

    def allgather(self, payload: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """Gather a 1-D uint8 CPU tensor of the same size from every rank: (size, n)."""

    def start_allgather(self, payload: torch.Tensor) -> PendingGather:
        """Post the same gather without waiting (every rank posts its gathers in one order)."""


# -- torch.distributed ----------------------------------------------------------------------

class _TorchPending:
    def __init__(self, work, nccl: bool, what: str) -> None:
        self.work = work
        self.nccl = nccl
        self.what = what

    def wait(self, timeout_s: float) -> None:
        try:
            if self.nccl:
                # work.wait() on NCCL only orders the current stream after the op; bound the
                # host-side wait by polling completion instead.
                deadline = time.monotonic() + timeout_s
                while not self.work.is_completed():
                    if time.monotonic() > deadline:
                        raise TransportError(f"{self.what} did not complete within "
                                             f"{timeout_s:.1f} s", timed_out=True)
                    time.sleep(_POLL_S)
                self.work.wait()
            else:
                self.work.wait(timedelta(seconds=max(timeout_s, 1e-3)))
        except TransportError:
            raise
        except RuntimeError as exc:
            raise TransportError(f"{self.what} failed: {_first_line(exc)}",
                                 timed_out=_is_timeout(exc)) from exc


class _TorchGather:
    """A posted control allgather; ``order`` maps control-group rows to migration ranks."""

    def __init__(self, work, table: torch.Tensor, order: torch.Tensor | None) -> None:
        self.work, self.table, self.order = work, table, order

    def wait(self, timeout_s: float) -> torch.Tensor:
        try:
            self.work.wait(timedelta(seconds=max(timeout_s, 1e-3)))
        except RuntimeError as exc:
            raise TransportError(f"control allgather failed after at most {timeout_s:.1f} s: "
                                 f"{_first_line(exc)}", timed_out=_is_timeout(exc)) from exc
        return self.table if self.order is None else self.table[self.order]


class _FailedGather:
    """A control allgather that could not even be posted: fails when waited on."""

    def __init__(self, exc: RuntimeError) -> None:
        self.exc = exc

    def wait(self, timeout_s: float) -> torch.Tensor:
        raise TransportError(f"control allgather could not be posted: {_first_line(self.exc)}",
                             timed_out=_is_timeout(self.exc)) from self.exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class TorchTransport:
    """torch.distributed transport over a data group and a gloo control group.

    Args:
        data: process group the state moves over (gloo or NCCL).
        control: gloo process group over the same processes, for votes.
        members: global rank (in the default group) of each migration-group rank.
        rank: this process's migration-group rank.
        device: where staging buffers live (``cpu`` for gloo, this process's GPU for NCCL).
    """

    def __init__(self, data, control, members: Sequence[int], rank: int,
                 device: torch.device | str | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.data = data
        self.control = control
        self.rank = rank
        self.size = len(members)
        self.backend = str(dist.get_backend(data))
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if self.backend == "nccl" else torch.device("cpu"))
        self.device = torch.device(device)
        self._data_rank = [dist.get_group_rank(data, g) for g in members]
        control_rank = [dist.get_group_rank(control, g) for g in members]
        # allgather output is in control-group rank order; map back to migration ranks
        self._control_order = torch.tensor(control_rank, dtype=torch.long, device="cpu")
        if self._data_rank[rank] != data.rank() or control_rank[rank] != control.rank():
            raise ValueError(f"migration rank {rank} is global rank {members[rank]}, which is "
                             f"not this process (data group rank {data.rank()})")

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)

    def exchange(self, sends, recvs, tag: int) -> list[Pending]:
        dist = self._dist
        ops, what = [], []
        for peer, tensor in sends:
            ops.append(dist.P2POp(dist.isend, tensor, group=self.data,
                                  group_peer=self._data_rank[peer], tag=tag))
            what.append(f"send of {tensor.numel()} bytes to migration rank {peer}")
        for peer, tensor in recvs:
            ops.append(dist.P2POp(dist.irecv, tensor, group=self.data,
                                  group_peer=self._data_rank[peer], tag=tag))
            what.append(f"receive of {tensor.numel()} bytes from migration rank {peer}")
        if not ops:
            return []
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            raise TransportError(f"posting {', '.join(what)} failed: {_first_line(exc)}") from exc
        nccl = self.backend == "nccl"
        if len(works) != len(ops):  # NCCL coalesces the group call: one work for all
            whole = "; ".join(what)
            return [_TorchPending(works[-1], nccl, whole)] * len(ops)
        return [_TorchPending(w, nccl, d) for w, d in zip(works, what)]

    def allgather(self, payload: torch.Tensor, timeout_s: float) -> torch.Tensor:
        return self.start_allgather(payload).wait(timeout_s)

    def start_allgather(self, payload: torch.Tensor) -> PendingGather:
        n = payload.numel()
        out = torch.empty(self.size * n, dtype=torch.uint8, device="cpu")
        try:
            work = self._dist.all_gather_single(out, payload.contiguous(),
                                               group=self.control, async_op=True)
        except RuntimeError as exc:
            return _FailedGather(exc)
        return _TorchGather(work, out.view(self.size, n), self._control_order)


class BackendTransport:
    """torch.distributed transport over process groups that no default group knows.

    Groups built straight from a store (``ProcessGroupGloo(store, rank, size)``; on a GPU a
    ``ProcessGroup`` over a ``ProcessGroupNCCL`` backend for the data) are usable beside (and
    before) a default group, so the migration group can be connected while training runs;
    their ranks are the migration ranks. Gloo posts every send and receive on its own anyway,
    which is all that ``batch_isend_irecv`` does on gloo. NCCL deadlocks on concurrent
    point-to-point operations posted separately: every send and receive of a step goes in
    one coalesced group call (``_start_coalescing`` / ``_end_coalescing``, what torch's
    ``batch_isend_irecv`` does), and all of them complete with its one work.
    """

    def __init__(self, data, control, device: torch.device | str = "cpu") -> None:
        if data.rank() != control.rank() or data.size() != control.size():
            raise ValueError(f"data group is rank {data.rank()} of {data.size()}, control "
                             f"group rank {control.rank()} of {control.size()}")
        self.data, self.control = data, control
        self.rank, self.size = data.rank(), data.size()
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)

    def exchange(self, sends, recvs, tag: int) -> list[Pending]:
        if self.backend == "nccl":
            return self._exchange_batched(sends, recvs, tag)
        posted: dict[str, list[Pending]] = {"send": [], "receive": []}
        # receives first: a peer's sends find their buffers posted
        for kind, op, items, what in (("receive", self.data.recv, recvs, "from"),
                                      ("send", self.data.send, sends, "to")):
            for peer, tensor in items:
                desc = f"{kind} of {tensor.numel()} bytes {what} migration rank {peer}"
                if not tensor.is_contiguous():
                    raise TransportError(f"posting {desc} failed: tensor is not contiguous")
                try:
                    work = op([tensor], peer, tag)
                except RuntimeError as exc:
                    raise TransportError(f"posting {desc} failed: {_first_line(exc)}") from exc
                posted[kind].append(_TorchPending(work, False, desc))
        return posted["send"] + posted["receive"]

    def _exchange_batched(self, sends, recvs, tag: int) -> list[Pending]:
        """The step's operations in one NCCL group call; one work completes them all."""
        what = ", ".join([f"send of {t.numel()} bytes to migration rank {p}" for p, t in sends]
                         + [f"receive of {t.numel()} bytes from migration rank {p}"
                            for p, t in recvs])
        if not sends and not recvs:
            return []
        self.data._start_coalescing(self.device)
        try:
            for peer, tensor in sends:
                self.data.send([tensor], peer, tag)
            for peer, tensor in recvs:
                self.data.recv([tensor], peer, tag)
        except RuntimeError as exc:
            self.data._end_coalescing(self.device)
            raise TransportError(f"posting {what} failed: {_first_line(exc)}") from exc
        try:
            work = self.data._end_coalescing(self.device)
        except RuntimeError as exc:
            raise TransportError(f"posting {what} failed: {_first_line(exc)}") from exc
        one = _TorchPending(work, True, what)
        return [one] * (len(sends) + len(recvs))

    def allgather(self, payload: torch.Tensor, timeout_s: float) -> torch.Tensor:
        return self.start_allgather(payload).wait(timeout_s)

    def start_allgather(self, payload: torch.Tensor) -> PendingGather:
        n = payload.numel()
        out = torch.empty(self.size * n, dtype=torch.uint8, device="cpu")
        try:
            work = self.control._allgather_base(out, payload.contiguous())
        except RuntimeError as exc:
            return _FailedGather(exc)
        return _TorchGather(work, out.view(self.size, n), None)


# -- threads --------------------------------------------------------------------------------

class ThreadHub:
    """Mailboxes joining the ranks of a :class:`ThreadTransport` (one per thread)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Condition()
        self._boxes: dict[tuple[int, int, int], queue.Queue] = {}
        self._gathers: dict[int, dict[int, torch.Tensor]] = {}

    def box(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._boxes.setdefault((src, dst, tag), queue.Queue())

    def transports(self) -> list["ThreadTransport"]:
        return [ThreadTransport(self, r) for r in range(self.size)]

    def deposit(self, rank: int, generation: int, payload: torch.Tensor) -> None:
        with self._lock:
            self._gathers.setdefault(generation, {})[rank] = payload.clone()
            self._lock.notify_all()

    def collect(self, generation: int, timeout_s: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            slot = self._gathers.setdefault(generation, {})
            while len(slot) < self.size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.size)) - set(slot))
                    raise TransportError(f"control allgather timed out after {timeout_s:.1f} s "
                                         f"waiting for ranks {missing}", timed_out=True)
                self._lock.wait(left)
            return torch.stack([slot[r] for r in range(self.size)])


class _ThreadSend:
    def wait(self, timeout_s: float) -> None:
        return None


class _ThreadRecv:
    def __init__(self, box: queue.Queue, tensor: torch.Tensor, what: str) -> None:
        self.box, self.tensor, self.what = box, tensor, what

    def wait(self, timeout_s: float) -> None:
        try:
            data = self.box.get(timeout=max(timeout_s, 1e-3))
        except queue.Empty:
            raise TransportError(f"{self.what} timed out after {timeout_s:.1f} s",
                                 timed_out=True) from None
        if data.numel() != self.tensor.numel():
            raise TransportError(f"{self.what}: {data.numel()} bytes arrived, "
                                 f"{self.tensor.numel()} expected")
        self.tensor.copy_(data)


class ThreadTransport:
    """One rank of an in-process transport (see module docstring)."""

    backend = "threads"

    def __init__(self, hub: ThreadHub, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self.size = hub.size
        self.device = torch.device("cpu")
        self._generation = 0

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)

    def exchange(self, sends, recvs, tag: int) -> list[Pending]:
        out: list[Pending] = []
        for peer, tensor in sends:
            if not tensor.is_contiguous():
                raise TransportError("send tensor must be contiguous")
            self.hub.box(self.rank, peer, tag).put(tensor.clone())
            out.append(_ThreadSend())
        for peer, tensor in recvs:
            if not tensor.is_contiguous():
                raise TransportError("receive tensor must be contiguous")
            out.append(_ThreadRecv(self.hub.box(peer, self.rank, tag), tensor,
                                   f"receive of {tensor.numel()} bytes from migration rank {peer}"))
        return out

    def allgather(self, payload: torch.Tensor, timeout_s: float) -> torch.Tensor:
        return self.start_allgather(payload).wait(timeout_s)

    def start_allgather(self, payload: torch.Tensor) -> PendingGather:
        generation = self._generation
        self._generation += 1
        self.hub.deposit(self.rank, generation, payload)
        return _ThreadGather(self.hub, generation)


class _ThreadGather:
    def __init__(self, hub: ThreadHub, generation: int) -> None:
        self.hub, self.generation = hub, generation

    def wait(self, timeout_s: float) -> torch.Tensor:
        return self.hub.collect(self.generation, timeout_s)

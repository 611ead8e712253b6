"""What a worker is told (orders) and what it tells (reports), and the seam that carries them.

The coordinator decides; workers obey at step boundaries. Orders and reports are msgspec
structs with a ``type`` tag, so one decoder (``ORDER_DECODER`` / ``REPORT_DECODER``) turns
bytes into exactly one of them or raises ``msgspec.ValidationError``. Every message names its
job and generation. The control channel (authenticated, over the network) and the local
scripted driver both implement :class:`Control`; the trainer knows nothing else.

Plans are not shipped: a :class:`Resize` names the old and new layouts and every worker plans
the migration itself (the planner is deterministic, so all compute the same plan); the
coordinator's ``plan_digest`` lets each worker check that it did.
"""
from __future__ import annotations

from typing import Literal, Protocol

import msgspec

from slurm_etc.plan.config import Layout, ParallelConfig
from slurm_etc.plan.errors import ConfigError


class LayoutSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A layout on the wire: ``config`` as ``dp=N,tp=N,pp=N[,ep=N,cp=N,vpp=N]``;
    ``devices[rank]`` the vrank of every rank in megatron's rank order."""

    config: str
    devices: tuple[int, ...]
    distributed_optimizer: bool = False

    def layout(self) -> Layout:
        """The Layout (raises ConfigError on a malformed config or device list)."""
        cfg = ParallelConfig.parse(self.config, self.distributed_optimizer)
        return Layout(cfg, tuple(self.devices))

    @classmethod
    def of(cls, layout: Layout) -> LayoutSpec:
        c = layout.config
        return cls(c.degrees(), tuple(layout.devices),
                   c.distributed_optimizer)


class Resize(msgspec.Struct, frozen=True, tag="resize", forbid_unknown_fields=True):
    """Move from ``old`` to ``new`` at the next step boundary; opens ``generation``.

    ``pool`` is the devices the coordinator planned the new layout on (empty: exactly
    ``new.devices``) and ``gpus_per_node`` its topology (0: the worker's own): every worker
    plans with the same inputs. ``lost`` are old vranks that died without notice: they take
    no part, and what they held comes from surviving replicas. ``deadline`` (unix seconds)
    is when the devices leaving are taken away (a preemption's grace); ``plan_digest`` is
    the coordinator's plan digest.
    """

    job: str
    generation: int
    old: LayoutSpec
    new: LayoutSpec
    plan_digest: str = ""
    pool: tuple[int, ...] = ()
    gpus_per_node: int = 0
    lost: tuple[int, ...] = ()
    deadline: float | None = None
    reason: str = ""


class Stop(msgspec.Struct, frozen=True, tag="stop", forbid_unknown_fields=True):
    """Finish the current step and exit cleanly."""

    job: str
    generation: int
    reason: str = ""


class Abort(msgspec.Struct, frozen=True, tag="abort", forbid_unknown_fields=True):
    """Give up the resize of ``generation``; the old layout trains on."""

    job: str
    generation: int
    reason: str = ""


Order = Resize | Stop | Abort


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat", forbid_unknown_fields=True):
    """The coordinator is alive (sent every HEARTBEAT_S to every running worker). Not an
    order: the channel only notes when it last heard from the coordinator, and a worker
    that hears nothing holds, then exits after its reattach wait (``REATTACH_WAIT``)."""

    job: str
    generation: int


class Hello(msgspec.Struct, frozen=True, tag="hello", forbid_unknown_fields=True):
    """A worker started and joined the control channel."""

    job: str
    generation: int
    vrank: int
    host: str
    pid: int


class Progress(msgspec.Struct, frozen=True, tag="progress", forbid_unknown_fields=True):
    """One training step done (sent by rank 0 of a layout)."""

    job: str
    generation: int
    vrank: int
    step: int
    loss: float
    lr: float
    consumed_samples: int
    layout: str


class Resized(msgspec.Struct, frozen=True, tag="resized", forbid_unknown_fields=True):
    """One worker's side of a resize: ``outcome`` committed, aborted or left (departed).
    ``lost_steps``: (first, last) steps trained before a node was lost without grace whose
    state no replica held; the job rolled back to ``first - 1`` and trains them again.
    ``rebuilt_from``: where that state came from (``peer-copies``, ``checkpoint``; empty:
    surviving replicas, or nothing was lost)."""

    job: str
    generation: int
    vrank: int
    outcome: Literal["committed", "aborted", "left"]
    step: int
    pause_seconds: float = 0.0
    data_seconds: float = 0.0
    sent_bytes: int = 0
    received_bytes: int = 0
    error: str = ""
    lost_steps: tuple[int, int] | None = None
    rebuilt_from: Literal["", "peer-copies", "checkpoint"] = ""


class Exited(msgspec.Struct, frozen=True, tag="exited", forbid_unknown_fields=True):
    """A worker is exiting (stopped, left after a resize, or failed)."""

    job: str
    generation: int
    vrank: int
    reason: str
    step: int = 0


Report = Hello | Progress | Resized | Exited

ORDER_DECODER = msgspec.msgpack.Decoder(Order)
REPORT_DECODER = msgspec.msgpack.Decoder(Report)
ENCODER = msgspec.msgpack.Encoder()


class Control(Protocol):
    """How a worker takes orders and reports. Implemented by the coordinator's channel
    client and by the local scripted driver."""

    def poll(self) -> Order | None:
        """An order waiting for this worker, or None; never blocks (called every step)."""
        ...

    def wait(self, timeout_s: float) -> Order | None:
        """Block until an order arrives (a joining worker waits for its first), or None
        after ``timeout_s``."""
        ...

    def report(self, message: Report) -> None:
        """Send a report to the coordinator (best effort, never blocks training)."""
        ...


# -- what a launched worker finds in its environment (besides the channel's) -------------

LAYOUT = "SLURM_ETC_LAYOUT"          # "dp=2,tp=1,pp=1,dist-opt@0,1" (config@vranks)
GPUS_PER_NODE = "SLURM_ETC_GPUS_PER_NODE"
TIMEOUT = "SLURM_ETC_TIMEOUT_S"
# How long a worker that hears nothing from its coordinator waits for it (a reattach)
# before it exits; it holds (trains no step) after HOLD_AFTER_S of silence.
REATTACH_WAIT = "SLURM_ETC_REATTACH_WAIT_S"
DEFAULT_REATTACH_WAIT_S = 120.0
HEARTBEAT_S = 2.0
HOLD_AFTER_S = 15.0


def format_layout(layout: Layout) -> str:
    return f"{layout.config}@{','.join(map(str, layout.devices))}"


def parse_layout(text: str) -> Layout:
    """Inverse of :func:`format_layout` (ConfigError when malformed)."""
    config, sep, devices = text.partition("@")
    if not sep:
        raise ConfigError(f"{LAYOUT}={text!r}: expected <config>@<vrank,...>")
    dist_opt = config.endswith(",dist-opt")
    cfg = ParallelConfig.parse(config.removesuffix(",dist-opt"), dist_opt)
    try:
        ranks = tuple(int(v) for v in devices.split(","))
    except ValueError:
        raise ConfigError(f"{LAYOUT}={text!r}: vranks must be integers") from None
    return Layout(cfg, ranks)

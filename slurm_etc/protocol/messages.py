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

from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Annotated, Literal, Protocol

import msgspec

from slurm_etc import bounds
from slurm_etc.lifecycle import ProcessOutcome
from slurm_etc.plan.config import Layout, ParallelConfig
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import MODEL_BOUNDS, ModelDesc

from .env import LAYOUT

# the most vranks a list of runs may name (a job's devices; far above any machine)
MAX_VRANKS = 1 << 20
_First = Annotated[int, msgspec.Meta(ge=0, lt=MAX_VRANKS)]
_Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_VRANKS)]
# vranks as runs of consecutive ones, ``(first, count)``, in their order
Runs = tuple[tuple[_First, _Count], ...]


def pack_runs(vranks: Iterable[int]) -> Runs:
    """``vranks`` (in order) as runs of consecutive vranks: what an order carries. The
    allocator keeps a job's vranks compact, so a layout of any size is a run or a few
    (listed whole, a 16,384-rank layout is ~50 KB, and an order names two and goes to
    every rank: 1.6 GB a resize; as runs, a few bytes)."""
    out: list[tuple[int, int]] = []
    for v in vranks:
        if out and out[-1][0] + out[-1][1] == v:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((v, 1))
    return tuple(out)


@lru_cache(maxsize=64)
def unpack_runs(runs: Runs) -> tuple[int, ...]:
    """The vranks ``runs`` name, in order (ConfigError past :data:`MAX_VRANKS`)."""
    if sum(count for _, count in runs) > MAX_VRANKS:
        raise ConfigError(f"runs name more than {MAX_VRANKS:,} vranks")
    return tuple(v for first, count in runs for v in range(first, first + count))


class LayoutSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A layout on the wire: ``config`` as ``dp=N,tp=N,pp=N[,ep=N,cp=N,vpp=N]``; ``runs``
    the vrank of every rank in megatron's rank order (:attr:`devices`) as runs of
    consecutive vranks (:func:`pack_runs`). Build one with :meth:`of` or :meth:`make`."""

    config: str
    runs: Runs
    distributed_optimizer: bool = False

    @property
    def devices(self) -> tuple[int, ...]:
        """``devices[rank]``: the vrank of every rank."""
        return unpack_runs(self.runs)

    def layout(self) -> Layout:
        """The Layout (raises ConfigError on a malformed config or device list)."""
        cfg = ParallelConfig.parse(self.config, self.distributed_optimizer)
        return Layout(cfg, self.devices)

    @classmethod
    def make(cls, config: str, devices: Iterable[int],
             distributed_optimizer: bool = False) -> LayoutSpec:
        return cls(config, pack_runs(devices), distributed_optimizer)

    @classmethod
    def of(cls, layout: Layout) -> LayoutSpec:
        c = layout.config
        return cls.make(c.degrees(), layout.devices, c.distributed_optimizer)


class Resize(msgspec.Struct, frozen=True, tag="resize", forbid_unknown_fields=True):
    """Move from ``old`` to ``new`` at the next step boundary; opens ``generation``.

    ``pool`` is the devices the coordinator planned the new layout on (empty: exactly
    ``new.devices``; on the wire as runs, ``pool_runs``) and ``gpus_per_node`` its topology
    (0: the worker's own): every worker plans with the same inputs. ``lost`` are old vranks
    that died without notice: they take no part, and what they held comes from surviving
    replicas. ``deadline`` (unix seconds)
    is when the devices leaving are taken away (a preemption's grace); ``plan_digest`` is
    the coordinator's plan digest. ``prepare_while_training``: the old layout trains on
    while the resize is prepared and pauses only at a later step boundary, once every
    process is prepared (docs/zero-stall.md); without it (a scripted sequence that must
    resize at an exact step) everything happens at the step where the order is agreed.
    """

    job: str
    generation: int
    old: LayoutSpec
    new: LayoutSpec
    plan_digest: str = ""
    pool_runs: Runs = ()
    gpus_per_node: int = 0
    lost: tuple[int, ...] = ()
    deadline: float | None = None
    reason: str = ""
    prepare_while_training: bool = False

    @property
    def pool(self) -> tuple[int, ...]:
        return unpack_runs(self.pool_runs)


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


class Hello(msgspec.Struct, frozen=True, tag="hello", forbid_unknown_fields=True,
            omit_defaults=True):
    """A worker started and joined the control channel, or (``step`` >= 0) one that lost
    its coordinator says where it is to the one restarted on the job's record: the step it
    trained to in generation ``trained``. (Defaults are left off the wire: a first Hello
    reads as it did before these fields.)"""

    job: str
    generation: int
    vrank: int
    host: str
    pid: int
    step: int = -1
    trained: int = -1


class Progress(msgspec.Struct, frozen=True, tag="progress", forbid_unknown_fields=True):
    """One training step done (sent by rank 0 of a layout); ``started``/``ended``: when the
    step began and ended on that rank (unix seconds; 0: not known)."""

    job: str
    generation: int
    vrank: int
    step: int
    loss: float
    lr: float
    consumed_samples: int
    layout: str
    started: float = 0.0
    ended: float = 0.0


class Resized(msgspec.Struct, frozen=True, tag="resized", forbid_unknown_fields=True):
    """One worker's side of a resize: ``outcome`` committed, aborted or left (departed).
    ``lost_steps``: (first, last) steps trained before a node was lost without grace whose
    state no replica held; the job rolled back to ``first - 1`` and trains them again.
    ``rebuilt_from``: where that state came from (``peer-copies``, ``checkpoint``; empty:
    surviving replicas, or nothing was lost). ``for_group``: the migration group's proposer
    answers for every rank of it (a commit; ``data_seconds`` the longest of them, from the
    commit decision's share), and no other rank of it answers (not in a rebuild: there
    every survivor answers with the steps it lost)."""

    job: str
    generation: int
    vrank: int
    outcome: ProcessOutcome
    step: int
    pause_seconds: float = 0.0
    data_seconds: float = 0.0
    sent_bytes: int = 0
    received_bytes: int = 0
    error: str = ""
    lost_steps: tuple[int, int] | None = None
    rebuilt_from: Literal["", "peer-copies", "checkpoint"] = ""
    for_group: bool = False


class CopiesChosen(msgspec.Struct, frozen=True, tag="copies", forbid_unknown_fields=True):
    """Peer copies every "auto" steps: what the workers chose, once (sent by rank 0 of the
    layout that chose): copies every ``every`` steps (0: they do not fit host memory),
    periodic checkpoints every ``checkpoint_every`` (0: none), from a copy of
    ``copy_seconds`` against steps of ``step_seconds`` and ``held_bytes`` of the
    ``host_bytes`` of host memory a rank has; ``line`` says it."""

    job: str
    generation: int
    vrank: int
    every: int
    checkpoint_every: int
    copy_seconds: float
    step_seconds: float
    held_bytes: int
    host_bytes: int
    line: str


class Exited(msgspec.Struct, frozen=True, tag="exited", forbid_unknown_fields=True):
    """A worker is exiting (stopped, done, or failed). A process that left the job at a
    commit says nothing: the coordinator counted it out at the commit, and its backend sees
    it exit."""

    job: str
    generation: int
    vrank: int
    reason: str
    step: int = 0


def _within(bound: bounds.Bound) -> msgspec.Meta:
    return msgspec.Meta(ge=bound.low, le=bound.high)


class ModelReport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The model a worker built, as the layout chooser, the memory estimate and the planner
    see it: the description whose catalog the live model's ``sharded_state_dict()`` was
    checked against, and the batch it trains. Every field of :class:`ModelDesc` that
    changes the catalog or the chooser is here (``vocab_divisor`` only pads the vocabulary:
    ``vocab_size`` is the padded one), each bounded as a model file's is
    (``plan.model.MODEL_BOUNDS``).

    Every default is resolved (the query groups, the channels per head, the padded
    vocabulary; for a mixture of experts the router's top-k and the experts' inner size),
    so that two descriptions of the same model report the same: a preset and the live
    model megatron built from it compare equal field by field."""

    name: Annotated[str, msgspec.Meta(max_length=bounds.NAME_CHARS)]
    num_layers: Annotated[int, _within(MODEL_BOUNDS["num_layers"])]
    hidden: Annotated[int, _within(MODEL_BOUNDS["hidden"])]
    ffn_hidden: Annotated[int, _within(MODEL_BOUNDS["ffn_hidden"])]
    num_heads: Annotated[int, _within(MODEL_BOUNDS["num_heads"])]
    num_query_groups: Annotated[int, _within(MODEL_BOUNDS["num_query_groups"])]
    vocab_size: Annotated[int, _within(MODEL_BOUNDS["vocab_size"])]
    seq_length: Annotated[int, _within(MODEL_BOUNDS["seq_length"])]
    swiglu: bool
    rmsnorm: bool
    add_bias_linear: bool
    learned_position_embeddings: bool
    tied_embeddings: bool
    param_dtype: Literal["fp32", "bf16"]
    global_batch: Annotated[int, _within(bounds.BATCH)]
    micro_batch: Annotated[int, _within(bounds.BATCH)]
    head_dim: Annotated[int, _within(MODEL_BOUNDS["head_dim"])] | None = None
    qk_layernorm: bool = False
    # None: a dense model (then the three below are None too)
    num_experts: Annotated[int, _within(MODEL_BOUNDS["num_experts"])] | None = None
    router_topk: Annotated[int, _within(MODEL_BOUNDS["router_topk"])] | None = None
    expert_ffn: Annotated[int, _within(MODEL_BOUNDS["expert_ffn"])] | None = None
    shared_expert_ffn: Annotated[int, _within(MODEL_BOUNDS["shared_expert_ffn"])] | None = None

    @classmethod
    def of(cls, desc: ModelDesc, global_batch: int, micro_batch: int) -> ModelReport:
        dtype: Literal["fp32", "bf16"] = "bf16" if desc.param_dtype == "bf16" else "fp32"
        moe = desc.moe
        return cls(desc.name, desc.num_layers, desc.hidden, desc.ffn_hidden, desc.num_heads,
                   desc.query_groups, desc.padded_vocab, desc.seq_length, desc.swiglu,
                   desc.rmsnorm, desc.add_bias_linear, desc.learned_position_embeddings,
                   desc.tied_embeddings, dtype, global_batch, micro_batch,
                   head_dim=desc.kv_channels, qk_layernorm=desc.qk_layernorm,
                   num_experts=desc.num_experts,
                   router_topk=desc.topk if moe else desc.router_topk,
                   expert_ffn=desc.expert_ffn_size if moe else desc.expert_ffn,
                   shared_expert_ffn=desc.shared_expert_ffn)

    def desc(self) -> ModelDesc:
        """The ModelDesc, its defaults resolved (raises ConfigError where the sizes do not
        fit together, e.g. a router top-k above the experts)."""
        return ModelDesc(self.name, self.num_layers, self.hidden, self.ffn_hidden,
                         self.num_heads, self.vocab_size, self.num_query_groups,
                         self.seq_length, self.swiglu, self.rmsnorm, self.add_bias_linear,
                         self.learned_position_embeddings, self.tied_embeddings,
                         self.param_dtype, vocab_divisor=1, head_dim=self.head_dim,
                         qk_layernorm=self.qk_layernorm, num_experts=self.num_experts,
                         router_topk=self.router_topk, expert_ffn=self.expert_ffn,
                         shared_expert_ffn=self.shared_expert_ffn)

    def difference(self, other: ModelReport, here: str, there: Mapping[str, str],
                   compared: tuple[str, ...]) -> str | None:
        """The first of the ``compared`` fields (:data:`MODEL_FIELDS`, :data:`BATCH_FIELDS`)
        where ``other`` differs, as one line: ``hidden: 128 in the training script, 64 in
        --model tiny`` (``here``: where this report comes from; ``there[field]``, else
        ``there['']``: where ``other``'s value does), or None where they agree."""
        for f in compared:
            mine, theirs = getattr(self, f), getattr(other, f)
            if mine != theirs:
                return (f"{f}: {_shown(mine)} in {here}, {_shown(theirs)} in "
                        f"{there.get(f, there.get('', 'the other'))}")
        return None


BATCH_FIELDS = ("global_batch", "micro_batch")
# every field of ModelReport but its name (free text) and the batch
MODEL_FIELDS = tuple(f for f in ModelReport.__struct_fields__
                     if f != "name" and f not in BATCH_FIELDS)


def _shown(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


class ModelBuilt(msgspec.Struct, frozen=True, tag="model", forbid_unknown_fields=True):
    """A worker built its model (sent once per process, after its first build): what it
    trains. The coordinator plans from the first layout's when ``--model`` is not given and
    stops the job at once when any differs from the model it plans with."""

    job: str
    generation: int
    vrank: int
    model: ModelReport
    # the script builds virtual pipeline chunks (its model provider takes ``vp_stage``):
    # the coordinator offers vpp layouts only once a worker said so
    chunks: bool = False


class Ready(msgspec.Struct, frozen=True, tag="ready", forbid_unknown_fields=True):
    """A joiner of the resize to ``generation`` warmed up aside while the old layout trains
    (imported and connected): the coordinator
    orders the old layout only once every joiner said it. ``seconds``: its warm-up."""

    job: str
    generation: int
    vrank: int
    seconds: float = 0.0


class Resumed(msgspec.Struct, frozen=True, tag="resumed", forbid_unknown_fields=True):
    """One process's first step in the layout of ``generation`` began: ``started`` is when
    (unix seconds), ``last_ended`` when its last step in the old layout ended, or, for a
    process that joined with this resize, when the old layout's last step ended on the
    rank that published its state (None: not known). Their difference is this process's
    training gap; the migration's pause is the largest over the new layout's processes.
    ``stalled``: the widest gap between two of this process's steps in the old layout while
    the resize was prepared beside training (the step boundary that built the new world),
    seconds; 0 where nothing was prepared while training (a joiner, a loss).
    ``failed_at``: when this process's step in flight failed (a collective with a peer that
    died; unix seconds), None where none did: from ``last_ended`` to it the step was lost
    with the node, the rest of the gap is the recovery.
    ``widest_of``: this process's gap is the widest of the layout's ``widest_of`` processes,
    and ``stall_of``: its stall is the widest of as many (the layout's ranks found them by
    one all-reduce and only their ranks report: ``worker/reporting.py``); 0: this process's
    own report only."""

    job: str
    generation: int
    vrank: int
    step: int
    started: float
    last_ended: float | None
    joined: bool = False
    stalled: float = 0.0
    failed_at: float | None = None
    widest_of: Annotated[int, msgspec.Meta(ge=0, le=MAX_VRANKS)] = 0
    stall_of: Annotated[int, msgspec.Meta(ge=0, le=MAX_VRANKS)] = 0


Report = Hello | Progress | Resized | Exited | ModelBuilt | Resumed | Ready | CopiesChosen

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


# -- the first layout as a launched worker finds it in its environment (env.LAYOUT) ------

# libzmq's pings from each worker to the coordinator (answered by its I/O thread): O(ranks) a
# interval at the coordinator, so not too often. libzmq drops a link whose ping is unanswered
# for HEARTBEAT_TIMEOUT_S, so a hang or a partition is seen at most HEARTBEAT_S +
# HEARTBEAT_TIMEOUT_S after it (40 s; ~30 on average); the coordinator's end drops a link
# silent for as long. A pong comes from the I/O thread in milliseconds: the timeout need not
# be longer than the interval. A coordinator's death closes the link at once (its process's
# sockets close). bench control at 16,384 ranks (2026-12-08): the coordinator's steady CPU
# 0.111 s/s with pings every 10 s (30 s timeout; its I/O threads 0.075 of it), 0.080-0.094
# every 20 s (its I/O threads 0.05; five runs).
HEARTBEAT_S = 20.0
HEARTBEAT_TIMEOUT_S = 20.0
HOLD_AFTER_S = 15.0


def format_layout(layout: Layout) -> str:
    """``<config>@<runs>``, a run ``first-last`` or one vrank: a few bytes whatever the
    layout's size (a 16,384-rank layout listed whole would pass Linux's 128 KiB bound on
    one environment variable at 32k ranks)."""
    runs = (f"{a}" if n == 1 else f"{a}-{a + n - 1}" for a, n in pack_runs(layout.devices))
    return f"{layout.config}@{','.join(runs)}"


def parse_layout(text: str) -> Layout:
    """Inverse of :func:`format_layout` (ConfigError when malformed)."""
    config, sep, devices = text.partition("@")
    if not sep:
        raise ConfigError(f"{LAYOUT}={text!r}: expected <config>@<vrank or first-last,...>")
    dist_opt = config.endswith(",dist-opt")
    cfg = ParallelConfig.parse(config.removesuffix(",dist-opt"), dist_opt)
    runs: list[tuple[int, int]] = []
    try:
        for part in devices.split(","):
            first, dash, last = part.partition("-")
            a, b = int(first), int(last if dash else first)
            if not 0 <= a <= b < MAX_VRANKS:
                raise ValueError(part)
            runs.append((a, b - a + 1))
        ranks = unpack_runs(tuple(runs))
    except ValueError:
        raise ConfigError(f"{LAYOUT}={text!r}: vranks must be integers or ranges "
                          f"first-last (0 <= first <= last < {MAX_VRANKS:,})") from None
    return Layout(cfg, ranks)

"""Configuration chooser: the ParallelConfig a job runs next on the devices it holds.

A candidate must be valid for the model, keep the global batch size (dp * micro_batch
divides it, so only gradient accumulation changes), keep tensor-parallel groups inside a
node, be placeable on the devices (``capacity``), fit device memory, and respect the
admin's allowed tp/pp and node limit. The chooser ranks candidates by an analytic
throughput estimate; among those within ``tolerance`` of the best it takes the one the
planner says moves the fewest bytes.

Beyond dp/tp/pp it considers expert parallelism (ep, mixture-of-experts models only),
interleaved pipeline chunks (vpp) and context parallelism (cp), each only where the training
runtime can build it (``TrainingJob.supports``; default none: the elastic worker builds
dp/tp/pp layouts only) and the model and batch allow it (megatron-core's rules).

The estimates are deliberately simple (stated per function) and only used to rank
candidates against each other; they are not performance predictions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import product
from typing import Callable, Collection, NamedTuple, Sequence

from ..plan.catalog import FIRST, LAST, Catalog, build_catalog
from ..plan.config import ParallelConfig
from ..plan.errors import ConfigError
from ..plan.model import DTYPE_BYTES, ModelDesc
from .vranks import capacity

GIB = 1024 ** 3

# Candidates whose estimated throughput is within this fraction of the best are "near-equal":
# the cheapest migration wins among them.
TOLERANCE = 0.03

# The degrees beyond dp/tp/pp a training runtime may be able to build.
EXTRA_DEGREES = ("ep", "vpp", "cp")

# Bytes per activation element on the wire (bf16 activations whatever the parameters' dtype).
WIRE_BYTES = DTYPE_BYTES["bf16"]


@dataclass(frozen=True)
class Hardware:
    """What one device and its links offer (defaults: an 8-GPU H100-class node).

    Attributes:
        gpus_per_node: devices per node.
        memory_gib: device memory.
        tflops: sustained dense bf16 TFLOP/s per device (peak times a realistic MFU).
        intra_node_gbps: GB/s per device inside a node (NVLink).
        inter_node_gbps: GB/s per device between nodes (one NIC per GPU).
        reserved_gib: memory not available to training (CUDA context, NCCL, allocator slack).
    """

    gpus_per_node: int = 8
    memory_gib: float = 80.0
    tflops: float = 400.0
    intra_node_gbps: float = 150.0
    inter_node_gbps: float = 25.0
    reserved_gib: float = 6.0


@dataclass(frozen=True)
class TrainingJob:
    """The model and batch a job trains; fixed across resizes.

    Attributes:
        model: the model description.
        global_batch: sequences per optimizer step (kept across resizes).
        micro_batch: sequences per forward/backward on one rank.
        distributed_optimizer: ZeRO-1 over dp (fixed: the state format depends on it).
        supports: which of ep, vpp and cp the training runtime can build, so the chooser
            may use them. Default none: dp/tp/pp layouts only. The elastic worker builds ep
            and vpp (the coordinator's ``ELASTIC_SUPPORTS``), not CP groups. Planning at
            scale (``slurm-etc plan --choose``) enables all three.
        sequence_parallel: the runtime builds megatron's sequence parallelism. Without it a
            mixture of experts is given tp = 1 only: megatron-core refuses to train experts
            with tp > 1 and no sequence parallelism (``MoELayer.forward``). The elastic
            worker builds none (False there).
    """

    model: ModelDesc
    global_batch: int
    micro_batch: int = 1
    distributed_optimizer: bool = True
    supports: frozenset[str] = frozenset()
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.micro_batch < 1:
            raise ConfigError(f"global_batch ({self.global_batch}) and micro_batch "
                              f"({self.micro_batch}) must be positive")
        if self.global_batch % self.micro_batch:
            raise ConfigError(f"micro_batch ({self.micro_batch}) must divide global_batch "
                              f"({self.global_batch})")
        unknown = sorted(set(self.supports) - set(EXTRA_DEGREES))
        if unknown:
            raise ConfigError(f"unknown parallelism(s) {', '.join(map(repr, unknown))}: the "
                              f"chooser considers {', '.join(EXTRA_DEGREES)} beyond dp/tp/pp")
        # any collection of names is accepted; a frozenset keeps the job hashable
        object.__setattr__(self, "supports", frozenset(self.supports))


@dataclass(frozen=True)
class Candidate:
    """One configuration with its estimates."""

    config: ParallelConfig
    tokens_per_s: float
    memory_bytes: int
    moved_bytes: int | None = None

    def describe(self) -> str:
        moved = "" if self.moved_bytes is None else f", moves {self.moved_bytes / GIB:.2f} GiB"
        return (f"{self.config}: ~{self.tokens_per_s:,.0f} tokens/s, "
                f"{self.memory_bytes / GIB:.1f} GiB/device{moved}")


@dataclass(frozen=True)
class Choice:
    """The chosen configuration, why, and what was weighed against it."""

    best: Candidate
    near_equal: tuple[Candidate, ...]
    considered: int
    reason: str = field(default="")

    @property
    def config(self) -> ParallelConfig:
        return self.best.config


@lru_cache(maxsize=64)
def _catalog(model: ModelDesc, distributed_optimizer: bool) -> Catalog:
    return build_catalog(model, distributed_optimizer)


class _Stage(NamedTuple):
    """What one rank of a pipeline stage holds before ep and dp x cp divide it (tp and pp
    already have).

    Attributes:
        dense_params: parameters replicated over dp x cp (their gradients are reduced there).
        expert_params: routed-expert parameters of all ep ranks together (divided by ep).
        dense_state: bytes of the dense parameters, their gradients and the optimizer state
            that is not dp-sharded.
        expert_state: the same for the routed experts (divided by ep).
        sharded: bytes of the distributed optimizer's state, divided by dp x cp: dense state
            is sharded over dp x cp, expert state over ep x expert-dp = dp x cp too.
    """

    dense_params: float
    expert_params: float
    dense_state: float
    expert_state: float
    sharded: float


@lru_cache(maxsize=4096)
def _stage_numbers(model: ModelDesc, distributed_optimizer: bool, tp: int, pp: int,
                   stage: int) -> _Stage:
    """What one rank of ``stage`` holds, exactly per the planner's shard catalog.

    Gradients add one param-dtype copy of the parameters. The catalog folds the experts into
    the layer axis (``TensorGroup.experts``), so an expert group's share of a stage is its
    ``1 / pp`` as for a dense layer weight, and an ep rank holds ``1 / ep`` of that.
    """
    catalog = _catalog(model, distributed_optimizer)
    grad_bytes = DTYPE_BYTES[model.param_dtype]
    dense = experts = dense_state = expert_state = sharded = 0.0
    for g in catalog.groups:
        if (g.stage == FIRST and stage != 0) or (g.stage == LAST and stage != pp - 1):
            continue
        numel = g.numel / (tp if g.tp_axis is not None else 1)
        if g.stacked:
            numel /= pp
        if g.dist:
            sharded += numel * g.bytes_per_element
        elif g.expert:
            experts += numel
            expert_state += numel * (g.bytes_per_element + grad_bytes)
        else:
            dense += numel
            dense_state += numel * (g.bytes_per_element + grad_bytes)
    return _Stage(dense, experts, dense_state, expert_state, sharded)


def _fullest_stage(job: TrainingJob, config: ParallelConfig) -> tuple[float, float, float]:
    """(dense parameters, expert parameters on one ep rank, state bytes) of the fullest
    rank: first or last pipeline stage.

    Per-rank counts are whole numbers held as floats (tp and pp divide what they split), so
    the sums are exact in any order.
    """
    per_stage = []
    for p in {0, config.pp - 1}:
        s = _stage_numbers(job.model, job.distributed_optimizer, config.tp, config.pp, p)
        state = s.dense_state + s.expert_state / config.ep + s.sharded / config.dp_cp
        experts = s.expert_params / config.ep
        per_stage.append((state, s.dense_params + experts, s.dense_params, experts))
    state, _, dense, experts = max(per_stage)
    return dense, experts, state


def state_bytes_per_device(job: TrainingJob, config: ParallelConfig) -> int:
    """Training state (params, fp32 copies, Adam moments, grads) of the fullest rank.

    The fullest rank is on the first or the last pipeline stage (embedding, output layer).
    Routed experts and their optimizer state are divided by ep; the distributed optimizer's
    state by dp x cp (parameters are replicated over cp).
    """
    return int(_fullest_stage(job, config)[2])


def activation_bytes_per_device(job: TrainingJob, config: ParallelConfig) -> int:
    """Activations of the first stage under 1F1B with selective recomputation.

    Per layer and micro-batch ``(s/cp)*b*h*(10 + 24/tp)`` bytes (Korthikanti et al. 2022, no
    sequence parallelism; cp splits every sequence). Without VPP the first stage keeps
    ``min(pp, micro-batches)`` micro-batches of its ``L/pp`` layers in flight. With VPP it
    keeps megatron's warm-up plus one model-chunk micro-batches of ``L/(pp*vpp)`` layers:
    ``2*(pp-1) + (vpp-1)*pp + 1`` (``get_pp_rank_microbatches`` with the default group size
    pp), at most all ``vpp * micro-batches``.
    """
    m = job.model
    per_layer = m.seq_length // config.cp * job.micro_batch * m.hidden * (10 + 24 / config.tp)
    microbatches = job.global_batch // (job.micro_batch * config.dp)
    pp, vpp = config.pp, config.vpp
    if vpp == 1:
        in_flight = min(pp, microbatches)
        return int(per_layer * m.num_layers / pp * in_flight)
    chunks = min(2 * (pp - 1) + (vpp - 1) * pp + 1, vpp * microbatches)
    return int(per_layer * m.num_layers / (pp * vpp) * chunks)


def memory_bytes(job: TrainingJob, config: ParallelConfig) -> int:
    """Estimated peak memory of the fullest device."""
    return state_bytes_per_device(job, config) + activation_bytes_per_device(job, config)


def _flops_per_token(m: ModelDesc) -> float:
    """Forward + backward FLOPs per token: 6 per weight a token passes through plus attention
    scores (Narayanan et al.). A mixture-of-experts token passes through its top-k routed
    experts, the shared expert and the router, not all experts."""
    L, h = m.num_layers, m.hidden
    per_ffn = h * (3 if m.swiglu else 2)
    if m.moe:
        mlp = (m.topk * per_ffn * m.expert_ffn_size + per_ffn * (m.shared_expert_ffn or 0)
               + h * (m.num_experts or 0))
    else:
        mlp = per_ffn * m.ffn_hidden
    per_layer = h * m.qkv_rows + h * m.attention_width + mlp
    return 6 * (L * per_layer + m.padded_vocab * h) + 12 * L * h * m.seq_length


@dataclass(frozen=True)
class IterationTime:
    """One optimizer step of a configuration, in seconds, term by term (nothing overlaps).

    Attributes:
        compute: FLOPs over the devices' sustained rate, without the bubble.
        bubble: the pipeline bubble as a fraction of ``compute``.
        tp, pp, dp, ep, cp: communication of each kind of group.
    """

    compute: float
    bubble: float
    tp: float
    pp: float
    dp: float
    ep: float
    cp: float

    @property
    def total(self) -> float:
        return self.compute * (1 + self.bubble) + self.tp + self.pp + self.dp + self.ep + self.cp


def iteration_time(job: TrainingJob, config: ParallelConfig, hw: Hardware) -> IterationTime:
    """Estimated time of one step of ``config`` (for ranking candidates only).

    - compute: FLOPs of the global batch over ``world`` devices.
    - bubble: ``(pp-1) / (vpp * m)`` of the ideal time for ``m`` micro-batches per pipeline
      (megatron's interleaved schedule shrinks 1F1B's bubble by vpp).
    - tp: 4 all-reduces of a micro-batch's activations per layer (intra-node).
    - pp: a send and a receive of a micro-batch's activations per micro-batch and model chunk
      (vpp times the messages; inter-node).
    - dp: the gradient all-reduce, dense gradients over dp x cp, expert gradients over the
      expert-dp group (intra-node while a group fits in a node).
    - ep: the token dispatcher's all-to-all: a micro-batch's routed tokens (``(s/cp) * b *
      topk`` of ``h`` bf16 values) leave for the other ep ranks, ``(ep-1)/ep`` of them, on
      dispatch and on combine, in forward and backward: 4 per MoE layer and micro-batch,
      intra-node when the ep group (``tp * ep`` consecutive ranks) fits in a node.
    - cp: ring attention's K/V exchange: each rank passes its K and V chunk (``2 * (s/cp) * b
      * groups * head_dim / tp`` bf16 values) ``cp-1`` times forward and twice that backward
      (K/V again and their gradients), per layer and micro-batch, intra-node when the cp
      group (``tp * cp`` consecutive ranks) fits.
    """
    m = job.model
    tp, pp, dp, cp, ep, vpp = config.tp, config.pp, config.dp, config.cp, config.ep, config.vpp
    tokens = job.global_batch * m.seq_length
    microbatches = job.global_batch // (job.micro_batch * dp)
    compute = _flops_per_token(m) * tokens / (config.world * hw.tflops * 1e12)
    bubble = (pp - 1) / (vpp * microbatches)
    seq = m.seq_length // cp
    act = seq * job.micro_batch * m.hidden * WIRE_BYTES
    t_tp = 0.0
    if tp > 1:
        per_allreduce = 2 * (tp - 1) / tp * act / (hw.intra_node_gbps * 1e9)
        t_tp = 4 * (m.num_layers / pp) * microbatches * per_allreduce
    t_pp = 2 * vpp * microbatches * act / (hw.inter_node_gbps * 1e9) if pp > 1 else 0.0
    t_dp = 0.0
    dense, experts, _ = _fullest_stage(job, config)
    # with ep = 1 the experts' gradients are reduced with the dense ones, over dp x cp
    reduced = ([(config.dp_cp, dense + experts)] if ep == 1
               else [(config.dp_cp, dense), (config.expert_dp, experts)])
    bw = _link(hw, tp * dp * cp)
    for ranks, params in reduced:
        if ranks > 1:
            t_dp += 2 * (ranks - 1) / ranks * params * DTYPE_BYTES[m.param_dtype] / (bw * 1e9)
    t_ep = 0.0
    if ep > 1:
        routed = seq * job.micro_batch * m.topk * m.hidden * WIRE_BYTES
        t_ep = 4 * (m.num_layers / pp) * microbatches * (ep - 1) / ep * routed / (
            _link(hw, tp * ep) * 1e9)
    t_cp = 0.0
    if cp > 1:
        kv = 2 * seq * job.micro_batch * m.query_groups * m.kv_channels / tp * WIRE_BYTES
        t_cp = 3 * (cp - 1) * (m.num_layers / pp) * microbatches * kv / (
            _link(hw, tp * cp) * 1e9)
    return IterationTime(compute, bubble, t_tp, t_pp, t_dp, t_ep, t_cp)


def _link(hw: Hardware, span: int) -> float:
    """GB/s per device of a group spanning ``span`` consecutive ranks."""
    return hw.intra_node_gbps if span <= hw.gpus_per_node else hw.inter_node_gbps


def tokens_per_second(job: TrainingJob, config: ParallelConfig, hw: Hardware) -> float:
    """Estimated training throughput of ``config`` (for ranking candidates only): the global
    batch's tokens over :func:`iteration_time`. Nothing overlaps: the estimate is
    conservative for every candidate alike."""
    return job.global_batch * job.model.seq_length / iteration_time(job, config, hw).total


def schedule_problem(job: TrainingJob, config: ParallelConfig) -> str | None:
    """Why megatron-core's pipeline schedule cannot run ``config`` on this batch, or None.

    The interleaved schedule (vpp > 1) runs micro-batches in groups of
    ``microbatch_group_size_per_vp_stage`` (default pp) and refuses a last group smaller
    than pp (``forward_backward_pipelining_with_interleaving`` in schedules.py): the
    micro-batches per pipeline must be a multiple of pp.
    """
    microbatches = job.global_batch // (job.micro_batch * config.dp)
    if config.vpp > 1 and microbatches % config.pp:
        return (f"vpp ({config.vpp}) needs the micro-batches per pipeline ({microbatches} = "
                f"{job.global_batch} / ({job.micro_batch} x dp {config.dp})) to be a "
                f"multiple of pp ({config.pp})")
    return None


def _vpps(job: TrainingJob, pp: int) -> list[int]:
    """Model chunks per pipeline rank to consider: those that split the layers evenly."""
    layers = job.model.num_layers
    if "vpp" not in job.supports or pp == 1:
        return [1]
    return [v for v in range(1, layers // pp + 1) if layers % (pp * v) == 0]


def _cps(job: TrainingJob, most: int) -> list[int]:
    """Context-parallel degrees to consider, up to ``most``: megatron's load-balanced CP
    splits every sequence into 2 x cp chunks."""
    seq = job.model.seq_length
    if "cp" not in job.supports:
        return [1]
    return [c for c in range(1, max(1, min(most, seq // 2)) + 1) if c == 1 or seq % (2 * c) == 0]


def _eps(job: TrainingJob, dp_cp: int) -> list[int]:
    """Expert-parallel degrees to consider: mixture-of-experts models only; ep divides the
    experts and dp x cp."""
    experts = job.model.num_experts or 1
    if "ep" not in job.supports or experts == 1:
        return [1]
    return [e for e in range(1, experts + 1) if experts % e == 0 and dp_cp % e == 0]


def _divisors(n: int) -> list[int]:
    """Every divisor of ``n`` >= 1, ascending, in O(sqrt n) (the global batch in sequences
    runs to millions at 16,384 ranks: a pass over 1..n took 60 ms a decision)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def candidates(job: TrainingJob, hw: Hardware, node_counts: Sequence[int], *,
               allowed_tp: Collection[int] | None = None,
               allowed_pp: Collection[int] | None = None,
               max_nodes: int | None = None,
               tp_in_node: bool = True) -> list[Candidate]:
    """Every configuration the devices can run, with its estimates, best first.

    ep, vpp and cp other than 1 are considered only where ``job.supports`` names them.

    Args:
        job: model and batch.
        hw: device and link figures.
        node_counts: devices available on each node.
        allowed_tp, allowed_pp: admin policy (None: any).
        max_nodes: admin policy limit on nodes.
        tp_in_node: tensor-parallel groups stay inside a node (the compact allocator);
            False counts devices only, as a first-fit allocator does.
    """
    m = job.model
    G = hw.gpus_per_node
    budget = hw.memory_gib * GIB - hw.reserved_gib * GIB
    total = sum(node_counts)
    if max_nodes is not None:
        total = min(total, max_nodes * G)
    steps = job.global_batch // job.micro_batch
    dps = _divisors(steps)  # dp keeps the global batch
    out: list[Candidate] = []
    for tp in range(1, G + 1):
        if G % tp or (allowed_tp is not None and tp not in allowed_tp):
            continue
        if tp > 1 and m.moe and not job.sequence_parallel:
            continue
        room = capacity(node_counts, tp, max_nodes) if tp_in_node else total
        for pp in range(1, m.num_layers + 1):
            if allowed_pp is not None and pp not in allowed_pp:
                continue
            if tp * pp > room:
                break
            try:
                ParallelConfig(1, tp, pp).validate_for(m)
            except ConfigError:
                continue
            for vpp, cp in product(_vpps(job, pp), _cps(job, room // (tp * pp))):
                for dp in dps:
                    if dp * cp * tp * pp > room:
                        break
                    for ep in _eps(job, dp * cp):
                        config = ParallelConfig(dp, tp, pp, job.distributed_optimizer,
                                                ep=ep, cp=cp, vpp=vpp)
                        if schedule_problem(job, config) is not None:
                            continue
                        need = memory_bytes(job, config)
                        if need <= budget:
                            out.append(Candidate(config, tokens_per_second(job, config, hw),
                                                 need))
    out.sort(key=lambda c: (-c.tokens_per_s, c.config))
    return out


def choose_config(job: TrainingJob, hw: Hardware, node_counts: Sequence[int], *,
                  allowed_tp: Collection[int] | None = None,
                  allowed_pp: Collection[int] | None = None,
                  max_nodes: int | None = None,
                  tp_in_node: bool = True,
                  migration_cost: Callable[[ParallelConfig], int] | None = None,
                  survives_loss: Callable[[ParallelConfig], bool] | None = None,
                  tolerance: float = TOLERANCE) -> Choice:
    """The best configuration for the devices (see module docstring).

    Args:
        migration_cost: bytes the planner would move to reach a configuration (None: a
            first start, nothing to move). Asked only for the near-equal candidates.
        survives_loss: whether a configuration, placed as it would be, keeps a copy of
            every shard when any one node is lost (:func:`survives_node_loss`). Of the
            near-equal candidates those that do come first (then the fewest bytes); asked
            only when there are several.
        tolerance: relative throughput gap under which candidates count as near-equal.
        Other arguments as for ``candidates``.

    Raises:
        ConfigError: no configuration fits, with what limited it.
    """
    cands = candidates(job, hw, node_counts, allowed_tp=allowed_tp, allowed_pp=allowed_pp,
                       max_nodes=max_nodes, tp_in_node=tp_in_node)
    if not cands:
        raise ConfigError(
            f"no parallel configuration of {job.model.name} fits {sum(node_counts)} devices "
            f"on {len(node_counts)} node(s) with {hw.memory_gib:g} GiB each "
            f"(global batch {job.global_batch}, allowed tp {_fmt(allowed_tp)}, "
            f"pp {_fmt(allowed_pp)}; beyond dp/tp/pp: {_fmt_names(job.supports)})")
    top = cands[0].tokens_per_s
    near = [c for c in cands if c.tokens_per_s >= (1 - tolerance) * top]
    by_bytes = migration_cost is not None and len(near) > 1
    if by_bytes:
        assert migration_cost is not None
        near = [Candidate(c.config, c.tokens_per_s, c.memory_bytes, migration_cost(c.config))
                for c in near]
        near.sort(key=lambda c: (c.moved_bytes, -c.tokens_per_s, c.config))
    exposed = ({c.config for c in near if not survives_loss(c.config)}
               if survives_loss is not None and len(near) > 1 else set())
    safer = 0 < len(exposed) < len(near)
    if safer:  # those that survive a node loss first, each side in the order above
        near.sort(key=lambda c: c.config in exposed)
    survives = (f", keeps a copy of every shard when a node is lost (of {len(near)}, "
                f"{len(exposed)} would not)" if safer else "")
    if by_bytes:
        why = (f"{near[0].config} is within {tolerance:.0%} of the best throughput{survives} "
               f"and moves the fewest bytes of {len(near) - len(exposed) if safer else len(near)}"
               " near-equal configurations")
    elif safer:
        why = f"{near[0].config} is within {tolerance:.0%} of the best throughput{survives}"
    else:
        why = f"{near[0].config} has the best estimated throughput of {len(cands)} candidates"
    return Choice(near[0], tuple(near), len(cands), why)


def survives_node_loss(config: ParallelConfig, nodes: Sequence[str]) -> bool:
    """Whether losing any one node leaves a copy of every shard: ``nodes[r]`` is the node
    rank r runs on, and each holding class (the ranks that hold one shard: dp x cp, over ep
    for expert shards, of them; dense shards have at least as many) must span two nodes or
    more. A layout without replicas (dp x cp / ep = 1) never does."""
    if config.replicas < 2:
        return False
    return all(len({nodes[config.rank_of(cls, x)] for x in range(config.replicas)}) >= 2
               for cls in range(config.classes))


def _fmt(values: Collection[int] | None) -> str:
    return "any" if values is None else ",".join(map(str, sorted(values)))


def _fmt_names(names: Collection[str]) -> str:
    return ",".join(n for n in EXTRA_DEGREES if n in names) or "none"

"""Configuration chooser: the ParallelConfig a job runs next on the devices it holds.

A candidate must be valid for the model, keep the global batch size (dp * micro_batch
divides it, so only gradient accumulation changes), keep tensor-parallel groups inside a
node, be placeable on the devices (``capacity``), fit device memory, and respect the
admin's allowed tp/pp and node limit. The chooser ranks candidates by an analytic
throughput estimate; among those within ``tolerance`` of the best it takes the one the
planner says moves the fewest bytes.

The estimates are deliberately simple (stated per function) and only used to rank
candidates against each other; they are not performance predictions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Collection, Sequence

from ..plan.catalog import FIRST, LAST, Catalog, build_catalog
from ..plan.config import ParallelConfig
from ..plan.errors import ConfigError
from ..plan.model import DTYPE_BYTES, ModelDesc
from .vranks import capacity

GIB = 1024 ** 3

# Candidates whose estimated throughput is within this fraction of the best are "near-equal":
# the cheapest migration wins among them.
TOLERANCE = 0.03


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
    """

    model: ModelDesc
    global_batch: int
    micro_batch: int = 1
    distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.micro_batch < 1:
            raise ConfigError(f"global_batch ({self.global_batch}) and micro_batch "
                              f"({self.micro_batch}) must be positive")
        if self.global_batch % self.micro_batch:
            raise ConfigError(f"micro_batch ({self.micro_batch}) must divide global_batch "
                              f"({self.global_batch})")


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


@lru_cache(maxsize=4096)
def _stage_numbers(model: ModelDesc, distributed_optimizer: bool, tp: int, pp: int,
                   stage: int) -> tuple[float, float, float]:
    """(parameters, state bytes, dp-sharded state bytes) one rank of ``stage`` holds.

    Exact per the planner's shard catalog; gradients add one param-dtype copy of the
    parameters. The dp-sharded part (distributed optimizer) is divided by dp by the caller.
    """
    catalog = _catalog(model, distributed_optimizer)
    grad_bytes = DTYPE_BYTES[model.param_dtype]
    params = state = sharded = 0.0
    for g in catalog.groups:
        if (g.stage == FIRST and stage != 0) or (g.stage == LAST and stage != pp - 1):
            continue
        numel = g.numel / (tp if g.tp_axis is not None else 1)
        if g.stacked:
            numel /= pp
        if g.dist:
            sharded += numel * g.bytes_per_element
        else:
            params += numel
            state += numel * (g.bytes_per_element + grad_bytes)
    return params, state, sharded


def _fullest_stage(job: TrainingJob, config: ParallelConfig) -> tuple[float, float]:
    """(parameters, state bytes) of the fullest rank: first or last pipeline stage."""
    per_stage = []
    for p in {0, config.pp - 1}:
        params, state, sharded = _stage_numbers(job.model, job.distributed_optimizer,
                                                config.tp, config.pp, p)
        per_stage.append((state + sharded / config.dp, params))
    state, params = max(per_stage)
    return params, state


def state_bytes_per_device(job: TrainingJob, config: ParallelConfig) -> int:
    """Training state (params, fp32 copies, Adam moments, grads) of the fullest rank.

    The fullest rank is on the first or the last pipeline stage (embedding, output layer).
    """
    return int(_fullest_stage(job, config)[1])


def activation_bytes_per_device(job: TrainingJob, config: ParallelConfig) -> int:
    """Activations of the first stage under 1F1B with selective recomputation.

    Per layer and micro-batch ``s*b*h*(10 + 24/tp)`` bytes (Korthikanti et al. 2022, no
    sequence parallelism); the first stage keeps ``min(pp, micro-batches)`` micro-batches of
    its ``L/pp`` layers in flight.
    """
    m = job.model
    per_layer = m.seq_length * job.micro_batch * m.hidden * (10 + 24 / config.tp)
    microbatches = job.global_batch // (job.micro_batch * config.dp)
    in_flight = min(config.pp, microbatches)
    return int(per_layer * m.num_layers / config.pp * in_flight)


def memory_bytes(job: TrainingJob, config: ParallelConfig) -> int:
    """Estimated peak memory of the fullest device."""
    return state_bytes_per_device(job, config) + activation_bytes_per_device(job, config)


def _flops_per_token(m: ModelDesc) -> float:
    """Forward + backward FLOPs per token: 6 per weight plus attention scores (Narayanan et al.)."""
    L, h, f = m.num_layers, m.hidden, m.ffn_hidden
    per_layer = h * m.qkv_rows + h * h + h * f * (3 if m.swiglu else 2)
    return 6 * (L * per_layer + m.padded_vocab * h) + 12 * L * h * m.seq_length


def tokens_per_second(job: TrainingJob, config: ParallelConfig, hw: Hardware) -> float:
    """Estimated training throughput of ``config`` (for ranking candidates only).

    Iteration time = compute * (1 + pipeline bubble) + tensor-parallel all-reduces
    (4 per layer and micro-batch, intra-node) + pipeline send/recv (inter-node) +
    data-parallel gradient all-reduce (intra-node while a dp group fits in a node).
    Nothing overlaps: the estimate is conservative for every candidate alike.
    """
    m = job.model
    tp, pp, dp = config.tp, config.pp, config.dp
    tokens = job.global_batch * m.seq_length
    microbatches = job.global_batch // (job.micro_batch * dp)
    compute = _flops_per_token(m) * tokens / (config.world * hw.tflops * 1e12)
    bubble = (pp - 1) / microbatches
    act = m.seq_length * job.micro_batch * m.hidden * DTYPE_BYTES["bf16"]
    t_tp = 0.0
    if tp > 1:
        per_allreduce = 2 * (tp - 1) / tp * act / (hw.intra_node_gbps * 1e9)
        t_tp = 4 * (m.num_layers / pp) * microbatches * per_allreduce
    t_pp = 2 * microbatches * act / (hw.inter_node_gbps * 1e9) if pp > 1 else 0.0
    t_dp = 0.0
    if dp > 1:
        grads = _fullest_stage(job, config)[0] * DTYPE_BYTES[m.param_dtype]
        bw = hw.intra_node_gbps if tp * dp <= hw.gpus_per_node else hw.inter_node_gbps
        t_dp = 2 * (dp - 1) / dp * grads / (bw * 1e9)
    return tokens / (compute * (1 + bubble) + t_tp + t_pp + t_dp)


def candidates(job: TrainingJob, hw: Hardware, node_counts: Sequence[int], *,
               allowed_tp: Collection[int] | None = None,
               allowed_pp: Collection[int] | None = None,
               max_nodes: int | None = None,
               tp_in_node: bool = True) -> list[Candidate]:
    """Every configuration the devices can run, with its estimates, best first.

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
    dps = [d for d in range(1, steps + 1) if steps % d == 0]  # dp keeps the global batch
    out: list[Candidate] = []
    for tp in range(1, G + 1):
        if G % tp or (allowed_tp is not None and tp not in allowed_tp):
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
            for dp in dps:
                if dp * tp * pp > room:
                    break
                config = ParallelConfig(dp, tp, pp, job.distributed_optimizer)
                need = memory_bytes(job, config)
                if need <= budget:
                    out.append(Candidate(config, tokens_per_second(job, config, hw), need))
    out.sort(key=lambda c: (-c.tokens_per_s, c.config))
    return out


def choose_config(job: TrainingJob, hw: Hardware, node_counts: Sequence[int], *,
                  allowed_tp: Collection[int] | None = None,
                  allowed_pp: Collection[int] | None = None,
                  max_nodes: int | None = None,
                  tp_in_node: bool = True,
                  migration_cost: Callable[[ParallelConfig], int] | None = None,
                  tolerance: float = TOLERANCE) -> Choice:
    """The best configuration for the devices (see module docstring).

    Args:
        migration_cost: bytes the planner would move to reach a configuration (None: a
            first start, nothing to move). Asked only for the near-equal candidates.
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
            f"pp {_fmt(allowed_pp)})")
    top = cands[0].tokens_per_s
    near = [c for c in cands if c.tokens_per_s >= (1 - tolerance) * top]
    if migration_cost is not None and len(near) > 1:
        near = [Candidate(c.config, c.tokens_per_s, c.memory_bytes, migration_cost(c.config))
                for c in near]
        near.sort(key=lambda c: (c.moved_bytes, -c.tokens_per_s, c.config))
        why = (f"{near[0].config} is within {tolerance:.0%} of the best throughput and moves "
               f"the fewest bytes of {len(near)} near-equal configurations")
    else:
        why = f"{near[0].config} has the best estimated throughput of {len(cands)} candidates"
    return Choice(near[0], tuple(near), len(cands), why)


def _fmt(values: Collection[int] | None) -> str:
    return "any" if values is None else ",".join(map(str, sorted(values)))

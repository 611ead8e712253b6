"""Shard catalog: every state tensor of a model, and how a parallel layout cuts it.

Tensors are described in megatron-core's checkpoint space: per-layer weights are stacked
along a leading layer axis (``decoder.layers.<name>`` with global shape
``(num_layers, ...)``), tensor-parallel weights are split along one axis (SwiGLU's fc1 as two
interleaved halves), and a layout's pipeline rank holds a contiguous range of layers per
virtual pipeline chunk (one range without VPP).

Mixture-of-experts layers add the router (``decoder.layers.mlp.router.weight``, replicated
over tp and ep), the routed experts and an optional shared expert. megatron-core's
``SequentialMLP`` (the expert layer that runs on CPU) names every expert's tensors with one
key and an expert axis after the layer axis: ``decoder.layers.mlp.experts.experts.linear_fc1
.weight`` has global shape ``(layers, experts, 2 x expert_ffn, hidden)``. The catalog folds
the expert axis into the layer axis - ``(layers x experts, 2 x expert_ffn, hidden)``, index
``layer * experts + expert`` - which is the same row-major order, so a box of the folded
tensor is a box of megatron's (``unfold_expert_box``). Experts are sharded over ep (each ep
rank holds ``experts / ep`` consecutive experts), tp-split like a dense MLP (expert tensor
parallelism = tp), and replicated over the expert data-parallel ranks.

States that always share one partition are grouped: a ``TensorGroup`` is one parameter with
its states (param, fp32 main param, Adam moments) that a layout cuts identically. With the
distributed optimizer the fp32 states form a second group, cut by megatron's flat
per-data-parallel-rank ranges instead of replicated over dp.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .config import ParallelConfig
from .model import DTYPE_BYTES, ModelDesc

# Stage placement of a tensor that is not a per-layer weight.
FIRST, LAST, LAYERS = "first", "last", "layers"


@dataclass(frozen=True)
class StateTensor:
    """One concrete state tensor of a group (what the executor moves)."""

    key: str
    itemsize: int


@dataclass(frozen=True)
class TensorGroup:
    """States of one parameter that every layout cuts the same way.

    Attributes:
        param: megatron-core's sharded_state_dict key of the parameter.
        shape: global shape; per-layer weights lead with the layer axis.
        stacked: axis 0 is the layer axis (``decoder.layers.*``).
        tp_axis: axis split over tensor-parallel ranks, or None if replicated over tp.
        swiglu: tp split as two halves (gate, up), each cut into tp fragments.
        stage: LAYERS for stacked weights, FIRST or LAST for the others.
        dist: cut by the distributed optimizer's flat dp ranges (else replicated over dp).
        states: the tensors moved together for this group.
        order: registration index of the parameter in the model (buffer order).
        experts: routed experts when axis 0 is the folded (layer, expert) axis, else 0:
            sharded over ep, replicated (and with the distributed optimizer sharded) over
            the expert data-parallel ranks.
    """

    param: str
    shape: tuple[int, ...]
    stacked: bool
    tp_axis: int | None
    swiglu: bool
    stage: str
    dist: bool
    states: tuple[StateTensor, ...]
    order: int
    experts: int = 0

    @property
    def name(self) -> str:
        return self.param + ("#dist" if self.dist else "")

    @property
    def expert(self) -> bool:
        return self.experts > 0

    @cached_property
    def bytes_per_element(self) -> int:
        return sum(s.itemsize for s in self.states)

    @cached_property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.bytes_per_element


@dataclass(frozen=True)
class Catalog:
    model: ModelDesc
    distributed_optimizer: bool
    groups: tuple[TensorGroup, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of unique training state (one copy of every tensor)."""
        return sum(g.nbytes for g in self.groups if not g.param.endswith(TIED_SUFFIX))

    def index(self, name: str) -> int:
        return [g.name for g in self.groups].index(name)


# The last pipeline stage's copy of a tied word embedding (megatron's output layer weight,
# a replica of embedding.word_embeddings.weight). Planned as its own tensor so a layout's
# holdings never overlap partially.
TIED_SUFFIX = "@output_layer"


EXPERT_PREFIX = "decoder.layers.mlp.experts.experts."

Spec = tuple[str, tuple[int, ...], bool, int | None, bool, str, int]


def unfold_expert_box(g: TensorGroup, lo: tuple[int, ...], hi: tuple[int, ...]
                      ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A box of an expert group over one layer in megatron's axes ``(layer, expert, ...)``.

    Raises:
        ValueError: the box spans more than one layer (it is then not one megatron box).
    """
    layer, first = divmod(lo[0], g.experts)
    last_layer, end = divmod(hi[0] - 1, g.experts)
    if last_layer != layer:
        raise ValueError(f"{g.param}: box {lo}..{hi} spans layers {layer}..{last_layer}")
    rest = len(g.shape) - 1
    return (layer, first, *lo[1:1 + rest]), (layer + 1, end + 1, *hi[1:1 + rest])


def _param_specs(m: ModelDesc) -> list[Spec]:
    """(key, global shape, stacked, tp_axis, swiglu, stage, experts) in registration order."""
    L, h, f = m.num_layers, m.hidden, m.ffn_hidden
    attn = m.attention_width
    bias = m.add_bias_linear
    norm_bias = not m.rmsnorm
    specs: list[Spec] = []

    def add(key: str, shape: tuple[int, ...], tp_axis: int | None = None, swiglu: bool = False,
            stage: str = LAYERS, experts: int = 0) -> None:
        stacked = stage == LAYERS
        full = ((L * experts if experts else L), *shape) if stacked else tuple(shape)
        axis = None if tp_axis is None else tp_axis + (1 if stacked else 0)
        specs.append((key, full, stacked, axis, swiglu, stage, experts))

    def mlp(prefix: str, ffn: int, experts: int = 0) -> None:
        rows = 2 * ffn if m.swiglu else ffn
        add(prefix + "linear_fc1.weight", (rows, h), tp_axis=0, swiglu=m.swiglu,
            experts=experts)
        if bias:
            add(prefix + "linear_fc1.bias", (rows,), tp_axis=0, swiglu=m.swiglu,
                experts=experts)
        add(prefix + "linear_fc2.weight", (h, ffn), tp_axis=1, experts=experts)
        if bias:
            add(prefix + "linear_fc2.bias", (h,), experts=experts)

    add("embedding.word_embeddings.weight", (m.padded_vocab, h), tp_axis=0, stage=FIRST)
    if m.learned_position_embeddings:
        add("embedding.position_embeddings.weight", (m.seq_length, h), stage=FIRST)
    pre = "decoder.layers."
    # megatron-core names the norms in the checkpoint as Transformer Engine's fused layers do
    add(pre + "self_attention.linear_qkv.layer_norm_weight", (h,))
    if norm_bias:
        add(pre + "self_attention.linear_qkv.layer_norm_bias", (h,))
    add(pre + "self_attention.linear_qkv.weight", (m.qkv_rows, h), tp_axis=0)
    if bias:
        add(pre + "self_attention.linear_qkv.bias", (m.qkv_rows,), tp_axis=0)
    add(pre + "self_attention.linear_proj.weight", (h, attn), tp_axis=1)
    if bias:
        add(pre + "self_attention.linear_proj.bias", (h,))
    if m.qk_layernorm:
        for which in ("q", "k"):
            add(pre + f"self_attention.{which}_layernorm.weight", (m.kv_channels,))
            if norm_bias:
                add(pre + f"self_attention.{which}_layernorm.bias", (m.kv_channels,))
    # the pre-MLP norm keeps the dense key in MoE layers too (the layer's keys map)
    add(pre + "mlp.linear_fc1.layer_norm_weight", (h,))
    if norm_bias:
        add(pre + "mlp.linear_fc1.layer_norm_bias", (h,))
    if m.num_experts is None:
        mlp(pre + "mlp.", f)
    else:
        add(pre + "mlp.router.weight", (m.num_experts, h))
        mlp(EXPERT_PREFIX, m.expert_ffn_size, experts=m.num_experts)
        if m.shared_expert_ffn:
            mlp(pre + "mlp.shared_experts.", m.shared_expert_ffn)
    add("decoder.final_layernorm.weight", (h,), stage=LAST)
    if norm_bias:
        add("decoder.final_layernorm.bias", (h,), stage=LAST)
    if m.tied_embeddings:
        add("embedding.word_embeddings.weight" + TIED_SUFFIX, (m.padded_vocab, h), tp_axis=0,
            stage=LAST)
    else:
        add("output_layer.weight", (m.padded_vocab, h), tp_axis=0, stage=LAST)
    return specs


def build_catalog(model: ModelDesc, config: ParallelConfig | bool) -> Catalog:
    """The model's state tensors, grouped by how a layout cuts them.

    Args:
        model: the model description.
        config: a ParallelConfig (only its ``distributed_optimizer`` flag matters) or the flag.

    Mixed precision (bf16 params) keeps bf16 params plus fp32 main params and Adam moments;
    fp32 keeps params and Adam moments. With the distributed optimizer the fp32 states are a
    separate group cut by dp ranges.
    """
    dist = config if isinstance(config, bool) else config.distributed_optimizer
    p_bytes = DTYPE_BYTES[model.param_dtype]
    groups: list[TensorGroup] = []
    for order, (key, shape, stacked, tp_axis, swiglu, stage, experts) in enumerate(
            _param_specs(model)):
        opt = [StateTensor(f"optimizer.state.{name}.{key}", 4)
               for name in (("fp32_param",) if model.mixed_precision else ()) + ("exp_avg",
                                                                                  "exp_avg_sq")]
        param = StateTensor(key, p_bytes)
        cuts = ([(False, (param,)), (True, tuple(opt))] if dist
                else [(False, (param, *opt))])
        groups.extend(TensorGroup(param=key, shape=shape, stacked=stacked, tp_axis=tp_axis,
                                  swiglu=swiglu, stage=stage, dist=by_dp, states=states,
                                  order=order, experts=experts)
                      for by_dp, states in cuts)
    groups.sort(key=lambda g: g.name)
    return Catalog(model=model, distributed_optimizer=dist, groups=tuple(groups))

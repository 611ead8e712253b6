"""The shard catalog of a user's live megatron-core model.

A preset or model JSON (``ModelDesc``) plans without building anything. A running job plans
from what it actually built: :func:`model_desc_of` reads the description off the live
``TransformerConfig`` and ``GPTModel``, and :func:`check_catalog` holds the catalog built from
it against the model's own ``sharded_state_dict()`` metadata (every key, every global shape),
so a model the catalog does not describe is refused before anything moves.
"""
from __future__ import annotations

from typing import Any

from slurm_etc.plan.catalog import TIED_SUFFIX, Catalog
from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import ModelDesc
from slurm_etc.plan.regions import chunk_layers

from .shards import iter_sharded_tensors

EMBEDDING = "embedding.word_embeddings.weight"


def _chunks(gpt: Any) -> list[Any]:
    """A GPTModel, or the list of a rank's virtual pipeline chunks, as a list."""
    return list(gpt) if isinstance(gpt, (list, tuple)) else [gpt]


def model_desc_of(tf_config: Any, gpt: Any, name: str = "user-model") -> ModelDesc:
    """The ModelDesc of a built GPTModel (or of every virtual pipeline chunk of a rank, a
    list) and its TransformerConfig.

    Raises:
        ConfigError: a feature the catalog does not describe (fp16, multi-token
            prediction, a vocabulary padded by something other than the model), or chunks
            that describe different models.
    """
    chunks = _chunks(gpt)
    if not chunks:
        raise ConfigError("the model provider built no model")
    descs = [_desc_of(tf_config, g, name) for g in chunks]
    for v, desc in enumerate(descs[1:], 1):
        if desc != descs[0]:
            differ = sorted(k for k, x in vars(desc).items() if vars(descs[0])[k] != x)
            raise ConfigError(f"virtual pipeline chunk {v} of the model differs from chunk 0 "
                              f"in {', '.join(differ)}")
    return descs[0]


def _desc_of(tf_config: Any, gpt: Any, name: str) -> ModelDesc:
    if getattr(tf_config, "fp16", False):
        raise ConfigError("fp16 models are not supported (use bf16 or fp32)")
    if getattr(tf_config, "mtp_num_layers", None):
        raise ConfigError("multi-token prediction layers are not supported yet")
    position = getattr(gpt, "position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope"):
        raise ConfigError(f"position embedding {position!r} is not supported "
                          "(learned_absolute, rope)")
    kv = getattr(tf_config, "kv_channels", None)
    return ModelDesc(
        name=name,
        # channels per head set apart from hidden / heads (Qwen3): None where it is that
        head_dim=kv if kv and kv * tf_config.num_attention_heads != tf_config.hidden_size
        else None,
        qk_layernorm=bool(getattr(tf_config, "qk_layernorm", False)),
        num_layers=tf_config.num_layers,
        hidden=tf_config.hidden_size,
        ffn_hidden=tf_config.ffn_hidden_size,
        num_heads=tf_config.num_attention_heads,
        num_query_groups=tf_config.num_query_groups,
        vocab_size=gpt.vocab_size,
        vocab_divisor=1,  # GPTModel holds the padded vocabulary already
        seq_length=gpt.max_sequence_length,
        swiglu=bool(tf_config.gated_linear_unit),
        rmsnorm=tf_config.normalization == "RMSNorm",
        add_bias_linear=bool(tf_config.add_bias_linear),
        learned_position_embeddings=position == "learned_absolute",
        tied_embeddings=bool(gpt.share_embeddings_and_output_weights),
        param_dtype="bf16" if tf_config.bf16 else "fp32",
        **_moe_fields(tf_config),
    )


def _moe_fields(tf_config: Any) -> dict:
    """A mixture of experts' fields of the ModelDesc (none for a dense model)."""
    experts = getattr(tf_config, "num_moe_experts", None)
    if not experts:
        return {}
    return {"num_experts": experts, "router_topk": tf_config.moe_router_topk,
            "expert_ffn": getattr(tf_config, "moe_ffn_hidden_size", None),
            "shared_expert_ffn": getattr(tf_config, "moe_shared_expert_intermediate_size",
                                         None)}


def check_chunk_layers(gpt: Any, config: ParallelConfig, pipeline_rank: int) -> None:
    """With vpp > 1, each virtual pipeline chunk of pipeline rank ``pipeline_rank`` holds the
    layers megatron's interleaving puts there (``chunk_layers``): the catalog cannot tell, since
    every chunk's tensors have the same keys and shapes, and a provider that does not pass
    ``vp_stage`` on to ``GPTModel`` builds chunk 0's layers in every chunk.

    Raises:
        ConfigError: naming the first chunk whose layers differ.
    """
    if config.vpp == 1:
        return
    chunks = _chunks(gpt)
    if len(chunks) != config.vpp:
        raise ConfigError(f"the model provider built {len(chunks)} model chunks for vpp "
                          f"({config.vpp})")
    for v, chunk in enumerate(chunks):
        layers = getattr(getattr(chunk, "decoder", None), "layers", None)
        if layers is None:
            continue  # not a megatron TransformerBlock: the catalog check judges it
        num_layers = chunk.config.num_layers
        lo, hi = chunk_layers(num_layers, config.pp, config.vpp, pipeline_rank, v)
        got = [int(layer.layer_number) - 1 for layer in layers]
        if got != list(range(lo, hi)):
            raise ConfigError(f"virtual pipeline chunk {v} of pipeline rank {pipeline_rank} "
                              f"holds layers {_span(got)}, megatron's interleaving puts layers "
                              f"{_span(list(range(lo, hi)))} there: the model provider must "
                              "pass vp_stage to GPTModel")


def _span(layers: list[int]) -> str:
    """0-based layers as a short text: ``2-3``, ``5``, ``[]``."""
    if not layers:
        return "[]"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))


def check_catalog(catalog: Catalog, gpt: Any) -> None:
    """Every ShardedTensor of this rank's model (a GPTModel, or the list of its virtual
    pipeline chunks) is a catalog tensor of the same global shape.

    Raises:
        ConfigError: naming the first tensor that differs.
    """
    # an expert group's first axis is megatron's (layer, expert) folded (catalog.py)
    shapes = {g.param: ((g.shape[0] // g.experts, g.experts, *g.shape[1:]) if g.expert
                        else tuple(g.shape)) for g in catalog.groups}
    for chunk in _chunks(gpt):
        _check_chunk(catalog, chunk, shapes)


def _check_chunk(catalog: Catalog, gpt: Any, shapes: dict[str, tuple]) -> None:
    out_layer = getattr(gpt, "output_layer", None)
    out_weight = getattr(out_layer, "weight", None)
    for _path, sh in iter_sharded_tensors(gpt.sharded_state_dict()):
        key = sh.key
        if key == EMBEDDING and out_weight is not None and sh.data is not None \
                and sh.data.untyped_storage().data_ptr() == \
                out_weight.untyped_storage().data_ptr() and catalog.model.tied_embeddings \
                and getattr(gpt, "pre_process", True) is False:
            key += TIED_SUFFIX
        if key not in shapes:
            raise ConfigError(f"the model has tensor {sh.key!r}, which the catalog of "
                              f"{catalog.model.name} does not describe")
        if tuple(sh.global_shape) != shapes[key]:
            raise ConfigError(f"{sh.key}: the model's global shape is "
                              f"{tuple(sh.global_shape)}, the catalog says {shapes[key]}")

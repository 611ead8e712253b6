"""Model descriptions (GPT / Llama family) and the presets the CLI knows.

A ``ModelDesc`` holds exactly what the shard catalog needs to reproduce the tensors that
megatron-core's ``GPTModel.sharded_state_dict()`` reports, without building the model.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .. import bounds
from .errors import ConfigError

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelDesc:
    """A decoder-only transformer as megatron-core builds it with the local layer spec.

    Attributes:
        num_layers: transformer layers.
        hidden: hidden size.
        ffn_hidden: MLP inner size (per gate half for SwiGLU).
        num_heads: attention heads.
        num_query_groups: key/value groups (GQA); ``None`` means one per head.
        vocab_size: vocabulary before padding; padded to ``vocab_divisor``.
        seq_length: maximum sequence length (learned position embeddings only).
        swiglu: gated linear unit MLP (Llama) instead of GELU (GPT).
        rmsnorm: RMSNorm (no bias) instead of LayerNorm.
        add_bias_linear: biases on linear layers.
        learned_position_embeddings: GPT-style position table; otherwise rotary.
        tied_embeddings: output layer shares the word embedding weight.
        param_dtype: ``fp32`` (Adam state in fp32 too) or ``bf16`` (mixed precision:
            bf16 params, fp32 main params, fp32 Adam moments).
        vocab_divisor: megatron's ``make_vocab_size_divisible_by``.
        head_dim: channels per attention head (megatron's ``kv_channels``); ``None`` means
            ``hidden // num_heads``. Qwen3 sets it apart (128 with 64 heads of a 4,096 hidden).
        qk_layernorm: a norm on each head's queries and keys (Qwen3).
        num_experts: routed experts in every layer's MLP (megatron's ``num_moe_experts``);
            ``None`` is a dense model. Every layer is a mixture-of-experts layer.
        router_topk: experts each token is routed to (megatron's ``moe_router_topk``);
            ``None`` means megatron's default, 2.
        expert_ffn: inner size of each routed expert (``moe_ffn_hidden_size``); ``None``
            means ``ffn_hidden``.
        shared_expert_ffn: inner size of the shared expert every token also passes through
            (``moe_shared_expert_intermediate_size``); ``None`` means none.
    """

    name: str
    num_layers: int
    hidden: int
    ffn_hidden: int
    num_heads: int
    vocab_size: int
    num_query_groups: int | None = None
    seq_length: int = 2048
    swiglu: bool = False
    rmsnorm: bool = False
    add_bias_linear: bool = True
    learned_position_embeddings: bool = True
    tied_embeddings: bool = True
    param_dtype: str = "bf16"
    vocab_divisor: int = 128
    head_dim: int | None = None
    qk_layernorm: bool = False
    num_experts: int | None = None
    router_topk: int | None = None
    expert_ffn: int | None = None
    shared_expert_ffn: int | None = None

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden", "ffn_hidden", "num_heads", "vocab_size", "seq_length",
                  "vocab_divisor"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model {self.name}: {f} must be a positive integer, "
                                  f"got {value!r}")
        for f in ("swiglu", "rmsnorm", "add_bias_linear", "learned_position_embeddings",
                  "tied_embeddings", "qk_layernorm"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"model {self.name}: {f} must be true or false, "
                                  f"got {getattr(self, f)!r}")
        for f in ("num_query_groups", *OPTIONAL_SIZES):
            value = getattr(self, f)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(f"model {self.name}: {f} must be a positive integer or "
                                  f"null, got {value!r}")
        self._check_bounds()
        self._check_experts()
        if self.head_dim is None and self.hidden % self.num_heads:
            raise ConfigError(f"model {self.name}: num_heads ({self.num_heads}) must divide "
                              f"hidden ({self.hidden})")
        groups = self.query_groups
        if groups <= 0 or self.num_heads % groups:
            raise ConfigError(f"model {self.name}: num_query_groups ({groups}) must divide "
                              f"num_heads ({self.num_heads})")
        if self.param_dtype not in DTYPE_BYTES or self.param_dtype == "fp16":
            raise ConfigError(f"model {self.name}: param_dtype must be 'fp32' or 'bf16', "
                              f"got {self.param_dtype!r}")

    def _check_experts(self) -> None:
        """The expert fields make sense together (after their bounds are checked)."""
        if self.num_experts is None:
            given = [f for f in ("router_topk", "expert_ffn", "shared_expert_ffn")
                     if getattr(self, f) is not None]
            if given:
                raise ConfigError(f"model {self.name}: {', '.join(given)} needs num_experts "
                                  "(a mixture-of-experts model); leave it out for a dense one")
        elif self.topk > self.num_experts:
            raise ConfigError(f"model {self.name}: router_topk ({self.topk}) must be at most "
                              f"num_experts ({self.num_experts})")

    def _check_bounds(self) -> None:
        """Every size within its bound, and the parameter count (layers x hidden x ...)
        too, before anything multiplies them (a catalog, a plan, an allocation)."""
        try:
            bounds.check_text("model name", self.name, bounds.NAME_CHARS)
            for f, bound in MODEL_BOUNDS.items():
                value = getattr(self, f)
                if value is not None:
                    bound.check(f, value)
            bounds.check_product(
                f"model {self.name}", {"parameters": self.parameter_estimate()},
                bounds.PARAMS)
        except bounds.BoundError as exc:
            name = self.name if bounds.control_character(str(self.name)) is None else "?"
            raise ConfigError(f"model {name}: {exc}") from None

    def parameter_estimate(self) -> int:
        """Weights in all (embeddings, attention, MLP; norms and biases left out): what the
        bound on model size is checked against."""
        h = self.hidden
        per_ffn = (3 if self.swiglu else 2) * h
        if self.num_experts is None:
            mlp = per_ffn * self.ffn_hidden
        else:
            mlp = (self.num_experts * (per_ffn * self.expert_ffn_size + h)
                   + per_ffn * (self.shared_expert_ffn or 0))
        layer = self.qkv_rows * h + self.attention_width * h + mlp
        embed = self.padded_vocab * h * (1 if self.tied_embeddings else 2)
        position = self.seq_length * h if self.learned_position_embeddings else 0
        return self.num_layers * layer + embed + position

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_heads

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden // self.num_heads

    @property
    def attention_width(self) -> int:
        """Columns of the attention output projection: heads x channels per head."""
        return self.num_heads * self.kv_channels

    @property
    def moe(self) -> bool:
        """Whether every layer's MLP is a mixture of experts."""
        return self.num_experts is not None

    @property
    def topk(self) -> int:
        return self.router_topk or 2

    @property
    def expert_ffn_size(self) -> int:
        """Inner size of one routed expert (``ffn_hidden`` unless set apart)."""
        return self.expert_ffn or self.ffn_hidden

    @property
    def qkv_rows(self) -> int:
        return (self.num_heads + 2 * self.query_groups) * self.kv_channels

    @property
    def padded_vocab(self) -> int:
        d = self.vocab_divisor
        return -(-self.vocab_size // d) * d

    @property
    def mixed_precision(self) -> bool:
        return self.param_dtype != "fp32"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object, name: str = "custom") -> "ModelDesc":
        if not isinstance(data, dict):
            raise ConfigError("model description must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model field(s) {', '.join(unknown)}; valid fields: "
                              f"{', '.join(sorted(known))}")
        data = {"name": name, **data}
        try:
            return cls(**data)
        except TypeError as exc:  # missing required fields
            raise ConfigError(f"model description: {exc}") from None



# The bound of every size field: a field added to ModelDesc without one fails
# tests/unit/test_bounds_property.py.
MODEL_BOUNDS: dict[str, bounds.Bound] = {
    "num_layers": bounds.LAYERS, "hidden": bounds.HIDDEN, "ffn_hidden": bounds.FFN,
    "num_heads": bounds.HEADS, "num_query_groups": bounds.HEADS, "vocab_size": bounds.VOCAB,
    "seq_length": bounds.SEQ, "vocab_divisor": bounds.VOCAB_DIVISOR,
    "head_dim": bounds.HIDDEN, "num_experts": bounds.EXPERTS, "router_topk": bounds.ROUTER_TOPK,
    "expert_ffn": bounds.FFN, "shared_expert_ffn": bounds.FFN,
}

# Sizes that may be null (``None``: the default the field's docstring names).
OPTIONAL_SIZES = ("head_dim", "num_experts", "router_topk", "expert_ffn", "shared_expert_ffn")


def _llama(m: ModelDesc) -> ModelDesc:
    """The llama architecture: SwiGLU, RMSNorm, no linear biases, rotary, untied output."""
    return replace(m, swiglu=True, rmsnorm=True, add_bias_linear=False,
                   learned_position_embeddings=False, tied_embeddings=False)


PRESETS: dict[str, ModelDesc] = {
    m.name: m
    for m in [
        ModelDesc("tiny", num_layers=4, hidden=64, ffn_hidden=256, num_heads=4, vocab_size=256,
                  seq_length=64, param_dtype="fp32", vocab_divisor=64),
        _llama(ModelDesc("tiny-llama", num_layers=4, hidden=64, ffn_hidden=128, num_heads=8,
                         num_query_groups=4, vocab_size=256, seq_length=64, param_dtype="fp32",
                         vocab_divisor=64)),
        # ~23M parameters: 280 MB of fp32 Adam training state, for benchmarks on CPU.
        ModelDesc("small", num_layers=6, hidden=512, ffn_hidden=2048, num_heads=8,
                  vocab_size=8192, seq_length=512, param_dtype="fp32"),
        ModelDesc("gpt-1.3b", num_layers=24, hidden=2048, ffn_hidden=8192, num_heads=16,
                  vocab_size=50257, seq_length=2048),
        _llama(ModelDesc("llama-7b", num_layers=32, hidden=4096, ffn_hidden=11008,
                         num_heads=32, vocab_size=32000, seq_length=4096)),
        _llama(ModelDesc("llama-13b", num_layers=40, hidden=5120, ffn_hidden=13824,
                         num_heads=40, vocab_size=32000, seq_length=4096)),
        _llama(ModelDesc("llama-70b", num_layers=80, hidden=8192, ffn_hidden=28672,
                         num_heads=64, num_query_groups=8, vocab_size=32000, seq_length=4096)),
        ModelDesc("gpt-175b", num_layers=96, hidden=12288, ffn_hidden=49152, num_heads=96,
                  vocab_size=50257, seq_length=2048),
        # Mixtures of experts, every layer routed (megatron's SequentialMLP on CPU).
        _llama(ModelDesc("tiny-moe", num_layers=4, hidden=64, ffn_hidden=128, num_heads=4,
                         num_query_groups=2, vocab_size=256, seq_length=64, param_dtype="fp32",
                         vocab_divisor=64, num_experts=4, router_topk=2, expert_ffn=64)),
        # mistralai/Mixtral-8x7B-v0.1 config.json
        _llama(ModelDesc("mixtral-8x7b", num_layers=32, hidden=4096, ffn_hidden=14336,
                         num_heads=32, num_query_groups=8, vocab_size=32000, seq_length=4096,
                         num_experts=8, router_topk=2, expert_ffn=14336)),
        # Qwen/Qwen3-235B-A22B config.json: head_dim 128 apart from hidden / heads, q/k norms
        _llama(ModelDesc("qwen3-235b-a22b", num_layers=94, hidden=4096, ffn_hidden=12288,
                         num_heads=64, num_query_groups=4, head_dim=128, qk_layernorm=True,
                         vocab_size=151936, seq_length=4096, num_experts=128, router_topk=8,
                         expert_ffn=1536)),
    ]
}


def load_model(spec: str) -> ModelDesc:
    """A preset name, or the path of a JSON model description.

    Raises:
        ConfigError: unknown preset, unreadable file or malformed JSON, naming what is valid.
    """
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not path.suffix == ".json" and not path.exists():
        raise ConfigError(f"unknown model {spec!r}; presets: {', '.join(PRESETS)}, "
                          "or the path of a JSON model description")
    try:
        data = bounds.load_json(bounds.read_capped(path))
    except bounds.BoundError as exc:
        raise ConfigError(f"model file {spec}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"model file {spec} nests too deeply to be a model description"
                          ) from None
    except FileNotFoundError:
        raise ConfigError(f"model file {spec} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"model file {spec} is a directory; give a JSON file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read model file {spec}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"model file {spec} is not text (not a JSON model description)"
                          ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model file {spec} is not valid JSON: {exc.msg} at line "
                          f"{exc.lineno} column {exc.colno}") from None
    return ModelDesc.from_json(data, name=data.get("name", path.stem) if isinstance(data, dict)
                               else path.stem)

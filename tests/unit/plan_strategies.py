"""Hypothesis strategies for the planner's property tests: small GPT and Llama models in
which tensor parallelism reaches 2 and 4, the (dp, tp, pp) each can run, and transitions
between two of them."""
from hypothesis import strategies as st

from slurm_etc.plan import ModelDesc

FAMILIES = ("gpt", "llama")


@st.composite
def models(draw, family=None):
    """A small GPT (GELU, LayerNorm, biases, learned positions, one kv group per head) or
    Llama (SwiGLU, RMSNorm, no biases, grouped-query attention) in which tp 2 and 4 divide
    heads, kv groups, ffn and padded vocab, so every family reaches tp > 1."""
    family = family or draw(st.sampled_from(FAMILIES))
    llama = family == "llama"
    heads = draw(st.sampled_from([2, 4]))
    kv = draw(st.sampled_from([2, 4]))
    return ModelDesc(
        f"prop-{family}", num_layers=draw(st.sampled_from([2, 4])), hidden=heads * kv,
        ffn_hidden=draw(st.sampled_from([4, 8, 12])), num_heads=heads,
        num_query_groups=draw(st.sampled_from([g for g in (2, 4) if heads % g == 0])) if llama
        else None,
        vocab_size=draw(st.integers(5, 40)), seq_length=draw(st.integers(1, 6)), swiglu=llama,
        rmsnorm=llama, add_bias_linear=not llama, learned_position_embeddings=not llama,
        tied_embeddings=draw(st.booleans()), param_dtype=draw(st.sampled_from(["fp32", "bf16"])),
        vocab_divisor=4)


def tp_degrees(model):
    return [t for t in (1, 2, 4) if model.query_groups % t == 0 and model.ffn_hidden % t == 0
            and model.padded_vocab % t == 0 and model.num_heads % t == 0]


@st.composite
def configs(draw, model, max_world=8):
    """(dp, tp, pp) of at most ``max_world`` ranks that ``model`` can run."""
    tp = draw(st.sampled_from(tp_degrees(model)))
    pp = draw(st.sampled_from([p for p in (1, 2, 4) if model.num_layers % p == 0
                               and tp * p <= max_world]))
    dp = draw(st.integers(1, min(4, max_world // (tp * pp))))
    return dp, tp, pp


@st.composite
def transitions(draw, family=None, max_world=8):
    """(model, old, new) with old != new: every example is a real resize."""
    model = draw(models(family))
    old = draw(configs(model, max_world))
    new = draw(configs(model, max_world).filter(lambda c: c != old))
    return model, old, new

"""What the elastic trainer asks of a layout with virtual pipeline chunks (vpp > 1), before
it builds anything: a provider that takes ``vp_stage``, micro-batches the interleaved
schedule can group, chunks that hold megatron's interleaved layers. No model is built here
(the chunks are stand-ins with the attributes the checks read)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from slurm_etc.megatron.live import check_chunk_layers, model_desc_of
from slurm_etc.plan import ParallelConfig
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import PRESETS
from slurm_etc.worker.data import BatchError, check_interleaving
from slurm_etc.worker.sequence import ResizeSequence, parse_sequence
from slurm_etc.worker.trainer import ElasticTrainer, SchedulerConfig

pytestmark = pytest.mark.unit


def _trainer(provider) -> ElasticTrainer:
    return ElasticTrainer(model_provider=provider, forward_step=lambda it, m: None,
                          dataset_provider=list, transformer_config=None,
                          optimizer_config=None, scheduler=SchedulerConfig(max_lr=1e-3),
                          global_batch_size=8, micro_batch_size=1, seq_length=16,
                          train_steps=1)


def three(config, pre_process, post_process):
    return None


def megatron_lm(config, pre_process, post_process, vp_stage=None):
    return None


def keywords(config, pre_process, post_process, **kwargs):
    return None


def test_a_provider_without_vp_stage_works_at_vpp_1_and_is_refused_in_one_line_at_vpp_2():
    flat, chunked = ParallelConfig(2, 1, 2), ParallelConfig(2, 1, 2, vpp=2)
    _trainer(three)._check_layout(flat)
    with pytest.raises(ConfigError) as err:
        _trainer(three)._check_layout(chunked)
    assert str(err.value) == (
        "vpp (2) builds one model chunk per virtual pipeline stage: the model provider must "
        "take vp_stage (model_provider(config, pre_process, post_process, vp_stage=None)) "
        "and pass it to GPTModel")
    for provider in (megatron_lm, keywords):
        _trainer(provider)._check_layout(chunked)


def test_the_interleaved_schedule_needs_micro_batches_in_groups_of_pp():
    check_interleaving(8, 1, 2, 2, 2)  # 4 per pipeline, pp 2
    check_interleaving(8, 1, 4, 4, 1)  # no chunks: 1F1B takes any number
    with pytest.raises(BatchError, match=r"^vpp \(2\) needs the micro-batches per pipeline "
                                         r"\(2 = 8 / \(1 x dp 4\)\) to be a multiple of pp "
                                         r"\(4\)$"):
        check_interleaving(8, 1, 4, 4, 2)
    with pytest.raises(BatchError, match="dp=3 cannot keep"):
        check_interleaving(8, 1, 3, 2, 2)
    # the trainer refuses such a layout (a resize to it: before anything moves)
    with pytest.raises(BatchError):
        _trainer(megatron_lm)._check_layout(ParallelConfig(8, 1, 2, vpp=2))
    # so does a sequence
    with pytest.raises(ConfigError, match="multiple of pp"):
        ResizeSequence(PRESETS["tiny"], tuple(parse_sequence(
            "dp=1,tp=1,pp=2 -> dp=2,tp=1,pp=2,vpp=2")), steps=1, global_batch=2)


def _chunk(layers: list[int], num_layers: int = 8) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(num_layers=num_layers),
                           decoder=SimpleNamespace(layers=[SimpleNamespace(layer_number=n + 1)
                                                           for n in layers]))


def test_each_chunk_must_hold_megatrons_interleaved_layers():
    cfg = ParallelConfig(1, 1, 2, vpp=2)  # 8 layers: rank 1 holds 2-3 and 6-7
    check_chunk_layers([_chunk([2, 3]), _chunk([6, 7])], cfg, 1)
    check_chunk_layers([_chunk([0, 1])], ParallelConfig(1, 1, 2), 1)  # vpp 1: not its job
    # a provider that swallowed vp_stage: every chunk built chunk 0's layers
    with pytest.raises(ConfigError) as err:
        check_chunk_layers([_chunk([2, 3]), _chunk([2, 3])], cfg, 1)
    assert str(err.value) == (
        "virtual pipeline chunk 1 of pipeline rank 1 holds layers 2-3, megatron's "
        "interleaving puts layers 6-7 there: the model provider must pass vp_stage to "
        "GPTModel")
    with pytest.raises(ConfigError, match=r"built 1 model chunks for vpp \(2\)"):
        check_chunk_layers([_chunk([2, 3])], cfg, 1)


def test_the_chunks_describe_one_model():
    tf = SimpleNamespace(num_layers=4, hidden_size=64, ffn_hidden_size=256,
                         num_attention_heads=4, num_query_groups=4, kv_channels=16,
                         qk_layernorm=False, gated_linear_unit=False, normalization="LayerNorm",
                         add_bias_linear=True, bf16=False, fp16=False, num_moe_experts=None,
                         mtp_num_layers=None)

    def gpt(**over):
        return SimpleNamespace(**{"vocab_size": 256, "max_sequence_length": 64,
                                  "position_embedding_type": "learned_absolute",
                                  "share_embeddings_and_output_weights": True, **over})

    one = model_desc_of(tf, gpt())
    assert model_desc_of(tf, [gpt(), gpt()]) == one
    with pytest.raises(ConfigError, match=r"^virtual pipeline chunk 1 of the model differs "
                                          r"from chunk 0 in seq_length, vocab_size$"):
        model_desc_of(tf, [gpt(), gpt(vocab_size=512, max_sequence_length=32)])

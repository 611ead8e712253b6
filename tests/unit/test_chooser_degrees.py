"""The layout chooser with ep, vpp and cp: gated by what the runtime builds, by the model
and by megatron-core's rules; the default (nothing beyond dp/tp/pp) chooses as before."""
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_etc.alloc.chooser import (
    GIB,
    Hardware,
    TrainingJob,
    activation_bytes_per_device,
    candidates,
    choose_config,
    iteration_time,
    memory_bytes,
    schedule_problem,
    state_bytes_per_device,
    tokens_per_second,
)
from slurm_etc.plan import PRESETS, ConfigError, ParallelConfig

pytestmark = pytest.mark.unit

ALL = frozenset({"ep", "vpp", "cp"})
HW = Hardware()
BUDGET = (HW.memory_gib - HW.reserved_gib) * GIB
MIXTRAL = PRESETS["mixtral-8x7b"]

# What the chooser chose before it knew ep, vpp and cp (measured on the code of b6593c8):
# (preset, global batch, nodes of 8, distributed optimizer) -> (layout, candidates,
# tokens/s rounded to 3 decimals, memory bytes). Mixture-of-experts presets keep layout,
# candidates and memory; their tokens/s changed on purpose (FLOPs of the routed experts a
# token passes through, not of one dense MLP of ffn_hidden).
BEFORE = {
    ("gpt-1.3b", 512, 1, True): ("dp=8,tp=1,pp=1,dist-opt", 24, 348778.218, 11226183680),
    ("gpt-1.3b", 512, 2, False): ("dp=8,tp=1,pp=2", 43, 668120.79, 14806810624),
    ("gpt-1.3b", 512, 4, True): ("dp=8,tp=1,pp=4,dist-opt", 68, 1262317.779, 5674067968),
    ("llama-7b", 1024, 1, False): ("dp=4,tp=1,pp=2", 16, 68316.755, 72160968704),
    ("llama-7b", 1024, 3, True): ("dp=8,tp=1,pp=2,dist-opt", 32, 135912.273, 36784265216),
    ("llama-7b", 1024, 8, False): ("dp=8,tp=1,pp=8", 66, 503577.235, 33303363584),
    ("llama-70b", 1536, 8, True): ("dp=4,tp=4,pp=4,dist-opt", 15, 47201.141, 73358106624),
    ("llama-70b", 1536, 16, False): ("dp=4,tp=4,pp=8", 22, 92184.07, 78226522112),
    ("llama-70b", 1536, 64, True): ("dp=32,tp=2,pp=8,dist-opt", 122, 360619.391,
                                    78347074560),
    ("gpt-175b", 1536, 64, True): ("dp=8,tp=2,pp=32,dist-opt", 74, 148550.859, 69938930688),
    ("gpt-175b", 1536, 128, False): ("dp=8,tp=4,pp=32", 53, 267733.636, 63277744128),
    ("mixtral-8x7b", 1024, 4, True): ("dp=4,tp=1,pp=8,dist-opt", 22, None, 59806707712),
    ("mixtral-8x7b", 1024, 16, False): ("dp=8,tp=1,pp=16", 36, None, 66791473152),
    ("mixtral-8x7b", 1024, 64, True): ("dp=16,tp=2,pp=16,dist-opt", 102, None, 19016203264),
    ("qwen3-235b-a22b", 2048, 32, True): ("dp=2,tp=2,pp=47,dist-opt", 3, None, 62689850368),
    ("qwen3-235b-a22b", 2048, 256, False): ("dp=8,tp=2,pp=94", 11, None, 59580289024),
}


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_without_capabilities_the_choice_is_todays(case):
    name, batch, nodes, dist = case
    layout, count, tokens, memory = BEFORE[case]
    job = TrainingJob(PRESETS[name], batch, 1, dist)
    choice = choose_config(job, HW, [8] * nodes)
    assert (str(choice.config), choice.considered, choice.best.memory_bytes) == (
        layout, count, memory)
    if tokens is not None:
        assert round(choice.best.tokens_per_s, 3) == tokens
    every = candidates(job, HW, [8] * nodes)
    assert all((c.config.ep, c.config.cp, c.config.vpp) == (1, 1, 1) for c in every)


def test_unknown_capability_is_one_line():
    with pytest.raises(ConfigError, match=r"unknown parallelism\(s\) 'sp': the chooser "
                                          r"considers ep, vpp, cp beyond dp/tp/pp"):
        TrainingJob(MIXTRAL, 1024, supports={"sp"})


def test_moe_takes_ep_where_ep_1_does_not_fit():
    # 64 devices, one pipeline stage, no tensor parallelism: the 46.7 B mixtral state fits
    # only when ep shards the experts.
    pinned = dict(allowed_tp=(1,), allowed_pp=(1,))
    dense_only = TrainingJob(MIXTRAL, 1024, supports=frozenset())
    with pytest.raises(ConfigError, match="beyond dp/tp/pp: none"):
        choose_config(dense_only, HW, [8] * 8, **pinned)
    job = TrainingJob(MIXTRAL, 1024, supports={"ep"})
    choice = choose_config(job, HW, [8] * 8, **pinned)
    assert choice.config == ParallelConfig(64, 1, 1, True, ep=8)
    ep1 = ParallelConfig(64, 1, 1, True)
    assert memory_bytes(job, ep1) == 213_821_555_456 > BUDGET
    assert choice.best.memory_bytes == memory_bytes(job, choice.config) == 55_981_507_328
    assert choice.best.memory_bytes <= BUDGET
    # ep divides the routed experts' bf16 params and grads (4 bytes each, the Adam state is
    # dp-sharded): 32 layers x 8 experts x 3 x 4096 x 14336 weights, 7/8 of them gone
    experts = 32 * 8 * 3 * 4096 * 14336
    assert state_bytes_per_device(job, ep1) - state_bytes_per_device(job, choice.config) == \
        experts * 4 * 7 // 8


def test_dense_models_never_get_ep():
    for name in ("llama-7b", "gpt-1.3b"):
        job = TrainingJob(PRESETS[name], 512, supports=ALL)
        every = candidates(job, HW, [8] * 8)
        assert len(every) > 0 and all(c.config.ep == 1 for c in every)
    moe = candidates(TrainingJob(MIXTRAL, 1024, supports={"ep"}), HW, [8] * 8)
    assert {c.config.ep for c in moe} == {1, 2, 4, 8}  # the model allows it, so it is offered


def test_vpp_where_the_bubble_dominates():
    # llama-70b on 32 nodes with 64 sequences per step: 8 micro-batches per pipeline of 8
    job = TrainingJob(PRESETS["llama-70b"], 64, supports={"vpp"})
    choice = choose_config(job, HW, [8] * 32)
    c = choice.config
    assert (c.dp, c.tp, c.pp, c.vpp) == (8, 4, 8, 5)
    flat = replace(c, vpp=1)
    m = 64 // c.dp
    assert iteration_time(job, flat, HW).bubble == (c.pp - 1) / m == 7 / 8
    assert iteration_time(job, c, HW).bubble == (c.pp - 1) / (c.vpp * m)
    # at the cost of vpp times the pipeline messages
    assert iteration_time(job, c, HW).pp == pytest.approx(5 * iteration_time(job, flat, HW).pp)
    assert choice.best.tokens_per_s > 1.1 * tokens_per_second(job, flat, HW)
    # without the capability the same devices give today's dp/tp/pp choice
    assert choose_config(TrainingJob(PRESETS["llama-70b"], 64), HW, [8] * 32).config.vpp == 1


def test_vpp_never_where_layers_or_micro_batches_do_not_divide():
    # 6 layers over pp 6: one layer per rank, nothing to interleave
    six = replace(PRESETS["gpt-1.3b"], num_layers=6, name="six-layers")
    job = TrainingJob(six, 512, supports=ALL)
    assert all(c.config.vpp == 1 for c in candidates(job, HW, [8] * 8, allowed_pp=(6,)))
    # 94 layers: pp 47 allows vpp 2 only, and only where the micro-batches per pipeline are
    # a multiple of 47: never with 2,048 sequences, with 1,504 = 47 x 32 where dp divides 32
    qwen = PRESETS["qwen3-235b-a22b"]
    for batch, want in ((2048, {1}), (1504, {1, 2})):
        job = TrainingJob(qwen, batch, supports={"vpp"})
        got = {(c.config.pp, c.config.vpp) for c in candidates(job, HW, [8] * 256)}
        assert {v for p, v in got if p == 47} == want
        assert all(94 % (p * v) == 0 for p, v in got)
    # megatron's interleaved schedule: micro-batches per pipeline a multiple of pp
    llama = TrainingJob(PRESETS["llama-70b"], 96)
    assert schedule_problem(llama, ParallelConfig(8, 4, 8, vpp=2)) == (
        "vpp (2) needs the micro-batches per pipeline (12 = 96 / (1 x dp 8)) to be a "
        "multiple of pp (8)")
    assert schedule_problem(llama, ParallelConfig(16, 4, 8, vpp=2)) == (
        "vpp (2) needs the micro-batches per pipeline (6 = 96 / (1 x dp 16)) to be a "
        "multiple of pp (8)")
    assert schedule_problem(llama, ParallelConfig(12, 4, 8, vpp=2)) is None
    assert schedule_problem(llama, ParallelConfig(16, 4, 8)) is None  # 1F1B takes any count
    offered = candidates(replace(llama, supports=frozenset({"vpp"})), HW, [8] * 64)
    assert any(c.config.vpp > 1 for c in offered)
    assert all((96 // c.config.dp) % c.config.pp == 0 for c in offered if c.config.vpp > 1)


def test_cp_only_where_the_sequence_divides():
    # a 64k-token llama-7b: without cp no layout fits 64 devices (activations); with cp one does
    long = replace(PRESETS["llama-7b"], seq_length=65536, name="llama-7b-64k")
    with pytest.raises(ConfigError):
        choose_config(TrainingJob(long, 64), HW, [8] * 8)
    job = TrainingJob(long, 64, supports={"cp"})
    choice = choose_config(job, HW, [8] * 8)
    assert choice.config.cp == 4 and choice.best.memory_bytes <= BUDGET
    flat = replace(choice.config, cp=1)
    assert activation_bytes_per_device(job, flat) == 4 * activation_bytes_per_device(
        job, choice.config)
    assert memory_bytes(job, flat) > BUDGET
    # 4098 = 2 x 3 x 683: load-balanced cp (2 x cp chunks) allows cp 3, 683, 2049 only
    odd = TrainingJob(replace(PRESETS["gpt-1.3b"], seq_length=4098, name="odd-seq"), 512,
                      supports={"cp"})
    assert {c.config.cp for c in candidates(odd, HW, [8] * 8)} <= {1, 3}
    assert 3 in {c.config.cp for c in candidates(odd, HW, [8] * 8)}


def test_the_all_to_all_and_kv_exchange_terms():
    # mixtral, dp 8 x ep 8 on one node (intra-node all-to-all) against ep 16 over two nodes
    job = TrainingJob(MIXTRAL, 1024, supports=ALL)
    intra = ParallelConfig(8, 1, 2, True, ep=8)
    routed = 4096 * 1 * 2 * 4096 * 2  # (s/cp) * b * topk * h bf16 values
    per_a2a = 7 / 8 * routed / 150e9
    assert iteration_time(job, intra, HW).ep == pytest.approx(4 * 16 * 128 * per_a2a)
    inter = ParallelConfig(16, 1, 2, True, ep=16)
    assert iteration_time(job, inter, HW).ep == pytest.approx(
        4 * 16 * 64 * 15 / 16 * routed / 25e9)
    assert iteration_time(job, intra, HW).cp == 0 == iteration_time(job, inter, HW).cp
    # cp 2 with tp 2: K and V chunks of 2048 tokens x 8 groups x 128 channels / tp 2
    cp2 = ParallelConfig(4, 2, 2, True, cp=2)
    kv = 2 * 2048 * 8 * 128 / 2 * 2
    assert iteration_time(job, cp2, HW).cp == pytest.approx(3 * 1 * 16 * 256 * kv / 150e9)


MODELS = ["tiny", "tiny-llama", "tiny-moe", "gpt-1.3b", "llama-7b", "mixtral-8x7b",
          "qwen3-235b-a22b"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), batch=st.sampled_from([64, 96, 512, 1536]),
       micro=st.sampled_from([1, 2]),
       supports=st.sets(st.sampled_from(sorted(ALL))),
       counts=st.lists(st.integers(0, 8), min_size=1, max_size=48),
       dist=st.booleans())
def test_every_candidate_is_a_valid_layout(model, batch, micro, supports, counts, dist):
    job = TrainingJob(PRESETS[model], batch, micro, dist, supports)
    for c in candidates(job, HW, counts):
        cfg = c.config
        cfg.validate_for(job.model)  # megatron-core's rules, ParallelConfig's own check
        assert ParallelConfig.parse(cfg.degrees(), dist) == cfg
        assert batch % (cfg.dp * micro) == 0 and schedule_problem(job, cfg) is None
        assert c.memory_bytes <= BUDGET and cfg.world <= sum(counts)
        for name in ("ep", "vpp", "cp"):
            assert getattr(cfg, name) == 1 or name in supports
        assert cfg.ep == 1 or job.model.moe


def test_experts_get_tp_1_without_sequence_parallelism():
    # megatron-core refuses to train experts at tp > 1 without sequence parallelism, which
    # the elastic worker does not build
    job = TrainingJob(MIXTRAL, 1024, supports={"ep"})
    assert any(c.config.tp > 1 for c in candidates(job, HW, [8] * 8))
    runtime = replace(job, sequence_parallel=False)
    got = candidates(runtime, HW, [8] * 8)
    assert got and all(c.config.tp == 1 for c in got)
    dense = replace(runtime, model=PRESETS["llama-7b"])
    assert any(c.config.tp > 1 for c in candidates(dense, HW, [8] * 8))


@pytest.mark.parametrize("name", ["tiny", "small", "tiny-moe"])
def test_the_elastic_runtime_is_offered_vpp_where_the_layers_and_micro_batches_divide(name):
    # the coordinator's job once a worker said its script builds chunks (ELASTIC_SUPPORTS):
    # the trainer builds vpp chunks and ep groups; before that, no vpp is offered
    from slurm_etc.coordinator.job_model import ELASTIC_SUPPORTS, provisional_job

    before = provisional_job(PRESETS[name], 24, 1, False)
    assert "vpp" not in before.supports and "ep" in before.supports
    assert all(c.config.vpp == 1 for c in candidates(before, HW, [2] * 6, tp_in_node=False))
    job = replace(before, supports=ELASTIC_SUPPORTS)
    assert {"ep", "vpp"} <= job.supports
    got = candidates(job, HW, [2] * 6, tp_in_node=False)
    chunked = [c.config for c in got if c.config.vpp > 1]
    assert chunked
    layers = PRESETS[name].num_layers
    for cfg in chunked:
        assert cfg.pp > 1 and layers % (cfg.pp * cfg.vpp) == 0, cfg
        assert (24 // cfg.dp) % cfg.pp == 0, cfg
    # every split of the layers into equal chunks is offered somewhere
    assert {(c.pp, c.vpp) for c in chunked} == {
        (pp, v) for pp in range(2, layers + 1) for v in range(2, layers + 1)
        if layers % (pp * v) == 0}

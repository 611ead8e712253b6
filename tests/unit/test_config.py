import pytest

from slurm_etc.plan import PRESETS, ConfigError, Layout, ModelDesc, ParallelConfig, load_model


def test_rank_order_is_megatron_tp_dp_pp():
    c = ParallelConfig(dp=2, tp=2, pp=2)
    # TP2PP2DP2 on 8 ranks: dp groups [0,2],[1,3],[4,6],[5,7] (NOTES)
    assert [c.rank(t=0, d=d, p=0) for d in range(2)] == [0, 2]
    assert [c.rank(t=1, d=d, p=1) for d in range(2)] == [5, 7]
    assert all(c.rank(*c.coords(r)) == r for r in range(8))


@pytest.mark.parametrize("cfg, message", [
    (ParallelConfig(dp=1, tp=3), "tp (3) must divide num_attention_heads (4)"),
    (ParallelConfig(dp=1, pp=3), "pp (3) must divide num_layers (4)"),
])
def test_validation_states_the_numbers(cfg, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate_for(PRESETS["tiny"])


def test_world_must_match_devices():
    with pytest.raises(ConfigError, match=r"2\*2\*1 = 4 must equal the devices \(6\)"):
        ParallelConfig(dp=2, tp=2).validate_for(PRESETS["tiny"], devices=6)


def test_gqa_groups_limit_tp():
    with pytest.raises(ConfigError, match="num_query_groups"):
        ParallelConfig(dp=1, tp=8).validate_for(PRESETS["tiny-llama"])


@pytest.mark.parametrize("text", ["dp=0", "tp=2", "dp=2,xx=3", "dp=a", "dp=1,dp=2", "dp2"])
def test_parse_rejects_bad_text(text):
    with pytest.raises(ConfigError):
        ParallelConfig.parse(text)


def test_parse_defaults():
    assert ParallelConfig.parse("dp=4, tp=2") == ParallelConfig(4, 2, 1)


def test_layout_rejects_double_placement():
    with pytest.raises(ConfigError, match="two ranks on one device"):
        Layout(ParallelConfig(2), (0, 0))


def test_model_json(tmp_path):
    good = tmp_path / "m.json"
    good.write_text('{"num_layers": 2, "hidden": 32, "ffn_hidden": 64, "num_heads": 4, '
                    '"vocab_size": 100}')
    m = load_model(str(good))
    assert m.name == "m" and m.padded_vocab == 128
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(str(bad))
    unknown = tmp_path / "u.json"
    unknown.write_text('{"layers": 2}')
    with pytest.raises(ConfigError, match="unknown model field"):
        load_model(str(unknown))
    with pytest.raises(ConfigError, match="hidden must be a positive integer, got 0"):
        ModelDesc("x", num_layers=1, hidden=0, ffn_hidden=1, num_heads=1, vocab_size=1)


# ---------------------------------------------------------------- ep, cp, vpp

def _moe(**kw):
    base = dict(name="m", num_layers=8, hidden=64, ffn_hidden=128, num_heads=4,
                vocab_size=256, seq_length=64, param_dtype="fp32", num_experts=4,
                router_topk=2, expert_ffn=96)
    return ModelDesc(**{**base, **kw})


@pytest.mark.parametrize("text", ["dp=4", "dp=2,tp=2,pp=1", "dp=1,tp=1,pp=4"])
def test_old_strings_parse_and_format_the_same(text):
    cfg = ParallelConfig.parse(text)
    assert (cfg.ep, cfg.cp, cfg.vpp) == (1, 1, 1)
    assert ParallelConfig.parse(str(cfg)) == cfg
    assert str(ParallelConfig.parse("dp=2,tp=2,pp=1")) == "dp=2,tp=2,pp=1"
    assert str(ParallelConfig(2, 1, 2, True)) == "dp=2,tp=1,pp=2,dist-opt"


@pytest.mark.parametrize("text", ["dp=4,tp=1,pp=2,ep=2,vpp=2", "dp=2,tp=2,pp=2,cp=2",
                                  "dp=4,tp=1,pp=2,ep=4,cp=2,vpp=2"])
def test_new_degrees_round_trip(text):
    cfg = ParallelConfig.parse(text)
    assert str(cfg) == text and ParallelConfig.parse(str(cfg)) == cfg
    assert ParallelConfig.parse("vpp=2,ep=2,pp=2,dp=4") == ParallelConfig.parse(
        "dp=4,tp=1,pp=2,ep=2,vpp=2")


@pytest.mark.parametrize(("tp", "dp", "pp", "cp", "ep"), [
    (2, 2, 2, 1, 2), (1, 2, 2, 2, 4), (2, 2, 1, 2, 2), (2, 4, 2, 2, 8), (1, 3, 2, 2, 3)])
def test_rank_order_is_megatron_core_tp_cp_ep_dp_pp(tp, dp, pp, cp, ep):
    """Groups computed from our coordinates equal megatron-core's own RankGenerator's."""
    from megatron.core.parallel_state import RankGenerator

    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=tp, ep=ep, dp=cfg.expert_dp, pp=pp, cp=1, order=order)

    def groups(key):
        out = {}
        for r in range(cfg.world):
            out.setdefault(key(r), []).append(r)
        return sorted(out.values())

    assert groups(lambda r: (cfg.coords4(r)[0], cfg.coords4(r)[2], cfg.coords4(r)[3])) == \
        sorted(dense.get_ranks("cp"))
    assert groups(lambda r: cfg.coords4(r)[:2] + (r // (tp * cp * dp),)) == \
        sorted(dense.get_ranks("dp"))
    assert groups(lambda r: (cfg.coords(r)[0], cfg.coords(r)[2])) == \
        sorted(dense.get_ranks("dp-cp"))
    assert groups(lambda r: (r // tp, )) == sorted(dense.get_ranks("tp"))
    assert groups(lambda r: (cfg.coords(r)[0], cfg.expert_dp_rank(r), cfg.coords(r)[2])) == \
        sorted(expert.get_ranks("ep"))
    assert groups(lambda r: (cfg.coords(r)[0], cfg.ep_rank(r), cfg.coords(r)[2])) == \
        sorted(expert.get_ranks("dp"))
    assert all(cfg.rank(t, d, p, c) == r for r in range(cfg.world)
               for t, c, d, p in [cfg.coords4(r)])


@pytest.mark.parametrize(("make", "message"), [
    (lambda: ParallelConfig(dp=3, ep=2), "ep (2) must divide dp x cp (3 x 1 = 3)"),
    (lambda: ParallelConfig(dp=1, pp=1, vpp=2), "vpp (2) needs pp > 1"),
    (lambda: ParallelConfig.parse("dp=2,ep=0"), "ep must be a positive integer, got 0"),
    (lambda: ParallelConfig(dp=2, pp=2, vpp=3).validate_for(_moe()),
     "pp x vpp (2 x 3 = 6) must divide num_layers (8)"),
    (lambda: ParallelConfig(dp=1, cp=3).validate_for(_moe(seq_length=64)),
     "2 x cp (2 x 3 = 6) must divide seq_length (64)"),
    (lambda: ParallelConfig(dp=2, ep=2).validate_for(PRESETS["tiny"]),
     "ep (2) needs a mixture-of-experts model; tiny has no experts"),
    (lambda: ParallelConfig(dp=8, ep=8).validate_for(_moe()),
     "ep (8) must divide num_experts (4)"),
    (lambda: ParallelConfig(dp=1, tp=4).validate_for(_moe(expert_ffn=90)),
     "tp (4) must divide expert ffn size (expert tensor parallelism = tp) (90)"),
    (lambda: ParallelConfig(dp=2, cp=2).validate_for(_moe(), devices=6),
     "dp*tp*pp*cp = 2*1*1*2 = 4 must equal the devices (6)"),
])
def test_each_violation_is_one_line_with_the_numbers(make, message):
    with pytest.raises(ConfigError) as info:
        make()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_valid_moe_layouts_pass():
    for text in ["dp=4,tp=1,pp=2,ep=2,vpp=2", "dp=2,tp=2,pp=2,ep=4,cp=2", "dp=1,tp=1,pp=1,cp=2"]:
        ParallelConfig.parse(text).validate_for(_moe())


def test_expert_fields_are_validated():
    with pytest.raises(ConfigError, match="router_topk, expert_ffn needs num_experts"):
        ModelDesc("d", num_layers=1, hidden=8, ffn_hidden=8, num_heads=1, vocab_size=8,
                  router_topk=2, expert_ffn=8)
    with pytest.raises(ConfigError, match=r"router_topk \(5\) must be at most num_experts \(4\)"):
        _moe(router_topk=5)
    with pytest.raises(ConfigError, match="num_experts must be a positive integer or null"):
        _moe(num_experts="8")
    with pytest.raises(ConfigError, match="num_experts: 5000 exceeds the bound of 4,096"):
        _moe(num_experts=5000)
    m = _moe(router_topk=None, expert_ffn=None)
    assert m.moe and m.topk == 2 and m.expert_ffn_size == 128
    assert not PRESETS["tiny"].moe


def test_moe_model_json_round_trips(tmp_path):
    path = tmp_path / "moe.json"
    path.write_text('{"num_layers": 2, "hidden": 32, "ffn_hidden": 64, "num_heads": 4, '
                    '"vocab_size": 100, "num_experts": 8, "router_topk": 2, "expert_ffn": 16, '
                    '"shared_expert_ffn": 32, "head_dim": 16, "qk_layernorm": true}')
    m = load_model(str(path))
    assert (m.num_experts, m.topk, m.expert_ffn_size, m.shared_expert_ffn) == (8, 2, 16, 32)
    assert m.kv_channels == 16 and m.attention_width == 64
    assert ModelDesc.from_json(m.to_json() | {"name": "moe"}, name="moe") == m

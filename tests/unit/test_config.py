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

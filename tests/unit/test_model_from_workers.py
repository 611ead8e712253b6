"""The model comes from the workers: each says the model it built (ModelBuilt, bounded on the
wire); without --model the coordinator plans with the first one's, and decides nothing after
the first layout until it has it; given, or once known, any model that differs stops the job
with one line naming the first difference. Real coordinator, real SQLite record, real
channel; the backend is driven by hand."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest

from slurm_etc.alloc.chooser import Hardware
from slurm_etc.alloc.topology import ClusterTopology, Device
from slurm_etc.coordinator import deciding, observe
from slurm_etc.coordinator.backend import Grant, LaunchWorkers
from slurm_etc.coordinator.job_model import PROVISIONAL_MODEL, provisional_job
from slurm_etc.plan import PRESETS, load_model
from slurm_etc.plan.model import ModelDesc
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.protocol.messages import (
    BATCH_FIELDS,
    ENCODER,
    MODEL_FIELDS,
    REPORT_DECODER,
    ModelBuilt,
    ModelReport,
)
from tests.unit.coordinator_harness import HandDrivenBackend, coordinator_over

JOB = "fromworkers"
TINY = load_model("tiny")
# what a worker's live tiny model says (model_desc_of: the padded vocabulary, divisor 1)
LIVE_TINY = replace(TINY, name="user-model", vocab_size=TINY.padded_vocab, vocab_divisor=1)
OWN = ModelDesc("own-gpt", num_layers=2, hidden=96, ffn_hidden=192, num_heads=6,
                vocab_size=128, seq_length=32, param_dtype="fp32", vocab_divisor=1,
                learned_position_embeddings=False, tied_embeddings=False)


def test_same_model_has_no_difference_whatever_its_name_and_vocabulary_padding() -> None:
    given = ModelReport.of(TINY, 8, 1)
    assert ModelReport.of(LIVE_TINY, 8, 1).difference(
        given, "the training script", {"": "--model tiny"}, MODEL_FIELDS + BATCH_FIELDS) is None


def test_difference_names_the_first_field_with_both_values() -> None:
    got = ModelReport.of(replace(LIVE_TINY, hidden=128), 8, 1)
    assert got.difference(ModelReport.of(TINY, 8, 1), "the training script",
                          {"": "--model tiny"}, MODEL_FIELDS) == \
        "hidden: 128 in the training script, 64 in --model tiny"
    got = ModelReport.of(replace(LIVE_TINY, tied_embeddings=False), 16, 2)
    assert got.difference(ModelReport.of(TINY, 8, 1), "here", {"": "there"},
                          MODEL_FIELDS) == "tied_embeddings: false in here, true in there"
    assert got.difference(ModelReport.of(TINY, 8, 1), "here",
                          {"": "--global-batch", "micro_batch": "--micro-batch"},
                          BATCH_FIELDS) == "global_batch: 16 in here, 8 in --global-batch"


def test_report_round_trips_and_out_of_bound_sizes_are_refused_on_the_wire() -> None:
    built = ModelBuilt(JOB, 0, 3, ModelReport.of(OWN, 8, 2))
    back = REPORT_DECODER.decode(ENCODER.encode(built))
    assert back == built and back.model.desc().hidden == 96
    assert back.model.desc().padded_vocab == 128
    huge = msgspec.structs.replace(built.model, hidden=10 ** 9)
    with pytest.raises(msgspec.ValidationError, match="hidden"):
        REPORT_DECODER.decode(ENCODER.encode(ModelBuilt(JOB, 0, 3, huge)))
    with pytest.raises(msgspec.ValidationError, match="param_dtype"):
        REPORT_DECODER.decode(ENCODER.encode(ModelBuilt(
            JOB, 0, 3, msgspec.structs.replace(built.model, param_dtype="fp16"))))


def test_provisional_job_is_dp_only_and_one_worker_without_a_batch() -> None:
    job = provisional_job(None, None, 1, False)
    assert job.model is PROVISIONAL_MODEL and (job.global_batch, job.micro_batch) == (1, 1)
    job = provisional_job(None, 16, 2, True)
    assert (job.global_batch, job.micro_batch, job.distributed_optimizer) == (16, 2, True)


class Launches(HandDrivenBackend):
    def __init__(self) -> None:
        super().__init__(ClusterTopology(2, ("n1", "n2")))
        self.launched: list[LaunchWorkers] = []

    def launch(self, action: LaunchWorkers) -> None:
        self.launched.append(action)


def _coordinator(tmp_path: Path, **fields: Any) -> Any:
    backend = Launches()
    job = fields.pop("training", provisional_job(None, None, 1, False))
    return backend, coordinator_over(
        tmp_path, JOB, backend, training=job, policy=EffectivePolicy(grow=True, max_nodes=2),
        hardware=Hardware(gpus_per_node=2), backend_name="local", **fields)


ANCHOR = Grant("a0", (Device("n1", 0), Device("n1", 1)))
MEMBER = Grant("a1", (Device("n2", 0), Device("n2", 1)), "grow-1")


def test_without_model_first_layout_is_one_worker_then_plans_with_the_reported_one(
        tmp_path: Path) -> None:
    backend, ctx = _coordinator(tmp_path, model_from_workers=True, batch_from_workers=True)
    with ctx as (c, _db):
        backend.pending = [ANCHOR]
        observe.observe_backend(c)
        deciding.decide_now(c)
        assert c.layout is not None and str(c.layout.config).startswith("dp=1,tp=1,pp=1")
        assert len(backend.launched) == 1
        backend.pending = [MEMBER]
        observe.observe_backend(c)
        deciding.decide_now(c)
        # nothing decided before the model is known
        assert c.resize.inflight is None and c.phase.dirty
        observe.model_built(c, 0, ModelReport.of(OWN, 8, 2))
        assert c.phase.failed is None
        assert c.spec.job.model.hidden == 96 and c.spec.job.global_batch == 8
        assert c.spec.job.micro_batch == 2 and c.phase.dirty
        observe.model_built(c, 1, ModelReport.of(OWN, 8, 2))  # the same: nothing happens
        assert c.phase.failed is None
        observe.model_built(c, 2, ModelReport.of(replace(OWN, num_heads=4), 8, 2))
        assert c.phase.failed == ("the model differs: num_heads: 4 in vrank 2's training script, "
                           "6 in vrank 0's training script")


def test_vpp_is_offered_once_a_worker_says_its_script_builds_chunks(tmp_path: Path) -> None:
    """A model provider without ``vp_stage`` cannot build virtual pipeline chunks: the
    coordinator offers vpp layouts only after a ModelBuilt saying the script can (and the
    flag travels on the wire)."""
    from slurm_etc.protocol.messages import ENCODER, REPORT_DECODER

    backend, ctx = _coordinator(tmp_path, training=provisional_job(TINY, 8, 1, False),
                                model_label="--model tiny")
    with ctx as (c, _db):
        assert "vpp" not in c.spec.job.supports
        observe.chunks_said(c, False)
        assert "vpp" not in c.spec.job.supports
        observe.chunks_said(c, True)
        assert "vpp" in c.spec.job.supports and "ep" in c.spec.job.supports and c.phase.dirty
    said = ModelBuilt(JOB, 0, 3, ModelReport.of(LIVE_TINY, 8, 1), True)
    assert REPORT_DECODER.decode(ENCODER.encode(said)) == said
    assert ModelBuilt(JOB, 0, 3, ModelReport.of(LIVE_TINY, 8, 1)).chunks is False


def test_given_model_that_differs_stops_the_job_with_one_line(tmp_path: Path) -> None:
    backend, ctx = _coordinator(tmp_path, training=provisional_job(TINY, 8, 1, False),
                                model_label="--model tiny")
    with ctx as (c, _db):
        observe.model_built(c, 0, ModelReport.of(OWN, 8, 1))
        assert c.phase.failed == ("the model differs: num_layers: 2 in vrank 0's training script, "
                           "4 in --model tiny")
        assert c.spec.job.model == TINY


def test_given_batch_that_differs_stops_the_job_and_a_matching_model_passes(
        tmp_path: Path) -> None:
    backend, ctx = _coordinator(tmp_path, training=provisional_job(TINY, 8, 1, False),
                                model_label="--model tiny")
    with ctx as (c, _db):
        observe.model_built(c, 0, ModelReport.of(LIVE_TINY, 8, 1))
        assert c.phase.failed is None
        observe.model_built(c, 1, ModelReport.of(LIVE_TINY, 8, 2))
        assert c.phase.failed == ("the batch differs: micro_batch: 2 in vrank 1's training script, "
                           "1 in --micro-batch")


def test_given_model_without_batch_takes_the_batch_from_the_workers(tmp_path: Path) -> None:
    backend, ctx = _coordinator(tmp_path, training=provisional_job(TINY, None, 1, False),
                                batch_from_workers=True, model_label="--model tiny")
    with ctx as (c, _db):
        observe.model_built(c, 0, ModelReport.of(LIVE_TINY, 16, 2))
        assert c.phase.failed is None and c.spec.job.model == TINY
        assert (c.spec.job.global_batch, c.spec.job.micro_batch) == (16, 2)
        observe.model_built(c, 1, ModelReport.of(LIVE_TINY, 8, 2))
        assert c.phase.failed == ("the batch differs: global_batch: 8 in vrank 1's training "
                                  "script, 16 in vrank 0's training script")


# ---- every field that changes the catalog or the chooser travels ------------------------

def _resolved(m: ModelDesc) -> ModelDesc:
    """``m`` with every default spelled out, as a worker's live model says it: the padded
    vocabulary (divisor 1), the query groups, the channels per head and, for a mixture of
    experts, the router's top-k and the experts' inner size."""
    return replace(m, vocab_size=m.padded_vocab, vocab_divisor=1,
                   num_query_groups=m.query_groups, head_dim=m.kv_channels,
                   router_topk=m.topk if m.moe else None,
                   expert_ffn=m.expert_ffn_size if m.moe else None)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_report_rebuilds_every_preset_exactly(name: str) -> None:
    from slurm_etc.plan.catalog import build_catalog
    from slurm_etc.plan.config import ParallelConfig

    preset = PRESETS[name]
    live = _resolved(preset)
    back = REPORT_DECODER.decode(ENCODER.encode(ModelBuilt(JOB, 0, 0,
                                                           ModelReport.of(live, 8, 1))))
    assert back.model.desc() == live  # nothing dropped: MoE stays MoE, qk norms stay
    assert ModelReport.of(preset, 8, 1) == back.model  # the same model, however described
    assert ModelReport.of(preset, 8, 1).desc() == live
    one = ParallelConfig(1, 1, 1)
    assert build_catalog(back.model.desc(), one).groups == build_catalog(preset, one).groups
    if preset.moe:
        assert back.model.desc().moe and back.model.num_experts == preset.num_experts


def test_report_carries_every_field_of_the_model_description() -> None:
    from dataclasses import fields

    # vocab_divisor: the report carries the vocabulary padded (what the catalog cuts)
    described = {f.name for f in fields(ModelDesc)} - {"vocab_divisor"}
    assert described <= set(ModelReport.__struct_fields__), \
        described - set(ModelReport.__struct_fields__)
    assert set(MODEL_FIELDS) == described - {"name"}


@pytest.mark.parametrize("field,value", [("num_experts", 10 ** 6), ("router_topk", 0),
                                         ("expert_ffn", 10 ** 9), ("head_dim", 10 ** 9),
                                         ("shared_expert_ffn", -1)])
def test_expert_fields_out_of_their_bounds_are_refused_on_the_wire(field: str,
                                                                   value: int) -> None:
    moe = ModelReport.of(PRESETS["tiny-moe"], 8, 1)
    bad = msgspec.structs.replace(moe, **{field: value})
    with pytest.raises(msgspec.ValidationError, match=field):
        REPORT_DECODER.decode(ENCODER.encode(ModelBuilt(JOB, 0, 0, bad)))


def test_without_model_a_moe_script_is_planned_as_the_moe_it_is(tmp_path: Path) -> None:
    backend, ctx = _coordinator(tmp_path, model_from_workers=True, batch_from_workers=True)
    with ctx as (c, _db):
        observe.model_built(c, 0, ModelReport.of(_resolved(PRESETS["tiny-moe"]), 8, 1))
        assert c.phase.failed is None
        planned = c.spec.job.model
        assert planned.moe and planned.num_experts == 4 and planned.topk == 2
        assert planned.expert_ffn_size == 64


def test_given_model_that_differs_only_in_experts_is_named_in_one_line(
        tmp_path: Path) -> None:
    moe = PRESETS["tiny-moe"]
    backend, ctx = _coordinator(tmp_path, training=provisional_job(moe, 8, 1, False),
                                model_label="--model tiny-moe")
    with ctx as (c, _db):
        observe.model_built(c, 0, ModelReport.of(_resolved(moe), 8, 1))
        assert c.phase.failed is None  # the same model, its defaults spelled out
        observe.model_built(c, 1, ModelReport.of(_resolved(replace(moe, num_experts=8)), 8, 1))
        assert c.phase.failed == ("the model differs: num_experts: 8 in vrank 1's training script, "
                           "4 in --model tiny-moe")
    backend, ctx = _coordinator(tmp_path / "dense", training=provisional_job(TINY, 8, 1, False),
                                model_label="--model tiny")
    with ctx as (c, _db):
        observe.model_built(c, 0, ModelReport.of(replace(LIVE_TINY, qk_layernorm=True), 8, 1))
        assert c.phase.failed == ("the model differs: qk_layernorm: true in vrank 0's training "
                           "script, false in --model tiny")


# ---- --micro-batch without --global-batch ------------------------------------------------

def test_micro_batch_alone_is_checked_against_the_workers(tmp_path: Path) -> None:
    backend, ctx = _coordinator(tmp_path, training=provisional_job(None, None, 4, False),
                                model_from_workers=True, batch_from_workers=True,
                                micro_batch_given=True)
    with ctx as (c, _db):
        observe.model_built(c, 0, ModelReport.of(OWN, 8, 2))
        assert c.phase.failed == ("the batch differs: micro_batch: 2 in vrank 0's training script, "
                           "4 in --micro-batch")
    backend, ctx = _coordinator(tmp_path / "same", training=provisional_job(None, None, 4,
                                                                             False),
                                model_from_workers=True, batch_from_workers=True,
                                micro_batch_given=True)
    with ctx as (c, _db):
        observe.model_built(c, 0, ModelReport.of(OWN, 16, 4))
        assert c.phase.failed is None
        assert (c.spec.job.global_batch, c.spec.job.micro_batch) == (16, 4)


def test_run_passes_a_micro_batch_given_alone_on_to_the_check(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """``slurm-etc run --micro-batch 4`` without ``--global-batch``: the job checks the
    workers' micro batch against 4 (before, it was dropped: a batch of one was planned and
    nothing compared); without either, the training script's is taken."""
    from click.testing import CliRunner

    from slurm_etc.cli.main import cli
    from slurm_etc.coordinator import run as run_module

    specs: list[Any] = []

    def fake_run_job(spec: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        specs.append(spec)
        return {"state": "finished"}

    monkeypatch.setattr(run_module, "run_job", fake_run_job)
    monkeypatch.chdir(tmp_path)
    base = ["run", "--nodes", "1", "--gpus-per-node", "1", "--job-id", "mb"]
    for extra in (["--micro-batch", "4"], [], ["--global-batch", "8", "--micro-batch", "2"]):
        result = CliRunner().invoke(cli, [*base, *extra, "--", "python", "train.py"],
                                    env={"SLURM_ETC_RUN_MICRO_BATCH": None})
        assert result.exit_code == 0, result.output
    alone, neither, both = specs
    assert alone.micro_batch_given and alone.batch_from_workers
    assert alone.job.micro_batch == 4
    assert not neither.micro_batch_given and neither.batch_from_workers
    assert not both.batch_from_workers and (both.job.global_batch, both.job.micro_batch) == \
        (8, 2)


def test_a_reported_moe_that_does_not_fit_together_stops_the_job_and_the_log_shows_experts(
        tmp_path: Path) -> None:
    from slurm_etc.alloc.chooser import TrainingJob
    from slurm_etc.coordinator.job_model import describe_job

    moe = ModelReport.of(_resolved(PRESETS["tiny-moe"]), 8, 1)
    backend, ctx = _coordinator(tmp_path, model_from_workers=True, batch_from_workers=True)
    with ctx as (c, _db):
        observe.model_built(c, 0, msgspec.structs.replace(moe, num_experts=2, router_topk=4))
        assert c.phase.failed == ("vrank 0's training script builds a model that cannot be "
                                  "planned: model tiny-moe: router_topk (4) must be at most "
                                  "num_experts (2)")
    line = describe_job(TrainingJob(PRESETS["tiny-moe"], 8, 1))
    assert "ffn 128, 4 experts (top 2, expert ffn 64), vocab 256" in line, line
    assert "experts" not in describe_job(TrainingJob(TINY, 8, 1))


def test_the_live_model_says_its_channels_per_head_and_its_query_key_norms() -> None:
    """What model_desc_of reads off the TransformerConfig and the GPTModel (attributes only:
    no model is built here) reaches the report: a script with kv_channels apart from
    hidden / heads (Qwen3) and q/k layer norms is planned with them, not as their absence
    (before, the catalog then held against its sharded_state_dict refused it)."""
    from types import SimpleNamespace

    from slurm_etc.megatron.live import model_desc_of

    tf = SimpleNamespace(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                         num_attention_heads=4, num_query_groups=2, kv_channels=32,
                         qk_layernorm=True, gated_linear_unit=True, normalization="RMSNorm",
                         add_bias_linear=False, bf16=False, fp16=False, num_moe_experts=None,
                         mtp_num_layers=None)
    gpt = SimpleNamespace(vocab_size=256, max_sequence_length=64,
                          position_embedding_type="rope",
                          share_embeddings_and_output_weights=False)
    desc = model_desc_of(tf, gpt, "qwen-like")
    assert desc.kv_channels == 32 and desc.qk_layernorm and desc.attention_width == 128
    report = ModelReport.of(desc, 8, 1)
    assert (report.head_dim, report.qk_layernorm) == (32, True)
    assert report.desc() == desc
    plain = model_desc_of(SimpleNamespace(**{**vars(tf), "kv_channels": 16,
                                             "qk_layernorm": False}), gpt)
    assert plain.head_dim is None and plain.kv_channels == 16 and not plain.qk_layernorm

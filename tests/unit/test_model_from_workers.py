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
from slurm_etc.coordinator.backend import Grant, LaunchWorkers
from slurm_etc.coordinator.loop import PROVISIONAL_MODEL, provisional_job
from slurm_etc.plan import load_model
from slurm_etc.plan.model import ModelDesc
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.worker.control import (
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
        c._observe_backend()
        c._decide()
        assert c.layout is not None and str(c.layout.config).startswith("dp=1,tp=1,pp=1")
        assert len(backend.launched) == 1
        backend.pending = [MEMBER]
        c._observe_backend()
        c._decide()
        assert c.inflight is None and c.dirty  # nothing decided before the model is known
        c._model_built(0, ModelReport.of(OWN, 8, 2))
        assert c.fatal is None
        assert c.spec.job.model.hidden == 96 and c.spec.job.global_batch == 8
        assert c.spec.job.micro_batch == 2 and c.dirty
        c._model_built(1, ModelReport.of(OWN, 8, 2))  # the same: nothing happens
        assert c.fatal is None
        c._model_built(2, ModelReport.of(replace(OWN, num_heads=4), 8, 2))
        assert c.fatal == ("the model differs: num_heads: 4 in vrank 2's training script, "
                           "6 in vrank 0's training script")


def test_given_model_that_differs_stops_the_job_with_one_line(tmp_path: Path) -> None:
    backend, ctx = _coordinator(tmp_path, training=provisional_job(TINY, 8, 1, False),
                                model_label="--model tiny")
    with ctx as (c, _db):
        c._model_built(0, ModelReport.of(OWN, 8, 1))
        assert c.fatal == ("the model differs: num_layers: 2 in vrank 0's training script, "
                           "4 in --model tiny")
        assert c.spec.job.model == TINY


def test_given_batch_that_differs_stops_the_job_and_a_matching_model_passes(
        tmp_path: Path) -> None:
    backend, ctx = _coordinator(tmp_path, training=provisional_job(TINY, 8, 1, False),
                                model_label="--model tiny")
    with ctx as (c, _db):
        c._model_built(0, ModelReport.of(LIVE_TINY, 8, 1))
        assert c.fatal is None
        c._model_built(1, ModelReport.of(LIVE_TINY, 8, 2))
        assert c.fatal == ("the batch differs: micro_batch: 2 in vrank 1's training script, "
                           "1 in --micro-batch")


def test_given_model_without_batch_takes_the_batch_from_the_workers(tmp_path: Path) -> None:
    backend, ctx = _coordinator(tmp_path, training=provisional_job(TINY, None, 1, False),
                                batch_from_workers=True, model_label="--model tiny")
    with ctx as (c, _db):
        c._model_built(0, ModelReport.of(LIVE_TINY, 16, 2))
        assert c.fatal is None and c.spec.job.model == TINY
        assert (c.spec.job.global_batch, c.spec.job.micro_batch) == (16, 2)
        c._model_built(1, ModelReport.of(LIVE_TINY, 8, 2))
        assert c.fatal == ("the batch differs: global_batch: 8 in vrank 1's training script, "
                           "16 in vrank 0's training script")

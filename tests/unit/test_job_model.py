"""coordinator/job_model.py, called directly: what a job plans with, given or said by the
workers (no coordinator, no record, no channel; tests/unit/test_model_from_workers.py drives
the same rules through a real coordinator)."""
from __future__ import annotations

from dataclasses import replace

import msgspec

from slurm_etc.coordinator.job_model import (
    Known,
    chunks_said,
    model_built,
    provisional_job,
)
from slurm_etc.plan import load_model
from slurm_etc.plan.model import ModelDesc
from slurm_etc.protocol.messages import ModelReport

TINY = load_model("tiny")
OWN = ModelDesc("own-gpt", num_layers=2, hidden=96, ffn_hidden=192, num_heads=6,
                vocab_size=128, seq_length=32, param_dtype="fp32", vocab_divisor=1,
                learned_position_embeddings=False, tied_embeddings=False)


def from_workers() -> Known:
    return Known.given(provisional_job(None, None, 1, False), model_from_workers=True,
                       batch_from_workers=True, micro_batch_given=False, model_label="-")


def test_the_first_worker_says_the_model_and_the_batch_and_every_later_one_must_match():
    job = provisional_job(None, None, 1, False)
    known = from_workers()
    assert not known.complete
    heard = model_built(known, job, 0, ModelReport.of(OWN, 8, 2))
    assert heard.fatal is None and heard.known.complete
    said = ModelReport.of(OWN, 8, 2)
    assert heard.job.model == said.desc()
    assert (heard.job.global_batch, heard.job.micro_batch) == (8, 2)
    assert heard.job.supports == job.supports  # what the runtime builds stays
    assert known.model is None  # the value before is left as it was
    same = model_built(heard.known, heard.job, 1, ModelReport.of(OWN, 8, 2))
    assert same.fatal is None and same.known is heard.known and same.job is heard.job
    other = model_built(heard.known, heard.job, 2, ModelReport.of(replace(OWN, num_heads=4),
                                                                  8, 2))
    assert other.fatal is not None and other.fatal.startswith("the model differs: num_heads")
    assert "vrank 2's training script" in other.fatal and "vrank 0's" in other.fatal
    assert other.known is heard.known  # nothing learned from a worker that differs


def test_a_given_micro_batch_is_what_the_first_worker_must_have():
    job = provisional_job(TINY, None, 4, False)
    known = Known.given(job, model_from_workers=False, batch_from_workers=True,
                        micro_batch_given=True, model_label="--model tiny")
    assert known.model is not None and known.batch is None and known.micro_batch is not None
    heard = model_built(known, job, 0, ModelReport.of(TINY, 16, 2))
    assert heard.fatal == ("the batch differs: micro_batch: 2 in vrank 0's training script, "
                           "4 in --micro-batch")


def test_a_model_that_cannot_be_planned_stops_the_job_in_one_line():
    job = provisional_job(None, None, 1, False)
    odd = msgspec.structs.replace(ModelReport.of(OWN, 8, 2), num_heads=5)  # 96 % 5 != 0
    heard = model_built(from_workers(), job, 0, odd)
    assert heard.fatal is not None and heard.fatal.startswith(
        "vrank 0's training script builds a model that cannot be planned:")
    assert "\n" not in heard.fatal and heard.job is job


def test_vpp_is_offered_once_a_script_says_it_builds_chunks():
    job = provisional_job(TINY, 8, 1, False)
    assert "vpp" not in job.supports
    assert chunks_said(job, False) is job
    with_chunks = chunks_said(job, True)
    assert "vpp" in with_chunks.supports and "ep" in with_chunks.supports
    assert chunks_said(with_chunks, True) is with_chunks

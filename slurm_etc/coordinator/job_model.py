"""What a job plans with: the model and the batch, given on the command line or said by the
workers' scripts (pure).

Without ``--model`` (``--global-batch``) the first layout is chosen for a provisional job
(:func:`provisional_job`) and its workers say what they built (``ModelBuilt``): the first
one's model (batch) is what the job plans with from then on. Every later one, and every one
where they were given, must match, field for field: a difference stops the job at once with
one line naming the first one (before any resize: none is decided until both are known, and
a worker plans with its own). :func:`model_built` is that rule over a frozen :class:`Known`;
the loop records what it returns (``observe.model_built``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from slurm_etc.alloc.chooser import TrainingJob
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import ModelDesc
from slurm_etc.protocol.messages import BATCH_FIELDS, MODEL_FIELDS, ModelReport

# What the first layout is chosen with when the model (and the batch) come from the workers:
# one layer of one head fits every device and admits only tp=1, pp=1; a batch of one, only
# dp=1. Nothing is planned with it: no resize is decided until the workers said their model.
PROVISIONAL_MODEL = ModelDesc("from-workers", num_layers=1, hidden=1, ffn_hidden=1,
                              num_heads=1, vocab_size=1, seq_length=1, param_dtype="fp32",
                              vocab_divisor=1)

# What the elastic worker builds beyond dp/tp/pp (``TrainingJob.supports``): a mixture of
# experts' ep (its trainer builds megatron's expert groups, its resizes move experts) and VPP
# model chunks (one provider call per chunk, Megatron-LM's ``vp_stage``: offered only once a
# worker said its script takes it, ``ModelBuilt.chunks``); not CP groups, nor sequence
# parallelism (so experts train at tp = 1).
ELASTIC_SUPPORTS = frozenset({"ep", "vpp"})
BEFORE_CHUNKS_SAID = ELASTIC_SUPPORTS - {"vpp"}

Said = tuple[ModelReport, str]  # what was said, and who said it ("--model tiny", "vrank 0's ...")


def provisional_job(model: ModelDesc | None, global_batch: int | None, micro_batch: int,
                    distributed_optimizer: bool) -> TrainingJob:
    """The job the first layout is chosen for: what was given, the provisional model and a
    global batch of one micro batch (dp=1) where none was given; what the elastic worker
    builds (``ELASTIC_SUPPORTS``, no sequence parallelism)."""
    if global_batch is None:
        global_batch = micro_batch
    return TrainingJob(model or PROVISIONAL_MODEL, global_batch, micro_batch,
                       distributed_optimizer, supports=BEFORE_CHUNKS_SAID,
                       sequence_parallel=False)


@dataclass(frozen=True)
class Known:
    """The model, the batch and the micro batch every worker's ``ModelBuilt`` must match,
    each with who said it; None: not known yet (the model, the batch: the first
    ``ModelBuilt`` says it; the micro batch: nothing to match)."""

    model: Said | None
    batch: Said | None
    micro_batch: Said | None

    @classmethod
    def given(cls, job: TrainingJob, *, model_from_workers: bool, batch_from_workers: bool,
              micro_batch_given: bool, model_label: str) -> Known:
        """What the command line gave (``job``'s model unless the workers say it, its batch
        likewise; ``--micro-batch`` alone: what the first worker's micro batch must be)."""
        given = ModelReport.of(job.model, job.global_batch, job.micro_batch)
        return cls(None if model_from_workers else (given, model_label),
                   None if batch_from_workers else (given, "--global-batch"),
                   (given, "--micro-batch") if batch_from_workers and micro_batch_given
                   else None)

    @property
    def complete(self) -> bool:
        """The model and the batch are both known: resizes may be decided."""
        return self.model is not None and self.batch is not None


@dataclass(frozen=True)
class Heard:
    """What a ``ModelBuilt`` changes: what is known and the job planned with (the same
    objects where nothing changed), or why the job stops (one line)."""

    known: Known
    job: TrainingJob
    fatal: str | None = None


def model_built(known: Known, job: TrainingJob, vrank: int, got: ModelReport) -> Heard:
    """``vrank``'s script built ``got`` (the rules in the module doc)."""
    here = f"vrank {vrank}'s training script"
    for compared, ref in ((MODEL_FIELDS, known.model), (BATCH_FIELDS, known.batch),
                          (("micro_batch",), known.micro_batch)):
        if ref is None:
            continue
        there = {"": ref[1], "global_batch": ref[1], "micro_batch": ref[1]}
        if ref[1] == "--global-batch":
            there["micro_batch"] = "--micro-batch"
        diff = got.difference(ref[0], here, there, compared)
        if diff is not None:
            what = "model" if compared is MODEL_FIELDS else "batch"
            return Heard(known, job, f"the {what} differs: {diff}")
    if known.complete:
        return Heard(known, job)
    try:
        model = job.model if known.model is not None else got.desc()
        global_batch, micro_batch = ((job.global_batch, job.micro_batch)
                                     if known.batch is not None
                                     else (got.global_batch, got.micro_batch))
        # replace, not a new TrainingJob: what the runtime supports (ep/vpp/cp) stays
        job = replace(job, model=model, global_batch=global_batch, micro_batch=micro_batch)
    except ConfigError as err:
        return Heard(known, job, f"{here} builds a model that cannot be planned: {err}")
    return Heard(replace(known, model=known.model or (got, here),
                         batch=known.batch or (got, here)), job)


def chunks_said(job: TrainingJob, chunks: bool) -> TrainingJob:
    """A worker's script builds virtual pipeline chunks (``chunks``): vpp layouts may be
    chosen from now on (a script whose model provider takes no ``vp_stage`` could not build
    them). The same object where nothing changes."""
    if not chunks or "vpp" in job.supports:
        return job
    return replace(job, supports=job.supports | (ELASTIC_SUPPORTS & {"vpp"}))


def describe_job(job: TrainingJob) -> str:
    """One line: the model and batch a job plans with."""
    m = job.model
    experts = ""
    if m.moe:
        shared = f", shared ffn {m.shared_expert_ffn}" if m.shared_expert_ffn else ""
        experts = (f", {m.num_experts} experts (top {m.topk}, expert ffn "
                   f"{m.expert_ffn_size}{shared})")
    return (f"{m.num_layers} layers, hidden {m.hidden}, {m.num_heads} heads "
            f"({m.query_groups} query groups), ffn {m.ffn_hidden}{experts}, vocab "
            f"{m.padded_vocab}, seq {m.seq_length}, {m.param_dtype}; global batch "
            f"{job.global_batch}, micro batch {job.micro_batch}")

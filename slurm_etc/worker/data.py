"""Which samples every data-parallel rank reads: megatron's pretraining sampler order, as a pure
function of the samples consumed so far.

Megatron-LM's ``MegatronPretrainingSampler`` walks the dataset in order: each global batch is
the next ``global_batch`` samples; inside it, micro-batch round ``j`` is the next
``micro_batch * dp`` samples, of which data-parallel rank ``r`` takes the ``r``-th
``micro_batch``. A checkpoint-restart resumes it from ``consumed_samples``; so does a resize,
with the new dp: the next global batch is the same set of samples whatever the layout.
"""
from __future__ import annotations

from slurm_etc.plan.errors import ConfigError


class BatchError(ConfigError):
    """A layout cannot keep the job's global batch."""


def check_batch(global_batch: int, micro_batch: int, dp: int) -> int:
    """Micro-batches per step of one dp rank (gradient accumulation) for a constant global
    batch.

    Raises:
        BatchError: ``micro_batch * dp`` does not divide ``global_batch``.
    """
    if global_batch <= 0 or micro_batch <= 0:
        raise BatchError(f"global batch ({global_batch}) and micro batch ({micro_batch}) must "
                         "be positive")
    if global_batch % (micro_batch * dp):
        fits = [d for d in range(1, global_batch // micro_batch + 1)
                if global_batch % (micro_batch * d) == 0]
        raise BatchError(f"dp={dp} cannot keep the global batch of {global_batch}: "
                         f"dp * micro batch ({dp} * {micro_batch}) must divide it; dp may be "
                         f"{', '.join(map(str, fits))}")
    return global_batch // (micro_batch * dp)


def check_interleaving(global_batch: int, micro_batch: int, dp: int, pp: int,
                       vpp: int) -> None:
    """With virtual pipeline chunks (vpp > 1) megatron's interleaved schedule runs a
    pipeline's micro-batches in groups of pp and refuses a last group smaller than pp
    (``forward_backward_pipelining_with_interleaving``): the micro-batches per dp rank must
    be a multiple of pp (what the chooser's ``schedule_problem`` asks too).

    Raises:
        BatchError: they are not.
    """
    rounds = check_batch(global_batch, micro_batch, dp)
    if vpp > 1 and rounds % pp:
        raise BatchError(f"vpp ({vpp}) needs the micro-batches per pipeline ({rounds} = "
                         f"{global_batch} / ({micro_batch} x dp {dp})) to be a multiple of "
                         f"pp ({pp})")


def microbatch_samples(consumed: int, global_batch: int, micro_batch: int, dp: int,
                       dp_rank: int) -> list[range]:
    """Sample indices of each micro-batch data-parallel rank ``dp_rank`` trains on in the
    step that starts after ``consumed`` samples (megatron's sampler order)."""
    rounds = check_batch(global_batch, micro_batch, dp)
    per_round = micro_batch * dp
    first = consumed + dp_rank * micro_batch
    return [range(first + j * per_round, first + j * per_round + micro_batch)
            for j in range(rounds)]

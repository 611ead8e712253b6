# mypy: disable-error-code="misc, has-type"
"""What a worker tells of its training: each step's record (and rank 0's Progress to the
coordinator), the first step of a layout it came to by a resize (Resumed: the pause measured
at the step boundaries), and each resize's outcome (Resized).

The Resumed of a layout: every rank measures its own gap, one all-reduce (MAX over two int64,
:func:`gap_codes`) finds the widest gap and the widest stall with their ranks, and only those
ranks report, each standing for the whole layout (``widest_of``, ``stall_of``): one or two
messages at the coordinator a resize, not one a rank. Where that all-reduce fails (a peer
died), or the step's own did, each rank reports its own as before.

A mixin of :class:`~slurm_etc.worker.trainer.ElasticTrainer`: the records read its step,
generation and layout; the resumption's own state is a :class:`Resumption`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch
import torch.distributed as dist

from slurm_etc.lifecycle import ProcessOutcome
from slurm_etc.plan import ParallelConfig
from slurm_etc.protocol.rendezvous import GenerationKeys

from ..protocol.messages import MAX_VRANKS, Progress, Resize, Resized, Resumed

# A gap's code (:func:`gap_codes`): microseconds above GAP_FLOOR_US in the high bits, the
# vrank (its complement: the lowest wins a tie, as the coordinator's pause does) in the low
# VRANK_BITS; an unknown gap codes as 0 microseconds, below every known one.
VRANK_BITS = MAX_VRANKS.bit_length() - 1  # every vrank a message may name
_VRANK_MASK = (1 << VRANK_BITS) - 1
GAP_FLOOR_US = 1 << 40  # a gap as negative as this (clocks apart) still codes above unknown
_MOST_US = (1 << 42) - 1

if TYPE_CHECKING:
    from .trainer import ElasticTrainer


def gap_codes(vrank: int, started: float, last_ended: float | None, stalled: float
              ) -> tuple[int, int]:
    """The two int64 whose maxima over a layout's ranks say whose gap (``started -
    last_ended``) and whose stall is the widest (:func:`code_vrank` reads the rank back):
    the larger wins, then the lower vrank."""
    if not 0 <= vrank <= _VRANK_MASK:
        raise ValueError(f"vrank {vrank} does not fit {VRANK_BITS} bits")
    low = _VRANK_MASK - vrank
    seconds = None if last_ended is None else started - last_ended
    # a value that is not finite (a malformed end in the store) codes as unknown, as the
    # coordinator's tracker reads it: never an exception inside the step
    gap = 0 if seconds is None or not math.isfinite(seconds) else min(
        max(round(seconds * 1e6) + GAP_FLOOR_US, 1), _MOST_US)
    stall = min(max(round(stalled * 1e6), 0), _MOST_US) if math.isfinite(stalled) else 0
    return (gap << VRANK_BITS) | low, (stall << VRANK_BITS) | low


def code_vrank(code: int) -> int:
    """The vrank a :func:`gap_codes` code is of."""
    return _VRANK_MASK - (code & _VRANK_MASK)


@dataclass
class StepRecord:
    """One trained step as every rank sees it; ``started``/``ended``: when it began and
    ended on this rank (unix seconds)."""

    step: int
    loss: float
    lr: float
    consumed_samples: int
    layout: str
    generation: int
    started: float = 0.0
    ended: float = 0.0


@dataclass
class ResizeRecord:
    """One resize as this process saw it."""

    generation: int
    old: str
    new: str
    outcome: str
    step: int
    moved_bytes: int
    pause_seconds: float
    data_seconds: float
    error: str = ""
    lost_steps: tuple[int, int] | None = None  # (first, last) trained, lost with a node


@dataclass
class Resumption:
    """What the Resumed of a layout's first step reports, gathered since the last one."""

    # (generation, unix end) of the last step this process trained; the generation it
    # first trained in without a resize (its first layout: no gap to report)
    ended_in: tuple[int, float] | None = None
    first_generation: int | None = None
    # the widest gap between two old-layout steps while a resize was prepared beside
    # training (the boundary that built the new world): reported with the first new step
    stalled: float = 0.0
    # when this process's step in flight failed (a peer died): reported with the first
    # new step, which tells the step lost with the node from the recovery
    failed_at: float | None = None


class Reporting:
    """The records and reports of :class:`~slurm_etc.worker.trainer.ElasticTrainer`."""

    def _step_ended(self: ElasticTrainer, started: float, ended: float, loss: float, lr: float,
                    cfg: ParallelConfig, *, report: bool) -> None:
        """A step trained: the Resumed of a new layout's first step, the stall, the log line;
        with ``report`` (its loss known) its record and the coordinator's Progress (rank 0)."""
        proc = self._proc()
        if report:
            self.history.append(StepRecord(self.step, loss, lr, self.consumed_samples,
                                           str(cfg), self.generation, started, ended))
            self._live()[0].losses.append(loss)
            if dist.get_rank() == 0:
                proc.control.report(Progress(proc.job, self.generation, proc.vrank, self.step,
                                             loss, lr, self.consumed_samples, str(cfg),
                                             started, ended))
        self._report_resumed(started, together=report)
        seen = self.resumption
        if self._preparing is not None and seen.ended_in is not None and \
                seen.ended_in[0] == self.generation:  # training stopped at that boundary
            seen.stalled = max(seen.stalled, started - seen.ended_in[1])
        seen.ended_in = (self.generation, ended)
        self._log("step %d loss %.6f lr %.3e consumed %d started %.6f ended %.6f%s", self.step,
                  loss, lr, self.consumed_samples, started, ended,
                  "" if report else " (its loss's reduce failed: a peer died)")

    def _report_resumed(self: ElasticTrainer, started: float, together: bool) -> None:
        """The first step of a layout this process came to by a resize: when it began and
        when this process's last step in the old layout ended (a joiner: the old layout's,
        as its publisher left it in the store), measured at the step boundaries, whatever
        the resize did in between. ``together`` (the step's all-reduce went through):
        reported by the ranks of the widest gap and stall for the layout (module doc);
        else by each rank for itself."""
        seen = self.resumption
        if seen.ended_in is not None and seen.ended_in[0] == self.generation:
            return  # not the first step of this layout
        if seen.ended_in is None and self.generation == seen.first_generation:
            return  # the layout this process started in: no resize before it
        proc = self._proc()
        last: float | None = seen.ended_in[1] if seen.ended_in is not None else None
        if last is None:
            key = GenerationKeys(proc.job, self.generation).last_ended
            if proc.store.check([key]):
                last = float(proc.store.get(key).decode())
        own = Resumed(proc.job, self.generation, proc.vrank, self.step, started, last,
                      joined=seen.ended_in is None, stalled=seen.stalled,
                      failed_at=seen.failed_at)
        report: Resumed | None = own
        if together:
            try:
                report = self._widest_resumed(own)
            except RuntimeError as err:  # a peer died since the step's all-reduce
                self._log("the layout's widest gap not found (%s): reporting this "
                          "process's own", err)
        if report is not None:
            proc.control.report(report)
        seen.stalled = 0.0
        seen.failed_at = None
        # the old layout's groups, retired at the switch, are shut down beside the next
        # steps: neither the pause nor a later step boundary waits for it
        from slurm_etc.megatron.world import retire_in_background

        retire_in_background()

    def _widest_resumed(self: ElasticTrainer, own: Resumed) -> Resumed | None:
        """``own``, standing for the layout where this rank's gap or stall is its widest
        (one all-reduce, MAX, of :func:`gap_codes` on the step's device); None where
        neither is."""
        from slurm_etc.migrate import device

        codes = torch.tensor(gap_codes(own.vrank, own.started, own.last_ended, own.stalled),
                             dtype=torch.int64, device=device.current().device)
        dist.all_reduce(codes, op=dist.ReduceOp.MAX)
        world = dist.get_world_size()
        widest, stall = (code_vrank(int(c)) == own.vrank for c in codes.tolist())
        if not (widest or stall):
            return None
        return msgspec.structs.replace(own, widest_of=world if widest else 0,
                                       stall_of=world if stall else 0)

    def _record(self: ElasticTrainer, order: Resize, outcome: ProcessOutcome, moved: int,
                pause: float, data: float, error: str, stats: dict | None = None) -> None:
        proc = self._proc()
        stats = stats or {}
        lost = (self._rollback[1:] if self._rollback and self._rollback[0] == order.generation
                else None)
        rebuilt = (self._rebuilt_from.get(order.generation, "")
                   if outcome != ProcessOutcome.ABORTED else "")
        self.resizes.append(ResizeRecord(order.generation, order.old.config, order.new.config,
                                         outcome, self.step, moved, pause, data, error, lost))
        # the commit decision's share gave the group's longest data phase: its proposer
        # answers for every rank of it (the commit), the others say nothing; not in a
        # rebuild, which the coordinator settles on every survivor's answer (the steps it
        # lost and where from are each worker's word). A loss that surviving replicas
        # cover is answered for the group as a grow or shrink is.
        group_data: float | None = stats.get("group_data_seconds")
        for_group = group_data is not None and outcome != ProcessOutcome.ABORTED and \
            lost is None and not rebuilt
        if group_data is not None and for_group:
            if not stats.get("answers_for_group"):
                return
            outcome, data = ProcessOutcome.COMMITTED, group_data
        proc.control.report(Resized(proc.job, order.generation, proc.vrank, outcome,
                                    self.step, pause, data, int(stats.get("sent_bytes", 0)),
                                    int(stats.get("received_bytes", 0)), error, lost,
                                    rebuilt, for_group))  # type: ignore[arg-type]

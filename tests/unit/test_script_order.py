"""The coordinator reports steps to its backend (``on_step``: a scripted cluster's next
group of events fires) only when settled: no resize in flight and no recorded event waiting
for its decision. Real coordinator and SQLite record; the backend is a stub that records
the steps it is told and hands over a grant when told one."""
from __future__ import annotations

from pathlib import Path

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.alloc.topology import ClusterTopology, Device
from slurm_etc.coordinator import deciding, observe
from slurm_etc.coordinator.backend import Grant
from slurm_etc.plan import load_model
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.protocol.messages import Progress
from tests.unit.coordinator_harness import HandDrivenBackend, coordinator_over

JOB = "order"


class Told(HandDrivenBackend):
    def __init__(self) -> None:
        super().__init__(ClusterTopology(2, ("n0", "n1")))
        self.steps: list[int] = []

    def on_step(self, step: int) -> None:
        self.steps.append(step)


def progress(step: int) -> Progress:
    # a generation before the job's (counted, not written to the record; a later one, not
    # committed here yet, would be shown only)
    return Progress(JOB, -1, 0, step, 1.0, 1e-3, 8 * step, "dp=2")


def test_steps_reach_the_backend_only_when_settled(tmp_path: Path) -> None:
    told = Told()
    with coordinator_over(tmp_path, JOB, told,
                          training=TrainingJob(load_model("tiny"), 8, 1, False),
                          policy=EffectivePolicy(grow=False),
                          hardware=Hardware(gpus_per_node=2), backend_name="local") as (c, _db):
        observe.progress(c, progress(1))                       # settled: told
        told.pending = [Grant("a0", (Device("n0", 0), Device("n0", 1)))]
        observe.observe_backend(c)                           # recorded, not decided yet
        observe.progress(c, progress(2))                       # not told: an event waits
        deciding.decide_now(c)
        observe.progress(c, progress(3))                       # decided: told again
        c.resize.inflight = object()  # type: ignore[assignment]  # a resize in flight
        observe.progress(c, progress(4))                       # not told
        c.resize.inflight = None
        observe.progress(c, progress(5))
        assert told.steps == [1, 3, 5]

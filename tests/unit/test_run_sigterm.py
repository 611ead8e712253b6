"""run_job turns SIGTERM (scancel, the time limit) into the clean close of any other end."""
from __future__ import annotations

import os
import signal

import pytest

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.alloc.topology import ClusterTopology
from slurm_etc.coordinator.loop import JobSpec
from slurm_etc.coordinator.run import run_job
from slurm_etc.plan.model import PRESETS
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.store import jobs as record
from slurm_etc.store.db import open_store_readonly


class TermOnPoll:
    """A backend that gets SIGTERM at its first poll and notes that it was closed."""

    def __init__(self) -> None:
        self.closed = 0

    def poll(self):
        os.kill(os.getpid(), signal.SIGTERM)
        return []

    def on_step(self, step):
        pass

    def request(self, action):
        pass

    def release(self, action):
        pass

    def launch(self, action):
        pass

    def stop(self, action):
        pass

    def workers(self):
        return {}

    def close(self):
        self.closed += 1


def test_sigterm_closes_the_backend(tmp_path):
    backend = TermOnPoll()
    spec = JobSpec("term-1", "t", ("true",), TrainingJob(PRESETS["tiny"], 8, 1, False),
                   EffectivePolicy(), Hardware(gpus_per_node=2))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        run_job(spec, backend, ClusterTopology(2, ("n0",)), db=str(tmp_path / "job.db"),
                state_dir=str(tmp_path / "state"), secret_dir=tmp_path / "secret")
    assert exc.value.code == 128 + signal.SIGTERM
    assert backend.closed == 1
    assert signal.getsignal(signal.SIGTERM) == before
    store = open_store_readonly(tmp_path / "job.db")
    try:
        assert record.job_detail(store, "term-1") is not None
    finally:
        store.close()

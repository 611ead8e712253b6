"""A real Coordinator (real SQLite record, real control channel) over a backend that a test
drives by hand: it queues events in ``pending`` and ignores every action unless a subclass
records it."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from slurm_etc.alloc.chooser import Hardware, TrainingJob
from slurm_etc.alloc.topology import ClusterTopology
from slurm_etc.coordinator.backend import BackendDefaults
from slurm_etc.coordinator.job import JobSpec
from slurm_etc.coordinator.loop import Coordinator
from slurm_etc.policy.rules import EffectivePolicy
from slurm_etc.protocol.channel import CoordinatorChannel, create_secret
from slurm_etc.store import jobs as record


class HandDrivenBackend(BackendDefaults):
    """Hands over the events queued in ``pending`` at each poll; actions do nothing."""

    def __init__(self, topology: ClusterTopology) -> None:
        self.topology = topology
        self.pending: list[Any] = []

    def poll(self) -> list[Any]:
        out, self.pending = self.pending, []
        return out

    def on_step(self, step: int) -> None: ...
    def request(self, action: Any) -> None: ...
    def release(self, action: Any) -> None: ...
    def launch(self, action: Any) -> None: ...
    def stop(self, action: Any) -> None: ...
    def workers(self) -> dict: return {}
    def close(self) -> None: ...


class RecordingBackend(HandDrivenBackend):
    """Also keeps the launch, stop, release, request and withdrawal (``cancel_request``)
    actions it was given, in order. The unit tests' ``recording_backend`` fixture
    (tests/unit/conftest.py) makes one."""

    def __init__(self, topology: ClusterTopology) -> None:
        super().__init__(topology)
        self.launched: list[Any] = []
        self.stopped: list[Any] = []
        self.released: list[Any] = []
        self.requested: list[Any] = []
        self.withdrawn: list[Any] = []

    def launch(self, action: Any) -> None:
        self.launched.append(action)

    def stop(self, action: Any) -> None:
        self.stopped.append(action)

    def release(self, action: Any) -> None:
        self.released.append(action)

    def request(self, action: Any) -> None:
        self.requested.append(action)

    def cancel_request(self, action: Any) -> None:
        self.withdrawn.append(action)


@contextmanager
def coordinator_over(tmp_path: Path, job: str, backend: HandDrivenBackend, *,
                     training: TrainingJob, policy: EffectivePolicy, hardware: Hardware,
                     backend_name: str, **spec_fields: Any
                     ) -> Iterator[tuple[Coordinator, str]]:
    """A Coordinator for ``job`` over ``backend``, its record in ``tmp_path``; yields it and
    the record's path (for plain sqlite3 reads), closing channel and store after.
    ``spec_fields``: more JobSpec fields."""
    db = tmp_path / "job.db"
    store = record.open_job_store(job, db=db, state_dir=tmp_path / "state")
    record.create_job(store, job, name="t", owner_uid=0, owner_name="t", backend=backend_name)
    channel = CoordinatorChannel(job, create_secret(job, tmp_path / "keys"), "127.0.0.1")
    spec = JobSpec(job, "t", (sys.executable, "-c", "pass"), training, policy, hardware,
                   **spec_fields)
    try:
        yield Coordinator(spec, backend, store, channel, backend.topology), str(db)
    finally:
        channel.close()
        store.close()

"""The Backend protocol is whole on every backend: its optional members (withdrawing a
request, whether one can be met, why requests pend, the usable node count, adopting workers,
keeping the backend's own state) have defaults in ``BackendDefaults``, which every backend
inherits, so the coordinator calls them directly (no ``getattr``)."""
from __future__ import annotations

from typing import Any

import pytest

from slurm_etc.alloc.topology import ClusterTopology
from slurm_etc.coordinator.backend import (
    Backend,
    BackendDefaults,
    CancelRequest,
    perform,
    request_key,
)
from slurm_etc.harness.control import SimCluster
from slurm_etc.local.backend import LocalBackend
from slurm_etc.slurm.backend import SlurmBackend
from tests.unit.coordinator_harness import HandDrivenBackend, RecordingBackend

pytestmark = pytest.mark.unit

OPTIONAL = ("cancel_request", "request_can_be_met", "pending_reasons", "usable_nodes", "adopt",
            "keep_state")


def protocol_members() -> set[str]:
    return {n for n in vars(Backend) if not n.startswith("_")}


def missing_members(cls: type) -> list[str]:
    return sorted(n for n in protocol_members() if not hasattr(cls, n))


@pytest.mark.parametrize("cls", [LocalBackend, SlurmBackend, SimCluster, HandDrivenBackend,
                                 RecordingBackend], ids=lambda c: c.__name__)
def test_every_backend_has_the_whole_protocol(cls: type) -> None:
    assert issubclass(cls, BackendDefaults)
    assert missing_members(cls) == []


def test_the_optional_members_are_on_the_protocol_with_defaults() -> None:
    assert set(OPTIONAL) <= protocol_members()
    assert set(OPTIONAL) <= set(vars(BackendDefaults))
    # planted: a backend of its own that forgot one is found
    assert missing_members(type("NoAdopt", (), {n: None for n in protocol_members()
                                               if n != "adopt"})) == ["adopt"]


def test_the_defaults_change_nothing(tmp_path: Any) -> None:
    """A backend with nothing of its own: a withdrawal lets the request run its course,
    every request can be met, no reasons, the node count unknown, no worker adopted, no
    state kept."""
    backend = HandDrivenBackend(ClusterTopology(2, ("n0",)))
    perform(backend, CancelRequest(request_key(1), "overdue"))
    assert backend.request_can_be_met(request_key(1)) is True
    assert backend.pending_reasons == {}
    assert backend.usable_nodes() is None
    assert backend.adopt([]) == []
    backend.keep_state(tmp_path / "state.json", resume=False)
    assert list(tmp_path.iterdir()) == []


def test_a_withdrawal_reaches_a_backend_that_has_one() -> None:
    backend = RecordingBackend(ClusterTopology(2, ("n0",)))
    perform(backend, CancelRequest(request_key(3)))
    assert [a.key for a in backend.withdrawn] == ["grow-3"]

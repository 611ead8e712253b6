"""Fixtures the unit tests share (helpers that are not fixtures live in helper modules:
``coordinator_harness``, ``grow_harness``; test modules import from those, never from each
other)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def recording_backend() -> Callable[[Any], Any]:
    """The unit tests' one recording backend: ``recording_backend(topology)`` is a
    :class:`tests.unit.coordinator_harness.RecordingBackend` over ``topology``: it hands the
    coordinator the events a test queues in ``pending`` and keeps the actions it is given
    (``requested``, ``withdrawn``, ``launched``, ``stopped``, ``released``)."""
    from tests.unit.coordinator_harness import RecordingBackend

    return RecordingBackend

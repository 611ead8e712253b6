"""Planted miscounts for ``slurm-etc bench control``'s counters
(:func:`slurm_etc.harness.control.run_control`'s ``counters``), for
tests/dist/test_bench_control.py: each shows that :func:`~slurm_etc.harness.control.
check_run` catches a benchmark that counts the coordinator's messages wrong.

Nothing in the runtime imports this module.
"""
from __future__ import annotations

from typing import Any


def store_requests_half_counted(channel: type, store: type) -> tuple[type, type]:
    """The store counts every second request it handles (and every reply)."""

    class HalfCounted(store):  # type: ignore[misc]
        _seen = 0

        def _handle(self, frames: list[bytes]) -> None:
            self._seen += 1
            if self._seen % 2:
                super()._handle(frames)
            else:  # handled, not counted
                self.requests -= 1
                super()._handle(frames)

    return channel, HalfCounted


def store_replies_uncounted(channel: type, store: type) -> tuple[type, type]:
    """The store's replies go uncounted (a message per request missing from the total)."""

    class Uncounted(store):  # type: ignore[misc]
        def _reply(self, routing: bytes, reply: Any) -> None:
            super()._reply(routing, reply)
            self.replies -= 1

    return channel, Uncounted

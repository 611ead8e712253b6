"""A store reply that came in time is taken by a thread that looks for it late (issue #42).

A rank's thread can run late: a busy host, a long GIL hold by another thread, a paused
process. At 16,384 simulated ranks on 2 cores, 4,112 store requests in one run were given up
on although their replies sat in the socket: the reader reached its deadline before it read,
took its coordinator for dead and rejoined (a handshake and a new arrival each), which
multiplied the coordinator's messages in the resizes. Both transports now read once more,
without waiting, at the deadline; each test makes its thread late on purpose and fails on
the code before.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import zmq

from slurm_etc.protocol import store as store_module
from slurm_etc.protocol.channel import CoordinatorChannel, WorkerChannel
from slurm_etc.protocol.store import StoreClient, StoreServer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LATE_S = 0.5  # how long the late thread does not look (the reply comes in milliseconds)


def test_over_the_channel_a_late_reader_takes_the_reply(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The store over the worker's channel (one connection a rank): the thread that waits
    for its reply wakes after its deadline; the reply is read, not given up on."""
    key = secrets.token_bytes(32)
    with CoordinatorChannel("late", key, "127.0.0.1") as c, \
            WorkerChannel("late", 0, c.address, key) as w:
        stop = threading.Event()

        def serve() -> None:  # the coordinator's side of the join
            while not stop.is_set():
                c.recv(0.05)

        served = threading.Thread(target=serve)
        served.start()
        w.join(10)
        stop.set()
        served.join()
        store = StoreClient.over(w, timeout=timedelta(seconds=5))
        store.set("warm", b"1")
        original = WorkerChannel.pump_until
        late: list[float] = []

        def runs_late(self: WorkerChannel, done: Callable[[], bool], deadline: float
                      ) -> None:
            time.sleep(LATE_S)  # the reply arrives meanwhile; the deadline passes
            late.append(time.monotonic())
            original(self, done, time.monotonic() - 1.0)

        monkeypatch.setattr(WorkerChannel, "pump_until", runs_late)
        store.set("k", b"v")  # unanswered before: StoreUnreachable
        assert late, "the late reader was not used"
        monkeypatch.setattr(WorkerChannel, "pump_until", original)
        assert store.get("k") == b"v"


class _LatePoller(zmq.Poller):
    """A poller whose first look comes late (after the reply came), past the deadline."""

    looks: list[int] = []

    def poll(self, timeout: Any = None) -> Any:
        time.sleep(LATE_S)
        _LatePoller.looks.append(timeout)
        return super().poll(timeout)


def test_over_its_own_connection_a_late_reader_takes_the_reply(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The store client on a connection of its own: the request's deadline passed before its
    first look (a grace below zero puts it in the past); the reply there is read."""
    key = secrets.token_bytes(32)
    with StoreServer(key, "127.0.0.1", job="late") as server:
        client = StoreClient(server.host, server.port, key, timeout=timedelta(seconds=1))
        try:
            client.set("warm", b"1")
            monkeypatch.setattr(store_module, "_REPLY_GRACE_S", -2.0)
            monkeypatch.setattr(store_module.zmq, "Poller", _LatePoller)
            client.set("k", b"v")  # unanswered before: StoreUnreachable
            assert _LatePoller.looks and _LatePoller.looks[0] == 0, _LatePoller.looks
            monkeypatch.undo()
            assert client.get("k") == b"v"
        finally:
            client.close()

"""The store client under many threads (issue #41): NCCL's heartbeat monitor asks the
global store's ``check`` once a second, each time from a new Python thread. A thread that
makes one request and ends must leave no socket behind (a socket per thread, kept for the
client's life, took a process to zmq's 1,023 sockets and "Too many open files" in minutes);
threads blocked in a wait still do not hold the others up; a connection in use when the
client is closed or repointed is not used again. The leaky client is planted to show the
count catches it."""
from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest

from slurm_etc.protocol import store as store_module
from slurm_etc.protocol.store import (
    IDLE_CONNECTIONS,
    StoreClient,
    StoreServer,
    StoreTimeout,
    StoreUnreachable,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

AT_ONCE = 4  # short-lived threads alive together
# Each connection costs the process about five descriptors (the TCP connection at both
# ends, the zmq mailboxes of the socket and of its monitor): room for a full idle pool and
# the requests in flight, and no more.
FDS_PER_CONNECTION = 5


@pytest.fixture
def key() -> bytes:
    return secrets.token_bytes(32)


@pytest.fixture
def server(key: bytes) -> Iterator[StoreServer]:
    with StoreServer(key, "127.0.0.1", job="j") as s:
        yield s


@pytest.fixture
def client(server: StoreServer, key: bytes) -> Iterator[StoreClient]:
    c = StoreClient(server.host, server.port, key, timeout=timedelta(seconds=5))
    yield c
    c.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@dataclass(frozen=True)
class Count:
    """What ``threads`` short-lived threads left behind: the client's open connections at
    most (counted between batches) and the process's file descriptors gained."""

    threads: int
    connections: int
    fds_gained: int

    @property
    def bounded(self) -> bool:
        most = IDLE_CONNECTIONS + AT_ONCE
        return self.connections <= most and self.fds_gained <= most * FDS_PER_CONNECTION


def _short_lived_threads(client: StoreClient, threads: int) -> Count:
    """``threads`` threads, :data:`AT_ONCE` at a time, each making its few requests and
    ending (as NCCL's heartbeat does once a second)."""
    client.set("there", b"1")
    before = _fds()
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            assert client.check(["there"])
            if i % 2:
                client.set(f"k{i % 7}", b"v")
                assert client.get(f"k{i % 7}") == b"v"
        except BaseException as e:  # noqa: BLE001 - the test thread reports it
            errors.append(e)

    most = 0
    for first in range(0, threads, AT_ONCE):
        batch = [threading.Thread(target=one, args=(i,))
                 for i in range(first, min(first + AT_ONCE, threads))]
        for t in batch:
            t.start()
        for t in batch:
            t.join(10)
        assert not errors, errors[0]
        most = max(most, client.open_connections)
    return Count(threads, most, _fds() - before)


def test_two_thousand_short_lived_threads_leave_no_sockets(client: StoreClient) -> None:
    t0 = time.monotonic()
    count = _short_lived_threads(client, 2000)
    assert count.bounded, count
    assert client.open_connections <= IDLE_CONNECTIONS
    assert time.monotonic() - t0 < 30


class _ConnectionPerThread(StoreClient):
    """Planted: the client before #41, a connection per thread kept for the client's life
    (never given back, so a dead thread's stays open)."""

    def __init__(self, host: str, port: int, secret: bytes, *, timeout: timedelta) -> None:
        super().__init__(host, port, secret, timeout=timeout)
        self._mine = threading.local()

    def _checkout(self) -> store_module._Connection:
        conn = getattr(self._mine, "conn", None)
        if conn is None:
            conn = self._mine.conn = super()._checkout()
        return conn

    def _checkin(self, conn: store_module._Connection, *, reusable: bool) -> None:
        pass

    def close(self) -> None:
        for conn in list(self._busy):
            conn.close()
        self._busy.clear()
        super().close()


def test_the_count_catches_a_connection_per_thread(server: StoreServer, key: bytes) -> None:
    leaky = _ConnectionPerThread(server.host, server.port, key, timeout=timedelta(seconds=5))
    try:
        count = _short_lived_threads(leaky, 100)  # the leak shows long before zmq's limit
    finally:
        leaky.close()
    assert not count.bounded, count
    assert count.connections >= 100 and count.fds_gained > 100 * 2, count


def test_a_blocked_wait_does_not_hold_up_other_threads(client: StoreClient) -> None:
    woke: list[float] = []

    def wait() -> None:
        client.wait(["late"], timedelta(seconds=10))
        woke.append(time.monotonic())

    waiter = threading.Thread(target=wait)
    waiter.start()
    _until(lambda: client.open_connections == 1)
    assert _short_lived_threads(client, 40).bounded  # the waiter's connection is its own
    assert not woke
    setter = threading.Thread(target=client.set, args=("late", b"here"))
    t0 = time.monotonic()
    setter.start()
    setter.join(5)
    waiter.join(5)
    assert woke and woke[0] - t0 < 2.0
    assert client.get("late") == b"here"


def test_a_burst_leaves_at_most_the_idle_bound_open(client: StoreClient) -> None:
    waiters = [threading.Thread(target=client.wait, args=(["gate"], timedelta(seconds=10)))
               for _ in range(IDLE_CONNECTIONS + 6)]
    for t in waiters:
        t.start()
    _until(lambda: client.open_connections == IDLE_CONNECTIONS + 6)
    client.set("gate", b"open")
    for t in waiters:
        t.join(5)
    assert not any(t.is_alive() for t in waiters)
    assert client.open_connections == IDLE_CONNECTIONS


def test_an_answered_request_gives_its_connection_back(client: StoreClient) -> None:
    with pytest.raises(StoreTimeout):  # the store answered "timeout": nothing more comes
        client.wait(["never"], timedelta(seconds=0.1))
    assert client.open_connections == 1
    assert client.check([]) and client.open_connections == 1


def test_an_unanswered_request_closes_its_connection(key: bytes,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """No answer in time: the answer may still come, on that socket, to a later request;
    it is closed, not given back."""
    monkeypatch.setattr(store_module, "_REPLY_GRACE_S", 0.2)
    gone = StoreServer(key, "127.0.0.1", job="j")
    gone.close()
    client = StoreClient(gone.host, gone.port, key, timeout=timedelta(seconds=0.1))
    try:
        with pytest.raises(StoreUnreachable):
            client.check(["k"])
        assert client.open_connections == 0
    finally:
        client.close()


def _close(client: StoreClient, server: StoreServer, other: StoreServer) -> StoreServer:
    client.close()
    return server


def _repoint(client: StoreClient, server: StoreServer, other: StoreServer) -> StoreServer:
    client.repoint(other.host, other.port)
    return other


@pytest.mark.parametrize("retire", [_close, _repoint], ids=["close", "repoint"])
def test_a_connection_in_use_at_close_is_not_used_again(
        server: StoreServer, key: bytes,
        retire: Callable[[StoreClient, StoreServer, StoreServer], StoreServer]) -> None:
    """Closed or repointed while a request waits: that request still ends (its socket is
    closed by it, not under it) and its connection is closed, not given back."""
    other = StoreServer(key, "127.0.0.1", job="j")
    client = StoreClient(server.host, server.port, key, timeout=timedelta(seconds=5))
    writer = StoreClient(server.host, server.port, key, timeout=timedelta(seconds=5))
    try:
        got: list[bytes] = []
        waiter = threading.Thread(target=lambda: got.append(client.get("k")))
        waiter.start()
        _until(lambda: client.open_connections == 1)
        (in_use,) = client._busy
        client.check([])  # a second connection, idle after
        assert client.open_connections == 2
        now = retire(client, server, other)
        assert client.open_connections == 1  # the idle one closed at once
        writer.set("k", b"old store's")
        waiter.join(5)
        assert got == [b"old store's"]
        assert in_use.sock.closed and in_use.monitor.closed
        assert client.open_connections == 0
        client.set("after", b"1")  # a new connection, to where the client points now
        assert now.stats()["keys"] == (1 if now is other else 2)
        assert client.open_connections == 1
    finally:
        client.close()
        writer.close()
        other.close()


def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    until = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < until, "condition not met in time"
        time.sleep(0.01)

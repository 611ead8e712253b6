"""One connection per worker rank (issue #42): the control channel and the rendezvous store
ride one TCP connection, so the coordinator's process holds one descriptor per rank.

On a worker, several threads use the one socket at once (the trainer's, gloo's and NCCL's
through ``PrefixStore``, a preparation thread): replies reach the thread that asked, orders
are not lost; a coordinator's process killed fails a blocked request at once; a peer without
the job's secret gets nothing of the merged socket; and the coordinator's descriptors grow by
one per worker (a worker with a store connection of its own, as before, shows as two).
"""
from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import msgspec
import psutil
import pytest
import zmq

from slurm_etc.protocol.channel import (
    STORE_FRAME,
    ChannelError,
    CoordinatorChannel,
    WorkerChannel,
)
from slurm_etc.protocol.keys import curve_keys, make_client
from slurm_etc.protocol.messages import Stop
from slurm_etc.protocol.store import Request, StoreClient, StoreUnreachable

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

JOB = "one"

# A coordinator's channel in a process of its own, answering every Hello; prints its port.
COORDINATOR_ALONE = """
import sys
from slurm_etc.protocol.channel import CoordinatorChannel
channel = CoordinatorChannel("one", bytes.fromhex(sys.stdin.readline().strip()), "127.0.0.1")
print(channel.port, flush=True)
while True:
    channel.recv(0.1)
"""


@pytest.fixture
def key() -> bytes:
    return secrets.token_bytes(32)


@pytest.fixture
def alone(key: bytes) -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen([sys.executable, "-c", COORDINATOR_ALONE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(key.hex() + "\n")
        proc.stdin.flush()
        yield proc, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def _serve(coordinator: CoordinatorChannel, stop: threading.Event) -> None:
    while not stop.is_set():
        coordinator.recv(0.05)


def test_store_and_channel_traffic_share_the_connection_from_many_threads(key: bytes) -> None:
    """Six threads make store requests (two of them block on keys another sets) while the
    coordinator sends 300 orders: every reply reaches the thread that asked, in order, and
    every order arrives once, in order."""
    with CoordinatorChannel(JOB, key, "127.0.0.1") as c, \
            WorkerChannel(JOB, 0, c.address, key) as w:
        stop = threading.Event()
        served = threading.Thread(target=_serve, args=(c, stop))
        served.start()
        w.join(10)
        stop.set()
        served.join()
        store = StoreClient.over(w, timeout=timedelta(seconds=30))
        errors: list[str] = []

        def counting(t: int) -> None:
            for i in range(150):
                if store.add(f"count/{t}", 1) != i + 1:
                    errors.append(f"thread {t}: add {i} answered out of turn")
                store.set(f"mine/{t}/{i}", f"{t}:{i}".encode())
                if store.get(f"mine/{t}/{i}") != f"{t}:{i}".encode():
                    errors.append(f"thread {t}: get {i} read another's value")

        def blocked(t: int) -> None:
            if store.get(f"late/{t}") != f"late {t}".encode():
                errors.append(f"thread {t}: a blocked get read another's value")

        threads = ([threading.Thread(target=counting, args=(t,)) for t in range(4)]
                   + [threading.Thread(target=blocked, args=(t,)) for t in (4, 5)])
        for t in threads:
            t.start()
        orders: list[int] = []
        for g in range(1, 301):
            while not c.send(0, Stop(JOB, g, "interleaved")):  # a full queue: again
                time.sleep(0.001)
            if g == 150:
                store.set("late/4", b"late 4")
                store.set("late/5", b"late 5")
            got = w.poll()
            if got is not None:
                orders.append(got.generation)
        deadline = time.monotonic() + 20
        while len(orders) < 300 and time.monotonic() < deadline:
            got = w.wait(0.1)
            if got is not None:
                orders.append(got.generation)
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert orders == list(range(1, 301))
        assert c.store.requests == store.requests == 4 * 450 + 2 + 2
        assert store.open_connections == 0  # none of its own: the channel's


def test_a_coordinator_killed_fails_a_blocked_request_at_once(
        alone: tuple[subprocess.Popen[str], int], key: bytes) -> None:
    """The coordinator's process SIGKILLed while a store request waits on it (its limit 30 s
    and the reply grace 10 s): the request raises StoreUnreachable within a couple of
    seconds, the client says it is disconnected, and the next request fails at once."""
    proc, port = alone
    with WorkerChannel(JOB, 0, f"tcp://127.0.0.1:{port}", key) as w:
        w.join(10)
        store = StoreClient.over(w, timeout=timedelta(seconds=30))
        store.set("here", b"1")
        assert not store.disconnected()
        failed: list[tuple[BaseException, float]] = []

        def wait() -> None:
            t0 = time.monotonic()
            try:
                store.wait(["never"])
            except BaseException as e:  # noqa: BLE001 - what it raised is the point
                failed.append((e, time.monotonic() - t0))

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.5)
        proc.kill()
        waiter.join(20)
        assert failed, "the request still waits on a dead coordinator"
        (err, took), = failed
        assert isinstance(err, StoreUnreachable) and "closed the connection" in str(err), err
        assert took < 0.5 + 2.0, took
        assert store.disconnected()
        t0 = time.monotonic()
        with pytest.raises(StoreUnreachable, match="closed the connection"):
            store.check(["here"])
        assert time.monotonic() - t0 < 0.5


def test_the_merged_socket_refuses_a_peer_without_the_secret(key: bytes) -> None:
    """Without the job's secret nothing of the socket is reachable: no Welcome for a worker
    channel, no answer to a store client or to a raw store request, nothing written."""
    with CoordinatorChannel(JOB, key, "127.0.0.1") as c:
        owner = StoreClient("127.0.0.1", c.port, key, timeout=timedelta(seconds=5))
        owner.set("plan", b"orders")
        other = secrets.token_bytes(32)
        with WorkerChannel(JOB, 1, c.address, other) as w:
            stop = threading.Event()
            served = threading.Thread(target=_serve, args=(c, stop))
            served.start()
            try:
                with pytest.raises(ChannelError, match="no welcome"):
                    w.join(1.0)
            finally:
                stop.set()
                served.join()
        bad = StoreClient("127.0.0.1", c.port, other, timeout=timedelta(seconds=0.2))
        with pytest.raises(StoreUnreachable):
            bad.set("plan", b"forged")
        bad.close()
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        make_client(raw, curve_keys(other))
        raw.connect(c.address)
        raw.send_multipart([STORE_FRAME, msgspec.msgpack.encode(
            Request(1, "set", ["plan"], [b"forged"]))])
        assert not raw.poll(1000)
        raw.close()
        ctx.term()
        assert owner.get("plan") == b"orders" and owner.num_keys() == 1
        deadline = time.monotonic() + 5
        while c.refused_handshakes < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.refused_handshakes >= 3
        assert c.vranks == frozenset()
        owner.close()


def test_the_coordinator_holds_one_connection_per_worker(
        alone: tuple[subprocess.Popen[str], int], key: bytes) -> None:
    """N workers joined, each making store requests from three threads at once: the
    coordinator's process gained N descriptors and holds N TCP connections. Ten more with a
    store connection of their own (the transport before #42) cost it two each."""
    proc, port = alone
    coordinator = psutil.Process(proc.pid)
    before = coordinator.num_fds()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    address = f"tcp://127.0.0.1:{port}"
    workers = [WorkerChannel(JOB, v, address, key, context=ctx) for v in range(40)]
    joins = [threading.Thread(target=w.join, args=(30.0,)) for w in workers]
    for t in joins:
        t.start()
    for t in joins:
        t.join()
    stores = [StoreClient.over(w, timeout=timedelta(seconds=10)) for w in workers]
    asking = [threading.Thread(target=s.add, args=(f"n/{i}", 1))
              for s in stores for i in range(3)]
    for t in asking:
        t.start()
    for t in asking:
        t.join()
    assert stores[0].num_keys() == 3

    def established() -> int:
        return sum(1 for x in coordinator.net_connections("tcp")
                   if x.status == psutil.CONN_ESTABLISHED and x.laddr.port == port)

    one = coordinator.num_fds() - before
    assert one == 40 and established() == 40, (one, established())
    own = [StoreClient("127.0.0.1", port, key) for _ in range(10)]
    extra = [WorkerChannel(JOB, 100 + v, address, key, context=ctx) for v in range(10)]
    for s in own:
        s.check([])
    for w in extra:
        w.join(30)
    two = coordinator.num_fds() - before - one
    assert two == 20 and established() == 60, (two, established())
    for s in own:
        s.close()
    for w in workers + extra:
        w.close(linger_s=0)
    ctx.term()

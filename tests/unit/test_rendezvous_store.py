"""The job's rendezvous store (slurm_etc.protocol.store) over real sockets on 127.0.0.1:
torch Store semantics (as TCPStore's), bounds, retirement of past generations, server-side
waits and timeouts from several threads, gloo rendezvous through it, peers without the
secret dropped at the handshake, the bind address, and the channel's multipart flood."""
from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import msgspec
import psutil
import pytest
import torch
import torch.distributed as dist
import zmq

from slurm_etc.protocol.channel import CoordinatorChannel, WorkerChannel
from slurm_etc.protocol.keys import curve_keys, make_client
from slurm_etc.protocol.messages import Hello
from slurm_etc.protocol.rendezvous import (
    GenerationKeys,
    commit_decision,
    installing,
    migration_group_prefix,
    train_group_prefix,
)
from slurm_etc.protocol.store import (
    Request,
    StoreClient,
    StoreFull,
    StoreInterrupted,
    StoreLimits,
    StoreServer,
    StoreTimeout,
    StoreUnreachable,
    wait_for_keys,
)
from slurm_etc.protocol.values import BadValue, decode_value, encode_value

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

ATTACKER = Path(__file__).parents[1] / "dist" / "rendezvous_attacker.py"
SMALL = StoreLimits(value_bytes=1024, key_bytes=64, keys=20, total_bytes=4096)


@pytest.fixture
def key() -> bytes:
    return secrets.token_bytes(32)


@pytest.fixture
def server(key: bytes) -> Iterator[StoreServer]:
    with StoreServer(key, "127.0.0.1", job="j", limits=SMALL) as s:
        yield s


@pytest.fixture
def client(server: StoreServer, key: bytes) -> Iterator[StoreClient]:
    c = StoreClient(server.host, server.port, key, timeout=timedelta(seconds=5))
    yield c
    c.close()


def test_store_semantics_match_tcpstore(client: StoreClient) -> None:
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=5))
    for s in (client, tcp):
        s.set("a", "x")
        s.set("b", b"\x00\xff")
        got = [s.get("a"), s.get("b"), s.add("n", 2), s.add("n", 3), s.get("n"),
               s.compare_set("c", "", "first"), s.compare_set("c", "", "second"),
               s.compare_set("c", "first", "third"), s.compare_set("missing", "x", "y"),
               s.check(["a", "b"]), s.check(["a", "nope"]), s.delete_key("a"),
               s.delete_key("a"), s.check(["a"]), s.multi_get(["b", "n"])]
        s.multi_set(["m1", "m2"], [b"1", "2"])
        got += [s.multi_get(["m1", "m2"])]
        if s is client:
            ours = got
    assert ours == got, (ours, got)
    # b, n, c, m1, m2: compare_set of a missing key with a non-empty expected value sets
    # nothing (as TCPStore)
    assert client.num_keys() == 5 and not client.check(["missing"])


def test_values_bound_keys_bound_total_bound(client: StoreClient, server: StoreServer
                                             ) -> None:
    with pytest.raises(StoreFull, match="at most 1024"):
        client.set("big", b"x" * 1025)
    with pytest.raises(StoreFull, match="64"):
        client.set("k" * 65, b"")
    for i in range(3):
        client.set(f"v{i}", b"x" * 1024)
    with pytest.raises(StoreFull, match="bytes"):
        client.set("v3", b"x" * 1024)  # 4 x (1024 + 2) > 4096
    assert server.stats()["bytes"] < SMALL.total_bytes
    for i in range(3):
        assert client.delete_key(f"v{i}")
    for i in range(SMALL.keys):
        client.set(f"k{i}", b"")
    with pytest.raises(StoreFull, match="keys"):
        client.set("one-more", b"")
    with pytest.raises(StoreFull):
        client.multi_set(["x1", "x2"], [b"", b""])
    client.set("k0", b"an overwrite needs no new key")
    with pytest.raises(StoreFull):
        client.add("counter", 1)
    stats = server.stats()
    assert stats["keys"] == SMALL.keys and stats["refused"] >= 6
    assert client.get("k0") == b"an overwrite needs no new key"  # still serving


def test_bounds_hold_against_the_wire_too(server: StoreServer, key: bytes) -> None:
    """A request bigger than any allowed value is cut by zmq (MAXMSGSIZE), not buffered."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    make_client(s, curve_keys(key))
    s.connect(f"tcp://127.0.0.1:{server.port}")
    s.send(msgspec.msgpack.encode(Request(1, "set", ["huge"], [b"x" * (8 << 20)])))
    assert not s.poll(1000)  # dropped with the connection: no answer, nothing stored
    assert server.stats()["keys"] == 0
    s.close()
    ctx.term()


def test_past_generations_are_retired(client: StoreClient, server: StoreServer) -> None:
    for k in ("j/g0/agree/3/0", "j/g0.1/x", "j/g1/train/0", "j/g2/commit", "j/g10/x",
              "jj/g0/x", "other"):
        client.set(k, b"1")
    assert server.retire_generations(2) == 3
    assert not client.check(["j/g0/agree/3/0"]) and not client.check(["j/g1/train/0"])
    assert not client.check(["j/g0.1/x"])
    assert client.check(["j/g2/commit", "j/g10/x", "jj/g0/x", "other"])


def _every_key(g: GenerationKeys) -> list[str]:
    return [g.train_group + "/0", g.agreement(0, 5, 1), g.agreement(2, 5, 1),
            g.trainer, g.model, g.last_ended, g.rng(3), g.holdings(7),
            migration_group_prefix(g.prefix) + "/rank_0", installing(g.prefix, 2),
            train_group_prefix(g.prefix) + "/1", commit_decision(g.prefix)]


def test_every_key_workers_name_is_retired_with_its_generation(
        client: StoreClient, server: StoreServer) -> None:
    """The names of protocol/rendezvous.py all fall under their generation: a committed
    generation 2 deletes every key of generation 1 and none of its own."""
    old, new = _every_key(GenerationKeys("j", 1)), _every_key(GenerationKeys("j", 2))
    assert len(set(old)) == len(old)
    kept = new[:20 - len(old)]  # the fixture's store holds at most 20 keys
    client.multi_set(old + kept, [b"1"] * (len(old) + len(kept)))
    assert server.retire_generations(2) == len(old)
    assert not any(client.check([k]) for k in old)
    assert client.check(kept)
    client.multi_set(new[len(kept):], [b"1"] * (len(new) - len(kept)))
    assert server.retire_generations(2) == 0 and client.check(new)


def test_wait_and_get_block_on_the_server_and_time_out(client: StoreClient) -> None:
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout):
        client.wait(["late"], timedelta(seconds=0.3))
    took = time.monotonic() - t0
    assert 0.25 < took < 2.0
    assert not wait_for_keys(client, ["late"], 0.1)
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(client.get("late")))
    waiter.start()
    time.sleep(0.3)
    assert not got  # blocked, and this thread's requests still go through the same client
    client.set("other", b"1")
    assert client.check(["other"])
    client.set("late", b"here")
    waiter.join(5)
    assert got == [b"here"]
    assert wait_for_keys(client, ["late", "other"], 1.0)


def test_a_wait_given_an_interrupt_ends_when_it_says_why(client: StoreClient) -> None:
    # soak seed 201: a rank connecting a resize's group waited 60 s for the key of a peer
    # that died, and missed the coordinator's next order; with ``interrupt`` set it asks
    # between slices and gives up when there is a reason
    asked: list[float] = []

    def interrupt() -> str | None:
        asked.append(time.monotonic())
        return "the coordinator aborted it" if len(asked) >= 2 else None

    client.interrupt = interrupt
    t0 = time.monotonic()
    with pytest.raises(StoreInterrupted, match="the coordinator aborted it"):
        client.wait(["never"], timedelta(seconds=30))
    assert len(asked) == 2 and time.monotonic() - t0 < 10.0
    with pytest.raises(StoreInterrupted):
        client.get("never")
    # a key that comes between slices is read; nothing to interrupt: a plain timeout
    client.interrupt = lambda: None
    threading.Timer(1.5, client.set, ("soon", b"1")).start()
    client.wait(["soon"], timedelta(seconds=10))
    assert client.get("soon") == b"1"
    with pytest.raises(StoreTimeout, match="timed out after 1.5 s"):
        client.wait(["never"], timedelta(seconds=1.5))
    client.interrupt = None


def test_a_get_after_a_wait_reads_what_the_wait_fetched(client: StoreClient, key: bytes,
                                                        server: StoreServer) -> None:
    """gloo's wait-then-get of a peer's address costs one round trip: the get reads the
    value the wait fetched (once), and this client's own changes to the key are seen."""
    other = StoreClient(server.host, server.port, key, timeout=timedelta(seconds=5))
    other.set("addr", b"peer-1")
    client.wait(["addr"])
    other.delete_key("addr")  # the server no longer has it: the get below cannot ask it
    assert client.get("addr") == b"peer-1"
    with pytest.raises(StoreTimeout):  # held once: the next request asks the server
        client.wait(["addr"], timedelta(seconds=0.2))
    other.set("addr", b"peer-2")
    client.wait(["addr"])
    client.set("addr", b"mine")  # read-your-writes, as TCPStore
    assert client.get("addr") == b"mine"
    client.wait(["addr"])
    assert client.add("addr2", 1) == 1 and client.get("addr") == b"mine"
    client.wait(["addr"])
    client.delete_key("addr")
    assert not client.check(["addr"])
    other.close()
    # as TCPStore does, for the sequences gloo and the resize use
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=5))
    seen = []
    for s in (client, tcp):
        s.set("w", b"1")
        s.wait(["w"])
        got = [s.get("w")]
        s.wait(["w"])
        s.set("w", b"2")
        got.append(s.get("w"))
        s.wait(["w"])
        s.multi_set(["w"], [b"3"])
        got.append(s.get("w"))
        seen.append(got)
    assert seen[0] == seen[1] == [b"1", b"2", b"3"]


def test_many_threads_wait_through_one_client(client: StoreClient) -> None:
    keys = [f"t{i}" for i in range(8)]
    done: list[int] = []

    def rank(i: int) -> None:
        client.set(keys[i], b"x")
        client.wait(keys, timedelta(seconds=10))
        done.append(i)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert sorted(done) == list(range(8))


def test_gloo_rendezvous_through_the_store(server: StoreServer, key: bytes) -> None:
    big = StoreServer(key, "127.0.0.1", job="j")  # gloo's keys do not fit SMALL
    results: list[float] = []

    def rank(r: int) -> None:
        c = StoreClient(big.host, big.port, key, timeout=timedelta(seconds=30))
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", c), r, 2, timedelta(seconds=30))
        t = torch.ones(1) * (r + 1)
        pg.allreduce([t]).wait()
        results.append(float(t[0]))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    big.close()
    assert results == [3.0, 3.0]


def test_peers_without_the_secret_are_dropped_at_the_handshake(server: StoreServer,
                                                               client: StoreClient) -> None:
    client.set("secret-plan", b"orders")
    # a torch TCPStore client
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises, it gets nothing
        dist.TCPStore("127.0.0.1", server.port, is_master=False,
                      timeout=timedelta(seconds=1)).list_keys()
    # a zmq peer without CURVE, and one with keys of another secret
    ctx = zmq.Context()
    for keys in (None, curve_keys(secrets.token_bytes(32))):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            make_client(s, keys)
        s.connect(f"tcp://127.0.0.1:{server.port}")
        s.send(msgspec.msgpack.encode(Request(1, "multi_get", ["secret-plan"])))
        s.send(msgspec.msgpack.encode(Request(2, "set", ["secret-plan"], [b"forged"])))
        assert not s.poll(1000)
        s.close()
    # the job's own client with the wrong secret fails the same way
    bad = StoreClient(server.host, server.port, secrets.token_bytes(32),
                      timeout=timedelta(seconds=0.2))
    with pytest.raises(StoreUnreachable, match="no answer|refused this client's secret"):
        bad.check(["secret-plan"])
    bad.close()
    ctx.term()
    assert client.get("secret-plan") == b"orders"
    deadline = time.monotonic() + 5
    while server.refused_handshakes < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.refused_handshakes >= 3


def test_listens_only_on_the_bind_address(key: bytes) -> None:
    with StoreServer(key, "127.0.0.1", job="j") as s:
        mine = [c for c in psutil.Process().net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == s.port]
        assert [c.laddr.ip for c in mine] == ["127.0.0.1"]


def test_values_never_unpickle() -> None:
    import os
    import pickle

    value = {"step": 3, "scheduler": {"lr": 0.1, "style": "cosine"},
             "rng": [torch.arange(4, dtype=torch.uint8)], "scale": torch.tensor(2.0),
             "none": None, "raw": b"\x00"}
    back = decode_value(encode_value(value))
    assert back["step"] == 3 and back["scheduler"] == value["scheduler"]
    assert torch.equal(back["rng"][0], value["rng"][0]) and float(back["scale"]) == 2.0
    for evil in (pickle.dumps(os.getcwd), b"\xc1", b"\xd4\x07\x00"):  # pickle, bad, ext 7
        with pytest.raises(BadValue):
            decode_value(evil)


def test_channel_multipart_flood_from_a_peer_without_the_secret(key: bytes) -> None:
    """Finding 5: a never-ending multipart message of 8 MiB frames (a process of its own,
    so its own buffers are not counted) does not grow the coordinator, which keeps
    serving its workers."""
    with CoordinatorChannel("j", key, "127.0.0.1") as c:
        me = psutil.Process()
        base = me.memory_info().rss
        attacker = subprocess.Popen([sys.executable, str(ATTACKER), "flood", str(c.port),
                                     "64"], stdout=subprocess.PIPE, text=True)
        peak = base
        try:
            while attacker.poll() is None:
                c.recv(0.1)
                peak = max(peak, me.memory_info().rss)
        finally:
            accepted, _ = attacker.communicate(timeout=60)
        assert peak - base < 64 * 2**20, f"grew by {(peak - base) / 2**20:.0f} MiB"
        assert int(accepted) < 64 * (8 << 20)  # the connection was closed on it
        assert c.refused_handshakes >= 1
        with WorkerChannel("j", 0, c.address, key) as w:
            w.report(Hello("j", 0, 0, "h", 1))
            got = c.recv(5)
            assert got is not None and got[0] == 0


def test_agreement_in_one_round_trip(client: StoreClient, server: StoreServer) -> None:
    """What ElasticTrainer._agree sends: set, delete step - 2, all keys' values or None."""
    from slurm_etc.protocol.store import agree_step

    client.set("j/g0/agree/1/0", b"old")
    keys = ["j/g0/agree/3/0", "j/g0/agree/3/1"]
    t0 = time.monotonic()
    assert agree_step(client, keys[0], b"-", "j/g0/agree/1/0", keys, 0.2) is None
    assert 0.15 < time.monotonic() - t0 < 2.0
    assert not client.check(["j/g0/agree/1/0"]) and client.check([keys[0]])
    got: list[list[bytes] | None] = []
    t = threading.Thread(target=lambda: got.append(
        agree_step(client, keys[0], b"-", "", keys, 5.0)))
    t.start()
    time.sleep(0.2)
    assert agree_step(client, keys[1], b"stop", "", keys, 5.0) == [b"-", b"stop"]
    t.join(5)
    assert got == [[b"-", b"stop"]]
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tcp.set(keys[1], b"stop")
    assert agree_step(tcp, keys[0], b"-", "", keys, 1.0) == [b"-", b"stop"]


def test_arriving_at_a_decision_is_one_round_trip(client: StoreClient, server: StoreServer
                                                 ) -> None:
    """What ElasticTrainer._arrive sends (issue #42): the proposal (the first is the
    decision), the count, the last of the world closing "-" where nobody proposed, and the
    wait for the decision, in one request; the same steps on torch's TCPStore."""
    from slurm_etc.protocol.store import arrive_step

    names = GenerationKeys("j", 0)
    decided, arrived = names.agreement(0, 5, "decided"), names.agreement(0, 5, "arrived")
    own = [names.agreement(0, 5, r) for r in range(3)]
    before = server.requests
    # the first of three, with nothing to propose: counted in, the decision still open
    assert arrive_step(client, decided, arrived, 3, b"", own[0], "", 0.2) is None
    assert server.requests == before + 1
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(
        arrive_step(client, decided, arrived, 3, b"order 2", own[1], "", 5.0)))
    t.start()
    t.join(5)
    assert got == [[b"order 2"]]  # its proposal is the decision, answered at once
    # the last one proposes too: the first proposal stands
    assert arrive_step(client, decided, arrived, 3, b"order 3", own[2], "", 5.0) == \
        [b"order 2"]
    assert client.get(arrived) == b"3"
    # nobody proposed: the last of the world closes the decision with "-"
    closed = names.agreement(0, 6, "decided")
    count = names.agreement(0, 6, "arrived")
    assert arrive_step(client, closed, count, 2, b"", own[0], "", 0.1) is None
    assert arrive_step(client, closed, count, 2, b"", own[1], "", 1.0) == [b"-"]
    assert not server._blocked and not server._waiters
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert arrive_step(tcp, closed, count, 1, b"", own[0], "", 1.0) == [b"-"]


def test_an_order_naming_the_dead_ends_the_agreement_at_once(key: bytes) -> None:
    """A survivor waits at a step boundary for a dead peer's vote that never comes; the
    coordinator's order naming the dead, set under the generation's ``lost`` key, answers
    that wait the moment it is set (not at the end of the slice), once per new value; and
    the server forgets the woken and the answered waits (nothing kept per step)."""
    from slurm_etc.protocol.store import Woken, agree_step

    with StoreServer(key, "127.0.0.1", job="j") as server:
        survivor = StoreClient("127.0.0.1", server.port, key)
        coordinator = StoreClient("127.0.0.1", server.port, key)
        wake = GenerationKeys("j", 3).lost
        keys = [GenerationKeys("j", 3).agreement(0, 7, r) for r in range(2)]
        got: list[object] = []
        t = threading.Thread(target=lambda: got.append(agree_step(
            survivor, keys[0], b"-", "", keys, 30.0, wake=wake)))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.2)
        coordinator.set(wake, b"order 4")
        t.join(5)
        assert got == [Woken(b"order 4")]
        assert time.monotonic() - t0 < 1.0  # not the slice of 30 s
        # the same order seen: it waits (and times out) as before; a newer one wakes at once
        assert agree_step(survivor, keys[0], b"-", "", keys, 0.2, wake=wake,
                          seen=b"order 4") is None
        assert agree_step(survivor, keys[0], b"-", "", keys, 0.2, wake=wake,
                          seen=b"order 2") == Woken(b"order 4")
        # answered normally: nothing of it stays behind on the server
        coordinator.set(keys[1], b"-")
        assert agree_step(survivor, keys[0], b"-", "", keys, 5.0, wake=wake,
                          seen=b"order 4") == [b"-", b"-"]
        assert not server._blocked and not server._waiters and not server._wakers
        survivor.close()
        coordinator.close()


def test_a_committed_resize_retires_the_generations_before_it(key: bytes) -> None:
    """The channel's wiring: a worker's authenticated Resized "committed" of generation g
    makes the store it hosts drop every key of generations < g."""
    from slurm_etc.protocol.messages import Resized

    with CoordinatorChannel("j", key, "127.0.0.1") as c, \
            WorkerChannel("j", 0, c.address, key) as w:
        client = StoreClient("127.0.0.1", c.port, key)
        for k in ("j/g0/agree/5/0", "j/g1/trainer", "j/g1/train/x", "j/g2/commit"):
            client.set(k, b"1")
        w.report(Resized("j", 1, 0, "aborted", 5))
        w.report(Resized("j", 2, 0, "committed", 5))
        got = [c.recv(5), c.recv(5)]
        assert [type(g[1]).__name__ for g in got if g] == ["Resized", "Resized"]
        assert not client.check(["j/g0/agree/5/0"]) and not client.check(["j/g1/trainer"])
        assert client.check(["j/g2/commit"]) and client.num_keys() == 1
        client.close()


SERVER_ALONE = """
import sys, time
from slurm_etc.protocol.store import StoreServer
server = StoreServer(bytes.fromhex(sys.stdin.readline().strip()), "127.0.0.1", job="j")
server.__enter__()
print(server.port, flush=True)
time.sleep(600)
"""


def test_a_request_on_a_store_that_died_fails_at_once(key: bytes) -> None:
    """The store's process SIGKILLed (a coordinator killed) while a request waits on it: the
    client hears the connection close and raises StoreUnreachable at once, not after the
    request's limit and the reply grace (here 30 + 10 s), so a worker holds for a restarted
    coordinator within a second of the kill."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER_ALONE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(key.hex() + "\n")
        proc.stdin.flush()
        port = int(proc.stdout.readline())
        client = StoreClient("127.0.0.1", port, key, timeout=timedelta(seconds=30))
        client.set("here", b"1")
        failed: list[tuple[BaseException, float]] = []

        def wait() -> None:
            t0 = time.monotonic()
            try:
                client.wait(["never"])
            except BaseException as e:  # noqa: BLE001 - what it raised is the point
                failed.append((e, time.monotonic() - t0))

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.5)
        proc.kill()
        waiter.join(20)
        assert failed, "the request still waits on a dead store"
        (err, took), = failed
        assert isinstance(err, StoreUnreachable) and "closed the connection" in str(err), err
        assert took < 0.5 + 3.0, took
        with pytest.raises(StoreUnreachable):  # the next request, on a new socket: no store
            client.wait(["never"], timedelta(seconds=0.2))
        client.close()
    finally:
        proc.kill()
        proc.wait()

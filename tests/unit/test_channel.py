"""Control channel: round trips over real sockets on 127.0.0.1, every rejection reason, fuzzed
parsers, the secret file's permissions, and no secret in logs."""
from __future__ import annotations

import base64
import logging
import math
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_etc.protocol import channel as channel_module
from slurm_etc.protocol import env as envvars
from slurm_etc.protocol.channel import (
    COORDINATOR,
    MAC_BYTES,
    PROTOCOL_VERSION,
    ChannelError,
    CoordinatorChannel,
    Envelope,
    JobSecret,
    Opener,
    Rejected,
    Sealer,
    SecretError,
    Welcome,
    WorkerChannel,
    create_secret,
    decode_report,
    decode_to_worker,
    load_secret,
)
from slurm_etc.protocol.keys import ZapGuard, curve_keys, make_client, make_server
from slurm_etc.protocol.messages import (
    ENCODER,
    Abort,
    Control,
    Exited,
    Hello,
    LayoutSpec,
    Progress,
    Resize,
    Resized,
    Stop,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

JOB = "job42"
PING_S = 2.0  # libzmq's heartbeat in the liveness test (the job's is longer)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture
def key() -> bytes:
    return secrets.token_bytes(32)


@pytest.fixture
def coordinator(key: bytes) -> Iterator[CoordinatorChannel]:
    with CoordinatorChannel(JOB, key, "127.0.0.1") as c:
        yield c


def worker(coordinator: CoordinatorChannel, key: bytes, vrank: int = 0, *,
           job: str = JOB, generation: int = 0) -> WorkerChannel:
    return WorkerChannel(job, vrank, coordinator.address, key, generation=generation)


def join(coordinator: CoordinatorChannel, w: WorkerChannel) -> Welcome:
    """Hello -> (coordinator answers) -> Welcome, the coordinator receiving in a thread."""
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(coordinator.recv(10)))
    t.start()
    welcome = w.join(timeout_s=10)
    t.join()
    assert got and got[0] is not None
    vrank, hello = got[0]  # type: ignore[misc]
    assert vrank == w.vrank and isinstance(hello, Hello)
    return welcome


def resize(generation: int) -> Resize:
    return Resize(JOB, generation, LayoutSpec.make("dp=2,tp=1,pp=1", (0, 1)),
                  LayoutSpec.make("dp=4,tp=1,pp=1", (0, 1, 2, 3), True), plan_digest="abc",
                  deadline=1_900_000_000.0, reason="grant")


def raw_dealer(coordinator: CoordinatorChannel, key: bytes) -> zmq.Socket:
    """A peer that holds the job's secret (it passes the CURVE handshake) and sends what
    it likes: what the envelope checks behind the transport must reject."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    make_client(s, curve_keys(key))
    s.connect(coordinator.address)
    return s


def recv_until_rejected(coordinator: CoordinatorChannel, reason: str, n: int = 1) -> None:
    deadline = time.monotonic() + 5
    while coordinator.rejected[reason] < n and time.monotonic() < deadline:
        assert coordinator.recv(0.05) is None
    assert coordinator.rejected[reason] >= n, coordinator.rejected


# --------------------------------------------------------------------------- round trips


def test_round_trip_hello_welcome_orders_reports(coordinator: CoordinatorChannel,
                                                 key: bytes) -> None:
    with worker(coordinator, key, vrank=3) as w:
        ctl: Control = w  # the trainer sees only the Control protocol
        welcome = join(coordinator, w)
        # the store is on the channel's own connection: the Welcome names its address
        assert welcome == Welcome(JOB, 0, 3, "127.0.0.1", coordinator.port)
        assert w.rendezvous == welcome and welcome.store == f"127.0.0.1:{coordinator.port}"
        assert coordinator.vranks == {3}

        order = resize(1)
        assert coordinator.send(3, order)
        assert ctl.wait(5) == order
        assert w.generation == 1
        assert ctl.poll() is None

        reports = [Progress(JOB, 1, 3, 10, 2.5, 1e-4, 640, "dp=4,tp=1,pp=1"),
                   Resized(JOB, 1, 3, "committed", 10, 0.5, 0.2, 1 << 20, 1 << 21),
                   Exited(JOB, 1, 3, "stopped", 11)]
        for r in reports:
            ctl.report(r)
        assert [coordinator.recv(5) for _ in reports] == [(3, r) for r in reports]
        assert coordinator.recv(0.05) is None
        assert sum(coordinator.rejected.values()) == 0
        assert sum(w.rejected.values()) == 0


def test_broadcast_reaches_every_worker_and_names_the_rest(coordinator: CoordinatorChannel,
                                                           key: bytes) -> None:
    ws = [worker(coordinator, key, vrank=v) for v in (0, 1)]
    try:
        for w in ws:
            join(coordinator, w)
        stop = Stop(JOB, 0, "done")
        assert coordinator.broadcast(stop, [0, 1, 7]) == [7]
        assert [w.wait(5) for w in ws] == [stop, stop]
    finally:
        for w in ws:
            w.close()


def test_poll_never_blocks_and_wait_times_out(coordinator: CoordinatorChannel,
                                              key: bytes) -> None:
    with worker(coordinator, key) as w:
        t = time.monotonic()
        for _ in range(100):
            assert w.poll() is None
        assert time.monotonic() - t < 0.5
        t = time.monotonic()
        assert w.wait(0.2) is None
        assert 0.15 <= time.monotonic() - t < 2


def test_report_never_blocks_without_a_coordinator(key: bytes) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = WorkerChannel(JOB, 0, f"tcp://127.0.0.1:{port}", key, queue_limit=5)
    try:
        t = time.monotonic()
        for step in range(500):
            w.report(Progress(JOB, 0, 0, step, 1.0, 0.1, step, "dp=1,tp=1,pp=1"))
        assert time.monotonic() - t < 2.0
        assert w.dropped > 0
    finally:
        w.close(linger_s=0)


def test_report_from_another_thread_while_waiting(coordinator: CoordinatorChannel,
                                                  key: bytes) -> None:
    with worker(coordinator, key, vrank=2) as w:
        join(coordinator, w)
        done = threading.Event()

        def reporter() -> None:
            for step in range(20):
                t = time.monotonic()
                w.report(Progress(JOB, 0, 2, step, 1.0, 0.1, step, "dp=1,tp=1,pp=1"))
                assert time.monotonic() - t < 0.5  # a waiting reader never holds it up
            done.set()

        t = threading.Thread(target=reporter)
        t.start()
        assert w.wait(0.5) is None   # the main thread waits for orders meanwhile
        t.join()
        assert done.is_set()
        steps = []
        while (got := coordinator.recv(2)) is not None:
            steps.append(got[1].step)  # type: ignore[union-attr]
            if len(steps) == 20:
                break
        assert steps == list(range(20))


def test_orders_of_an_older_generation_and_resends_are_ignored(
        coordinator: CoordinatorChannel, key: bytes) -> None:
    with worker(coordinator, key, vrank=1, generation=2) as w:
        join(coordinator, w)
        order = resize(3)
        coordinator.send(1, Stop(JOB, 1, "stale"))
        coordinator.send(1, order)
        coordinator.send(1, order)  # resent: delivered once
        coordinator.send(1, Abort(JOB, 3, "someone failed"))
        coordinator.send(1, Stop(JOB, 2, "older than the resize"))
        assert [w.wait(2) for _ in range(2)] == [order, Abort(JOB, 3, "someone failed")]
        assert w.generation == 3
        assert w.wait(0.3) is None
        assert w.rejected["old_generation"] == 2
        assert w.rejected["duplicate"] == 1


def test_hello_is_answered_again_and_worker_restart_is_accepted(
        coordinator: CoordinatorChannel, key: bytes) -> None:
    with worker(coordinator, key, vrank=5) as w:
        join(coordinator, w)
    # A new process for the same vrank: new session, sequence numbers from 1 again.
    with worker(coordinator, key, vrank=5) as w2:
        join(coordinator, w2)
        assert coordinator.send(5, Stop(JOB, 0))
        assert w2.wait(5) == Stop(JOB, 0)
    assert coordinator.rejected["replay"] == 0


def test_a_process_before_the_newest_of_a_vrank_does_not_take_its_orders(
        coordinator: CoordinatorChannel, key: bytes) -> None:
    """An idle joiner of an aborted resize (generation 1) still exiting when the retry's
    joiner of the same vrank (generation 2) said Hello: the old one's reports are taken,
    but the retry's order goes to the new one; the new one's own reports (a reconnect
    gets a new route) still move the route."""
    with worker(coordinator, key, vrank=3, generation=1) as old:
        join(coordinator, old)
        with worker(coordinator, key, vrank=3, generation=2) as new:
            join(coordinator, new)
            old.report(Progress(JOB, 1, 3, 7, 1.0, 0.1, 56, "dp=4,tp=1,pp=1"))
            got = coordinator.recv(5)
            assert got is not None and got[1].generation == 1  # taken
            assert coordinator.send(3, resize(2))
            assert new.wait(5) == resize(2)
            assert old.wait(0.3) is None
            new.report(Progress(JOB, 2, 3, 8, 1.0, 0.1, 64, "dp=4,tp=1,pp=1"))
            assert coordinator.recv(5) is not None
            assert coordinator.send(3, Stop(JOB, 3))
            assert new.wait(5) == Stop(JOB, 3)


def test_join_times_out_with_one_clear_error(key: bytes) -> None:
    with WorkerChannel(JOB, 0, "tcp://127.0.0.1:9", key) as w:  # nobody listens there
        with pytest.raises(ChannelError, match="no welcome from the coordinator"):
            w.join(timeout_s=0.3)


def test_send_to_unknown_vrank_is_false(coordinator: CoordinatorChannel) -> None:
    assert coordinator.send(9, Stop(JOB, 0)) is False
    with pytest.raises(ValueError, match="job 'other'"):
        coordinator.send(9, Stop("other", 0))


def test_a_gone_vrank_is_said_unreachable_once_until_it_says_hello_again(
        coordinator: CoordinatorChannel, key: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """A relaunched vrank's old process is gone until its new one says hello: the heartbeats
    sent meanwhile say so once (they filled the Slurm tier's log every 2 s per vrank)."""
    with worker(coordinator, key, vrank=3) as w:
        join(coordinator, w)
    caplog.set_level(logging.INFO, logger="slurm_etc.protocol.channel")
    deadline = time.monotonic() + 5
    while coordinator.send(3, Stop(JOB, 0)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the disconnect reaches the router a moment later
    for _ in range(5):
        assert coordinator.send(3, Stop(JOB, 0)) is False
    said = [r for r in caplog.records if "vrank 3 unreachable" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, said
    with worker(coordinator, key, vrank=3) as w2:
        join(coordinator, w2)
        assert coordinator.send(3, Stop(JOB, 0))
    caplog.clear()
    while coordinator.send(3, Stop(JOB, 0)) and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    assert [r.levelno for r in caplog.records
            if "vrank 3 unreachable" in r.getMessage()] == [logging.INFO]


def test_report_for_another_vrank_is_a_bug(coordinator: CoordinatorChannel, key: bytes) -> None:
    with worker(coordinator, key, vrank=1) as w:
        with pytest.raises(ValueError):
            w.report(Exited(JOB, 0, 2, "x"))


def test_bind_and_advertise(key: bytes) -> None:
    with pytest.raises(ChannelError, match="advertise"):
        CoordinatorChannel(JOB, key, "0.0.0.0")
    with CoordinatorChannel(JOB, key, "0.0.0.0", advertise="127.0.0.1") as c:
        assert c.address == f"tcp://127.0.0.1:{c.port}"
        assert c.bind == f"0.0.0.0:{c.port}"
        with pytest.raises(ChannelError, match="cannot bind"):
            CoordinatorChannel(JOB, key, f"127.0.0.1:{c.port}")
    with pytest.raises(ChannelError, match="bind address"):
        CoordinatorChannel(JOB, key, "127.0.0.1:http")


# --------------------------------------------------------------------------- rejections


def test_wrong_secret_is_dropped_at_the_handshake(coordinator: CoordinatorChannel) -> None:
    with worker(coordinator, secrets.token_bytes(32)) as w:
        w.report(Hello(JOB, 0, 0, "h", 1))
        deadline = time.monotonic() + 5
        while coordinator.refused_handshakes < 1 and time.monotonic() < deadline:
            assert coordinator.recv(0.05) is None
    assert coordinator.refused_handshakes >= 1
    assert sum(coordinator.rejected.values()) == 0  # nothing of it reached the checks
    assert coordinator.vranks == frozenset()


def fake_coordinator(key: bytes) -> tuple[zmq.Socket, str]:
    """A ROUTER with the CURVE keys of ``key`` (its context admits the job's client key)."""
    ctx = zmq.Context()
    keys = curve_keys(key)
    ZapGuard(ctx, {keys.client_public})  # lives as long as the context
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    make_server(router, keys)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, f"tcp://127.0.0.1:{port}"


def test_worker_reaches_no_coordinator_of_another_secret(key: bytes) -> None:
    router, address = fake_coordinator(secrets.token_bytes(32))
    with WorkerChannel(JOB, 0, address, key) as w:
        w.report(Hello(JOB, 0, 0, "h", 1))
        assert not router.poll(1000)  # the handshake failed: nothing arrives
        assert w.wait(0.2) is None and w.rendezvous is None
    router.close()


def test_worker_rejects_a_coordinator_with_the_wrong_secret(key: bytes) -> None:
    # past the transport (it holds the job's CURVE keys) but signing with another key
    router, address = fake_coordinator(key)
    with WorkerChannel(JOB, 0, address, key) as w:
        w.report(Hello(JOB, 0, 0, "h", 1))
        assert router.poll(5000)
        ident = router.recv_multipart()[0]
        impostor = Sealer(JOB, secrets.token_bytes(32), COORDINATOR)
        router.send_multipart([ident, *impostor.seal(0, 0, Stop(JOB, 0))])
        router.send_multipart([ident, *impostor.seal(0, 0, Welcome(JOB, 0, 0, "evil", 1))])
        assert w.wait(0.5) is None
        assert w.rendezvous is None
        assert w.rejected["mac"] == 2
    router.close()


def test_tampered_byte_is_rejected(coordinator: CoordinatorChannel, key: bytes) -> None:
    frames = Sealer(JOB, key, 0).seal(COORDINATOR, 0, Hello(JOB, 0, 0, "h", 1))
    data = bytearray(frames[0])
    data[len(data) // 2] ^= 0x01
    s = raw_dealer(coordinator, key)
    s.send_multipart([bytes(data), frames[1]])
    mac = bytearray(frames[1])
    mac[0] ^= 0x80
    s.send_multipart([frames[0], bytes(mac)])
    recv_until_rejected(coordinator, "mac", 2)
    s.close()


def test_every_single_bit_flip_is_rejected(key: bytes) -> None:
    opener = Opener(JOB, key, COORDINATOR)
    data, mac = Sealer(JOB, key, 4).seal(COORDINATOR, 1, Progress(JOB, 1, 4, 1, 1.0, 1.0, 1, ""))
    for i in range(len(data)):
        for bit in (0x01, 0x80):
            tampered = bytearray(data)
            tampered[i] ^= bit
            with pytest.raises(Rejected) as e:
                opener.open([bytes(tampered), mac])
            assert e.value.reason == "mac"
    assert opener.open([data, mac]).sender == 4


def test_replay_is_rejected(coordinator: CoordinatorChannel, key: bytes) -> None:
    sealer = Sealer(JOB, key, 0)
    hello = sealer.seal(COORDINATOR, 0, Hello(JOB, 0, 0, "h", 1))
    s = raw_dealer(coordinator, key)
    s.send_multipart(hello)
    got = coordinator.recv(5)
    assert got is not None and got[0] == 0
    s.send_multipart(hello)  # the same bytes again
    recv_until_rejected(coordinator, "replay")
    # an older sequence number after a newer one is a replay too
    first = sealer.seal(COORDINATOR, 0, Exited(JOB, 0, 0, "a"))
    second = sealer.seal(COORDINATOR, 0, Exited(JOB, 0, 0, "b"))
    s.send_multipart(second)
    assert coordinator.recv(5) == (0, Exited(JOB, 0, 0, "b"))
    s.send_multipart(first)
    recv_until_rejected(coordinator, "replay", 2)
    s.close()


def test_timestamp_outside_the_window_is_rejected(key: bytes) -> None:
    opener = Opener(JOB, key, COORDINATOR, window_s=60)
    for skew in (-3600.0, 3600.0, math.nan, math.inf):
        frames = Sealer(JOB, key, 0, clock=lambda s=skew: time.time() + s).seal(
            COORDINATOR, 0, Hello(JOB, 0, 0, "h", 1))
        with pytest.raises(Rejected) as e:
            opener.open(frames)
        assert e.value.reason == "stale"
    opener.open(Sealer(JOB, key, 0, clock=lambda: time.time() - 30).seal(
        COORDINATOR, 0, Hello(JOB, 0, 0, "h", 1)))


def test_wrong_job_is_rejected(coordinator: CoordinatorChannel, key: bytes) -> None:
    with worker(coordinator, key, job="other") as w:
        w.report(Hello("other", 0, 0, "h", 1))
        recv_until_rejected(coordinator, "job")


def test_recipient_sender_and_body_mismatches_are_rejected(key: bytes) -> None:
    to_coordinator = Opener(JOB, key, COORDINATOR)
    to_worker = Opener(JOB, key, 3)
    cases: list[tuple[Opener, list[bytes], str]] = [
        # a worker's message replayed to another worker
        (to_worker, Sealer(JOB, key, 0).seal(3, 0, Hello(JOB, 0, 0, "h", 1)), "sender"),
        # an order for vrank 4 delivered to vrank 3
        (to_worker, Sealer(JOB, key, COORDINATOR).seal(4, 0, Stop(JOB, 0)), "recipient"),
        # a worker claiming to be the coordinator
        (to_coordinator, Sealer(JOB, key, COORDINATOR).seal(COORDINATOR, 0, Stop(JOB, 0)),
         "sender"),
        (to_coordinator, Sealer(JOB, key, -1).seal(COORDINATOR, 0, Stop(JOB, 0)), "sender"),
    ]
    for opener, frames, reason in cases:
        with pytest.raises(Rejected) as e:
            opener.open(frames)
        assert e.value.reason == reason
    # envelopes that open but whose bodies disagree with them
    env = to_coordinator.open(Sealer(JOB, key, 1).seal(COORDINATOR, 0, Hello(JOB, 0, 2, "h", 1)))
    with pytest.raises(Rejected, match="mismatch"):
        decode_report(env)
    env = to_coordinator.open(Sealer(JOB, key, 1).seal(COORDINATOR, 5, Hello(JOB, 0, 1, "h", 1)))
    with pytest.raises(Rejected, match="mismatch"):
        decode_report(env)
    env = to_worker.open(Sealer(JOB, key, COORDINATOR).seal(3, 0, Welcome(JOB, 0, 4, "h", 1)))
    with pytest.raises(Rejected, match="mismatch"):
        decode_to_worker(env)
    env = to_worker.open(Sealer(JOB, key, COORDINATOR).seal(3, 0, Hello(JOB, 0, 3, "h", 1)))
    with pytest.raises(Rejected, match="body"):
        decode_to_worker(env)  # a report is not something a worker is sent


def test_garbage_frames_do_not_crash_the_coordinator(coordinator: CoordinatorChannel,
                                                     key: bytes) -> None:
    s = raw_dealer(coordinator, key)
    garbage: list[list[bytes]] = [
        [b""], [b"x"], [b"a", b"b", b"c"], [b"", b""], [os.urandom(1000), os.urandom(32)],
        [b"\xff" * 64, b"\x00" * MAC_BYTES], [b"\x91" * 10000, b"\x00" * MAC_BYTES],
    ]
    for frames in garbage:
        s.send_multipart(frames)
    # authentic but malformed: a valid MAC over garbage, over a bad envelope, a bad body
    signed_garbage = os.urandom(200)
    s.send_multipart([signed_garbage, _mac(key, signed_garbage)])
    bad_env = msgspec.msgpack.encode({"version": 1, "job": JOB})
    s.send_multipart([bad_env, _mac(key, bad_env)])
    bad_body = ENCODER.encode(Envelope(PROTOCOL_VERSION, JOB, 0, 0, COORDINATOR, 7, 1,
                                       time.time(), b"\xc1"))
    s.send_multipart([bad_body, _mac(key, bad_body)])
    future = ENCODER.encode(Envelope(PROTOCOL_VERSION + 1, JOB, 0, 0, COORDINATOR, 7, 2,
                                     time.time(), b""))
    s.send_multipart([future, _mac(key, future)])
    recv_until_rejected(coordinator, "frames", 3)
    recv_until_rejected(coordinator, "mac", 4)
    recv_until_rejected(coordinator, "malformed", 2)
    recv_until_rejected(coordinator, "body")
    recv_until_rejected(coordinator, "version")
    s.close()
    # and it still works
    with worker(coordinator, key, vrank=8) as w:
        join(coordinator, w)


def test_garbage_does_not_crash_a_worker(key: bytes) -> None:
    router, address = fake_coordinator(key)
    with WorkerChannel(JOB, 0, address, key) as w:
        w.report(Hello(JOB, 0, 0, "h", 1))
        assert router.poll(5000)
        ident = router.recv_multipart()[0]
        for frames in ([b"x"], [os.urandom(100), os.urandom(32)], [b"", b"", b""]):
            router.send_multipart([ident, *frames])
        sealer = Sealer(JOB, key, COORDINATOR)
        router.send_multipart([ident, *sealer.seal(0, 0, Stop(JOB, 0, "ok"))])
        assert w.wait(5) == Stop(JOB, 0, "ok")
        assert w.rejected["frames"] == 2 and w.rejected["mac"] == 1
    router.close()


# --------------------------------------------------------------------------- fuzzing


def _mac(key: bytes, data: bytes) -> bytes:
    import hmac
    return hmac.digest(key, data, "sha256")


FUZZ_KEY = b"k" * 32
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30)
field_names = st.sampled_from(["version", "job", "generation", "sender", "to", "session",
                               "seq", "sent_at", "body", "type", "vrank", "old", "new",
                               "config", "devices", "outcome", "step", "host", "pid"])
struct_like = st.dictionaries(field_names, msgpack_values, max_size=9)


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=4))
def test_fuzz_opener_arbitrary_frames(frames: list[bytes]) -> None:
    for me in (COORDINATOR, 0):
        try:
            Opener(JOB, FUZZ_KEY, me).open(frames)  # type: ignore[arg-type]
        except Rejected:
            pass


@FUZZ
@given(st.binary(max_size=500) | struct_like.map(msgspec.msgpack.encode))
def test_fuzz_opener_authentic_garbage(data: bytes) -> None:
    """Bytes the key holder signed (a buggy peer): past the MAC, still only Rejected."""
    for me in (COORDINATOR, 0):
        try:
            env = Opener(JOB, FUZZ_KEY, me).open([data, _mac(FUZZ_KEY, data)])
        except Rejected:
            continue
        try:
            decode_report(env) if me == COORDINATOR else decode_to_worker(env)
        except Rejected:
            pass


@FUZZ
@given(st.binary(max_size=500) | struct_like.map(msgspec.msgpack.encode)
       | st.builds(lambda t, d: msgspec.msgpack.encode({"type": t, **d}),
                   st.sampled_from(["hello", "progress", "resized", "exited", "resize",
                                    "stop", "abort", "welcome", "x"]), struct_like))
def test_fuzz_body_decoders(body: bytes) -> None:
    for sender, to in ((0, COORDINATOR), (COORDINATOR, 0)):
        env = Envelope(1, JOB, 0, sender, to, 1, 1, time.time(), body)
        try:
            decode_report(env) if to == COORDINATOR else decode_to_worker(env)
        except Rejected:
            pass


@pytest.fixture(scope="module")
def offline_worker() -> Iterator[WorkerChannel]:
    with WorkerChannel(JOB, 0, "tcp://127.0.0.1:9", FUZZ_KEY) as w:
        yield w


@FUZZ
@given(frames=st.lists(st.binary(max_size=200), min_size=1, max_size=4))
def test_fuzz_worker_take_never_raises(offline_worker: WorkerChannel,
                                       frames: list[bytes]) -> None:
    w = offline_worker
    before = sum(w.rejected.values())
    w._take(frames)  # noqa: SLF001 - the socket-free end of the worker's receive path
    assert sum(w.rejected.values()) == before + 1
    assert w.poll() is None


def test_valid_messages_survive_the_fuzzed_paths(key: bytes) -> None:
    """The fuzzers' baseline: the same parsers accept what the sealer makes."""
    env = Opener(JOB, key, 0).open(Sealer(JOB, key, COORDINATOR).seal(0, 2, resize(2)))
    assert decode_to_worker(env) == resize(2)


# --------------------------------------------------------------------------- secrets


def test_secret_file_is_private(tmp_path) -> None:
    d = tmp_path / "secrets"
    s = create_secret(JOB, d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
    assert len(s.key) == 32 and s.path == d / f"{JOB}.key"
    assert load_secret(s.path) == s
    with pytest.raises(SecretError, match="already exists"):
        create_secret(JOB, d)
    assert create_secret(JOB, d, exist_ok=True) == s   # a restarted coordinator
    # an existing directory that was too open is tightened
    os.chmod(d, 0o755)
    create_secret("job43", d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o620, 0o644, 0o700 | 0o001])
def test_secret_readable_by_others_is_refused(tmp_path, mode: int) -> None:
    s = create_secret(JOB, tmp_path / "s")
    os.chmod(s.path, mode)
    with pytest.raises(SecretError, match="group or others"):
        load_secret(s.path)


def test_secret_owned_by_someone_else_is_refused(tmp_path) -> None:
    s = create_secret(JOB, tmp_path / "s")
    try:
        os.chown(s.path, 65534, 65534)
    except PermissionError:
        pytest.fail("this test needs root (to give the secret file to another uid); CI runs "
                    "as root")
    with pytest.raises(SecretError, match="belongs to uid 65534"):
        load_secret(s.path)


def test_secret_symlink_missing_and_malformed_are_refused(tmp_path) -> None:
    s = create_secret(JOB, tmp_path / "s")
    link = tmp_path / "s" / "link.key"
    link.symlink_to(s.path)
    with pytest.raises(SecretError, match="symbolic link"):
        load_secret(link)
    with pytest.raises(SecretError, match="does not exist"):
        load_secret(tmp_path / "nope.key")
    short = tmp_path / "s" / "short.key"
    short.write_bytes(b"x" * 16)
    os.chmod(short, 0o600)
    with pytest.raises(SecretError, match="16 bytes"):
        load_secret(short)
    with pytest.raises(SecretError, match="job name"):
        create_secret("../evil", tmp_path)


def test_worker_env_and_from_env_carry_the_path_not_the_secret(tmp_path) -> None:
    s = create_secret(JOB, tmp_path / "s")
    with CoordinatorChannel(JOB, s) as c:
        env = {**c.worker_env(), envvars.VRANK: "2", envvars.GENERATION: "1"}
        assert env[envvars.SECRET_FILE] == str(s.path)
        assert not any(s.key.hex() in v or s.key.decode("latin-1") in v for v in env.values())
        with WorkerChannel.from_env(env) as w:
            assert (w.job, w.vrank, w.generation) == (JOB, 2, 1)
            join(c, w)
    with pytest.raises(ChannelError, match="SLURM_ETC_VRANK"):
        WorkerChannel.from_env({envvars.JOB: JOB})
    with CoordinatorChannel(JOB, s.key) as raw:
        with pytest.raises(ChannelError, match="JobSecret"):
            raw.worker_env()


def test_no_secret_in_logs_or_reprs(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    s = create_secret(JOB, tmp_path / "s")
    with CoordinatorChannel(JOB, s) as c:
        with WorkerChannel(JOB, 0, c.address, s) as w:
            join(c, w)
            c.send(0, resize(1))
            w.wait(5)
            c.send(0, Stop(JOB, 0))  # old generation: logged by the worker
            w.wait(0.2)
        with WorkerChannel(JOB, 1, c.address, secrets.token_bytes(32)) as bad:
            bad.report(Hello(JOB, 0, 1, "h", 1))
            deadline = time.monotonic() + 5
            while c.refused_handshakes < 1 and time.monotonic() < deadline:
                c.recv(0.05)
        texts = [caplog.text, repr(s), str(s), repr(c), repr(w)]
    os.chmod(s.path, 0o644)
    with pytest.raises(SecretError) as e:
        load_secret(s.path)
    texts.append(str(e.value))
    assert any("refused 1 handshake(s)" in t for t in texts)
    forms = [s.key.hex(), base64.b64encode(s.key).decode(), s.key.hex().upper(),
             repr(s.key)[2:-1]]
    for text in texts:
        for form in forms:
            assert form not in text
    assert isinstance(s, JobSecret) and "key=" not in repr(s)


def test_rejections_are_counted_but_logged_rate_limited(
        coordinator: CoordinatorChannel, key: bytes,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="slurm_etc.protocol.channel")
    s = raw_dealer(coordinator, key)
    for _ in range(50):
        s.send_multipart([os.urandom(64), os.urandom(32)])
    recv_until_rejected(coordinator, "mac", 50)
    lines = [r for r in caplog.records if "dropped a message (mac)" in r.getMessage()]
    assert len(lines) == 1
    s.close()


def test_closed_channels_fail_cleanly(coordinator: CoordinatorChannel, key: bytes) -> None:
    w = worker(coordinator, key)
    w.close()
    w.close()
    assert w.poll() is None and w.wait(0.1) is None
    w.report(Hello(JOB, 0, 0, "h", 1))  # dropped, no exception
    coordinator.close()
    with pytest.raises(ChannelError, match="closed"):
        coordinator.recv(0.1)
    assert coordinator.send(0, Stop(JOB, 0)) is False


def test_liveness_comes_from_the_link_not_a_message_per_worker(key: bytes,
                                                               monkeypatch) -> None:
    """No message from the coordinator for longer than three heartbeat intervals: the worker
    still knows it lives (libzmq's pings, answered by its I/O thread); killed (its channel
    closed), the worker's silence starts at once. Before, the coordinator's loop signed and
    sent a Heartbeat to every worker every HEARTBEAT_S. (Pings every 2 s here, the job's
    HEARTBEAT_S being longer.)"""
    monkeypatch.setattr(channel_module, "HEARTBEAT_S", PING_S)
    monkeypatch.setattr(channel_module, "HEARTBEAT_TIMEOUT_S", PING_S)
    coord = CoordinatorChannel(JOB, key, "127.0.0.1")
    w = worker(coord, key)
    try:
        join(coord, w)
        time.sleep(3 * PING_S + 1.0)
        assert coord.recv(0.01) is None  # nothing sent either way meanwhile
        assert time.monotonic() - w.heard_at < 0.5, "the link lapsed without messages"
        coord.close()
        deadline = time.monotonic() + 3 * PING_S
        while time.monotonic() - w.heard_at < 1.0 and time.monotonic() < deadline:
            time.sleep(0.1)
        silent = time.monotonic() - w.heard_at
        assert 1.0 <= silent <= 2.0, silent  # from the close, not from the last message
    finally:
        w.close(linger_s=0)
        coord.close()


def test_a_body_encoded_once_seals_as_the_message_would(key: bytes) -> None:
    """A broadcast encodes its order once and seals it to each rank (``body=``): each
    receiver opens the same body as if the message had been encoded for it alone."""
    from slurm_etc.protocol.messages import ENCODER

    stop = Stop(JOB, 3, "the end")
    sealer = Sealer(JOB, key, COORDINATOR)
    body = ENCODER.encode(stop)
    for vrank in (0, 5):
        opener = Opener(JOB, key, vrank)
        alone = opener.open(sealer.seal(vrank, 3, stop))
        shared = opener.open(sealer.seal(vrank, 3, stop, body=body))
        assert shared.body == alone.body == body and shared.seq == alone.seq + 1

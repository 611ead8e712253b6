"""A listener's refused handshakes are peers without the job's key; a handshake that did not
finish in time (an overloaded listener, thousands of peers at once) is counted and said
apart, never as a stranger."""
from __future__ import annotations

import logging
import socket
import time

import pytest
import zmq

from slurm_etc.protocol.keys import HandshakeWatch, ZapGuard, curve_keys, make_client, make_server

pytestmark = pytest.mark.unit


def _drain_until(watch: HandshakeWatch, done, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        watch.drain()
        time.sleep(0.05)


def test_a_stranger_is_refused_and_a_silent_peer_is_unfinished(caplog):
    keys = curve_keys(b"k" * 32)
    ctx = zmq.Context()
    guard = ZapGuard(ctx, {keys.client_public})
    server = ctx.socket(zmq.ROUTER)
    make_server(server, keys)
    server.setsockopt(zmq.HANDSHAKE_IVL, 300)
    watch = HandshakeWatch(server, "[test]", interval_s=0.0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    silent = socket.create_connection(("127.0.0.1", port))  # says nothing: times out
    stranger = ctx.socket(zmq.DEALER)
    make_client(stranger, curve_keys(b"x" * 32))
    stranger.connect(f"tcp://127.0.0.1:{port}")
    stranger.send(b"hello")
    try:
        with caplog.at_level(logging.WARNING, logger="slurm_etc.protocol.keys"):
            _drain_until(watch, lambda: watch.refused and watch.unfinished)
        assert watch.refused >= 1 and watch.unfinished == 1
        said = caplog.text
        assert "without this job's key" in said and "did not finish in time" in said
    finally:
        silent.close()
        stranger.close(linger=0)
        watch.close()
        server.close(linger=0)
        guard.close()
        ctx.term()

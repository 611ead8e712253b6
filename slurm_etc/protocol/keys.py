"""zmq CURVE keys of a job, derived from its 32-byte secret (the owner-only secret file).

Every process that holds the secret computes the same two keypairs (one for the listening
side, one for the connecting side), so nothing new is distributed: the coordinator's one
socket, which carries the control channel and the rendezvous store (and a store hosted
alone, the local pool's), listens with the server keypair and accepts, in its ZAP handler,
only a peer presenting the client public key. A peer without the secret cannot
compute either key; zmq drops it during the handshake, before any message of it is
buffered.

Derivation: ``blake2b(label, key=secret, digest_size=32)`` (a keyed PRF) with a distinct
label per side; any 32 bytes are a Curve25519 secret key. (Until the store rode the
channel's connection, it had keys of its own: the label names the purpose still.)
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Final

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

_LABEL: Final = "slurm-etc/v1/curve/channel/{side}"
ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"


@dataclass(frozen=True)
class CurveKeys:
    """The keypairs of a job (z85, as zmq takes them); secrets left out of the repr."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)


def curve_keys(secret: bytes) -> CurveKeys:
    """The CURVE keypairs derived from the job's secret bytes."""
    if len(secret) < 16:
        raise ValueError(f"a job secret has at least 16 bytes, got {len(secret)}")
    pairs = []
    for side in ("server", "client"):
        raw = hashlib.blake2b(_LABEL.format(side=side).encode(),
                              key=secret[:64], digest_size=32).digest()
        private = z85.encode(raw)
        pairs.append((zmq.curve_public(private), private))
    (spub, ssec), (cpub, csec) = pairs
    return CurveKeys(spub, ssec, cpub, csec)


def make_server(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make ``sock`` (before bind) a CURVE server; its context needs a :class:`ZapGuard`."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 0)


def make_client(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make ``sock`` (before connect) a CURVE client of the job's server."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


class ZapGuard:
    """The ZAP handler of one zmq context: admits a CURVE peer only if it presents one of
    ``allowed`` client public keys (z85), refuses everything else (NULL or PLAIN peers
    included). Start it before binding a CURVE server socket in ``ctx``; :meth:`close`
    before terminating the context. ``refused`` counts refused handshakes."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], allowed: set[bytes]) -> None:
        self._allowed = {z85.decode(k) for k in allowed}
        self.refused = 0
        self.admitted = 0
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="slurm-etc-zap", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._sock.poll(100):
                    continue
                frames = self._sock.recv_multipart()
            except zmq.ZMQError:
                return
            ok = (len(frames) >= 7 and frames[0] == b"1.0" and frames[5] == b"CURVE"
                  and any(hmac.compare_digest(frames[6], k) for k in self._allowed))
            if ok:
                self.admitted += 1
            else:
                self.refused += 1
            request_id = frames[1] if len(frames) > 1 else b""
            reply = [b"1.0", request_id, b"200" if ok else b"400",
                     b"OK" if ok else b"not a key of this job", b"", b""]
            try:
                self._sock.send_multipart(reply)
            except zmq.ZMQError:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()


class HandshakeWatch:
    """Counts the handshakes a listening socket refused (a peer without the job's keys:
    a wrong server key fails before the ZAP handler is asked, a wrong client key at it,
    a NULL or PLAIN peer at the mechanism), from the socket's monitor, apart from those
    that did not finish (libzmq's handshake timeout, a peer gone mid-handshake: an
    overloaded listener, not a stranger). :meth:`drain` may be called from any thread (the
    monitor is read under a lock); unread events are bounded by zmq's queue."""

    REFUSED: Final = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    EVENTS: Final = REFUSED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

    def __init__(self, sock: zmq.Socket[bytes], label: str = "", *,
                 interval_s: float = 10.0) -> None:
        self._sock = sock
        self._monitor = sock.get_monitor_socket(self.EVENTS)
        self._lock = threading.Lock()
        self.refused = 0
        self.unfinished = 0
        self.label, self._interval_s = label, interval_s
        self._logged, self._logged_unfinished, self._logged_at = 0, 0, -interval_s

    def drain(self) -> int:
        """Read the events waiting; the total refused so far (one log line per interval
        at most: a flood of refused peers does not flood the log)."""
        with self._lock:
            if not self._monitor.closed:
                self._read()
            return self.refused

    def _read(self) -> None:
        for _ in range(10_000):
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            if parse_monitor_message(frames)["event"] & self.REFUSED:
                self.refused += 1
            else:
                self.unfinished += 1
        now = time.monotonic()
        if now - self._logged_at < self._interval_s:
            return
        if self.refused > self._logged:
            logger.warning("%s refused %d handshake(s) of peers without this job's key "
                           "(%d in all)", self.label, self.refused - self._logged, self.refused)
        if self.unfinished > self._logged_unfinished:
            logger.warning("%s %d handshake(s) did not finish in time or their peer went "
                           "away (%d in all; they reconnect: many peers at once on a busy "
                           "host)", self.label, self.unfinished - self._logged_unfinished,
                           self.unfinished)
        if self.refused > self._logged or self.unfinished > self._logged_unfinished:
            self._logged, self._logged_unfinished = self.refused, self.unfinished
            self._logged_at = now

    def close(self) -> None:
        with self._lock:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)

"""The job's rendezvous store: served by the coordinator over CURVE, bounded, with a
``torch.distributed.Store`` client for the workers.

Workers meet here: gloo's rendezvous of every training and migration group (through
``PrefixStore``), the per-step agreement, a resize's trainer state, RNG extras, holdings and
commit decision. What torch's ``TCPStore`` lacked, this has:

* **authenticated transport.** A zmq ROUTER with CURVE keys derived from the job's secret
  (:mod:`.keys`); its ZAP handler admits only the job's client key, so a peer without the
  secret is dropped at the handshake: it can neither list, read nor write keys, and nothing
  it sends is buffered.
* **bounded.** Per value (:attr:`StoreLimits.value_bytes`), per key name, number of keys
  and total bytes; a write past a bound is an error to that client (``StoreFull``), never
  growth. zmq bounds a request's size (``MAXMSGSIZE``) and the queue per peer.
* **past keys deleted.** :meth:`StoreServer.retire_generations` drops every key of the
  job's generations before a committed one (the trainer deletes its agreement keys of
  step - 2 itself).
* **listens only where told** (``bind``), unlike ``TCPStore`` which listens on every
  interface whatever host it is given.
* **blocking get/wait served by the server** (no polling over the wire) and a client that
  may be used from several threads at once.
* **one connection per worker** (issue #42): the coordinator's server socket also carries
  the job's control channel (:class:`~slurm_etc.protocol.channel.CoordinatorChannel` hosts
  its store on it), and a worker's client sends its requests on its channel's connection
  (:meth:`StoreClient.over`), so the coordinator's process holds one TCP connection, one
  descriptor, per rank: 18,432 ranks (16,384 and a grow of 2,048) fit under an open-file
  limit of 20,000. Store frames and channel frames share the socket, told apart by their
  first frame (``STORE_FRAME`` of :mod:`.channel`); the serving thread owns the socket,
  answers the store's requests itself and hands the channel's frames to the coordinator's
  loop thread (and its sends back) over inproc sockets. A TCP client of its own
  (:class:`StoreClient` with an address: the coordinator's own writes, the local pool's
  workers, tests) speaks the same wire.

Wire: a request is two frames, ``STORE_FRAME`` and the msgpack array of :class:`Request`; a
reply the same, with a :class:`Reply`. Values are bytes; nothing is unpickled. Everything
else on the socket is the control channel's (``[envelope, mac]``, whose envelope, a msgpack
map, can never be ``STORE_FRAME``).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import msgspec
import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import InternalError
from .channel import ANSWER, QUEUE_FULL, SENT, STORE_FRAME, UNREACHABLE, WorkerChannel
from .keys import CurveKeys, HandshakeWatch, ZapGuard, curve_keys, make_client, make_server
from .rendezvous import generation_pattern

logger = logging.getLogger(__name__)

# Over any request's own time limit, how long a client waits for the server's answer
# before it calls the coordinator unreachable.
_REPLY_GRACE_S: Final = 10.0
_DEFAULT_TIMEOUT: Final = timedelta(seconds=300)
# A blocking request that can be interrupted (StoreClient.interrupt) waits in slices this
# long: one request a second a waiting rank, only while it waits.
INTERRUPT_SLICE_S: Final = 1.0
# Idle connections a client keeps for the next requests; more, left by a burst of requests
# at once, are closed. Requests made at once are what need sockets, not threads: NCCL's
# heartbeat monitor asks ``check`` once a second, each time from a new Python thread.
IDLE_CONNECTIONS: Final = 8
# The inproc endpoints between a server's thread and the coordinator's loop (channel frames
# in, sends out); names are per zmq context, and each server has a context of its own.
_INBOX: Final = "inproc://slurm-etc-channel-in"
_OUTBOX: Final = "inproc://slurm-etc-channel-out"
# Channel frames waiting for the coordinator's loop (a burst of Hellos of a whole job);
# past it they are dropped, counted, as zmq's queue per worker would have dropped them.
_INBOX_QUEUE: Final = 1 << 17
# Messages of workers handled between two looks for the coordinator loop's sends.
_SENDS_EVERY: Final = 16


@dataclass(frozen=True)
class StoreLimits:
    """Bounds of one job's store. Defaults fit a 16k-rank job's rendezvous (every rank in
    ~10 groups per generation, two generations live) with room; values there are under a
    kilobyte except a resize's trainer state and model description (kilobytes)."""

    value_bytes: int = 4 * 2**20
    key_bytes: int = 1024
    keys: int = 1_000_000
    total_bytes: int = 256 * 2**20
    keys_per_request: int = 65_536
    waiters: int = 100_000  # blocked get/wait requests held at once

    @property
    def request_bytes(self) -> int:
        return self.value_bytes + self.key_bytes + 4096


class Request(msgspec.Struct, array_like=True, frozen=True):
    """``op`` with its keys, values (set / multi_set / compare_set: expected, desired),
    ``amount`` (add) and ``timeout_ms`` (blocking ops)."""

    id: int
    op: str
    keys: list[str] = []
    values: list[bytes] = []
    amount: int = 0
    timeout_ms: int = 0


class Reply(msgspec.Struct, array_like=True, frozen=True):
    """``status``: ok, timeout, full (a bound), bad (malformed request)."""

    id: int
    status: str
    values: list[bytes] = []
    number: int = 0
    error: str = ""


_REQUEST = msgspec.msgpack.Decoder(Request)
_REPLY = msgspec.msgpack.Decoder(Reply)
_ENCODER = msgspec.msgpack.Encoder()


class StoreError(InternalError, RuntimeError):
    """The store refused a request, or cannot be reached."""


class StoreFull(StoreError):
    """A write past one of the store's bounds."""


class StoreUnreachable(StoreError):
    """The store did not answer at all (its coordinator died, or is stuck)."""


class StoreInterrupted(StoreError):
    """A blocking request given up because :attr:`StoreClient.interrupt` said why (the
    coordinator gave up what it waited for: e.g. a peer died in the resize)."""


class StoreTimeout(StoreError):
    """Keys did not appear within the timeout (what torch's ``DistStoreError`` says for a
    TCPStore)."""


@dataclass(frozen=True)
class Woken:
    """An agreement answered early: its wake key took ``value`` (the coordinator's order
    naming the dead, which no peer's vote would ever bring)."""

    value: bytes


@dataclass(eq=False)  # hashed by identity: a member of the blocked set
class _Waiter:
    routing: bytes
    request: Request
    deadline: float
    missing: set[str]
    wake: str = ""  # answered "woken" once this key holds a value other than ``seen``
    seen: bytes = b""


@dataclass(frozen=True)
class CarriedChannel:
    """The control channel's bounds, for a server whose socket carries it
    (:class:`~slurm_etc.protocol.channel.CoordinatorChannel` hosts its store so).

    Attributes:
        queue: messages queued per worker each way (zmq's high-water marks).
        frame_bytes: the largest frame a worker may send (zmq's ``MAXMSGSIZE``).
    """

    queue: int
    frame_bytes: int


class StoreServer:
    """The store the coordinator hosts: a thread serving a CURVE ROUTER socket.

    Args:
        secret: the job's secret bytes (the keys are derived from it).
        bind: the interface to listen on (``host``).
        port: the port to listen on (0: any free port).
        job: the job id whose generation keys :meth:`retire_generations` recognises.
        limits: the bounds (:class:`StoreLimits`).
        channel: set when the socket also carries the control channel: frames that are not
            the store's go to :attr:`inbox`, and :attr:`outbox` sends to workers (both
            inproc sockets of this server's context, for the coordinator's loop thread;
            see :meth:`_send_batch`). Unset, such frames are dropped (counted).
    """

    def __init__(self, secret: bytes, bind: str = "127.0.0.1", *, port: int = 0,
                 job: str = "", limits: StoreLimits | None = None,
                 channel: CarriedChannel | None = None) -> None:
        self.limits = limits or StoreLimits()
        self.job = job
        self._keys = curve_keys(secret)
        self._data: dict[str, bytes] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        # by key: the requests waiting for it, in the order they came (a dict as an ordered
        # set: forgetting one answered early is O(1), however many wait on the same key)
        self._waiters: dict[str, dict[_Waiter, None]] = {}
        self._wakers: dict[str, set[_Waiter]] = {}  # by wake key
        self._blocked: set[_Waiter] = set()
        # (deadline, order, waiter) of every request blocked, the soonest first; a waiter
        # answered is left in it and skipped when it comes up (O(log n) a request, where
        # looking at every blocked request at each turn of the thread was O(n))
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._blocked_count = itertools.count()
        self.refused = 0  # requests refused for a bound
        self.requests = 0  # requests served (what the job's ranks ask of the coordinator)
        self.dropped = 0  # frames neither the store's nor taken by a channel
        # called (on this server's thread, before the answer) when a compare-and-set first
        # sets a key: the coordinator makes a resize's commit decision durable there, so
        # that no rank acts on a decision a restarted coordinator could not know
        self.on_first_set: Callable[[str, bytes], None] | None = None
        # carrying the channel, two I/O threads (CURVE's work on every message), as the
        # channel's socket and the store's had one each when they were apart
        self._ctx = zmq.Context(io_threads=2 if channel else 1)
        self._zap = ZapGuard(self._ctx, {self._keys.client_public})
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._pairs: list[zmq.Socket[bytes]] = []  # inbox and outbox: both ends of each
        self._to_loop: zmq.Socket[bytes] | None = None  # this thread's ends of them
        self._from_loop: zmq.Socket[bytes] | None = None
        host = bind.strip("[]")
        what = "the control channel and store" if channel else "the rendezvous store"
        try:
            make_server(self._sock, self._keys)
            self._sock.setsockopt(zmq.LINGER, 0)
            if channel is None:
                self._sock.setsockopt(zmq.MAXMSGSIZE, self.limits.request_bytes)
                self._sock.setsockopt(zmq.RCVHWM, 64)
                self._sock.setsockopt(zmq.SNDHWM, 10_000)
            else:
                # a send to a worker that is gone fails (the channel says so) instead of
                # vanishing; each worker's queues are the channel's, its store requests
                # among them (a worker has a few in flight at most)
                self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._sock.setsockopt(zmq.MAXMSGSIZE,
                                      max(channel.frame_bytes, self.limits.request_bytes))
                self._sock.setsockopt(zmq.RCVHWM, channel.queue)
                self._sock.setsockopt(zmq.SNDHWM, channel.queue)
                self.inbox, self.outbox = self._bridge()
            if ":" in host:
                self._sock.setsockopt(zmq.IPV6, 1)
            self._handshakes = HandshakeWatch(self._sock, f"[job {job}] {what}:")
            self._sock.bind(f"tcp://{_bracket(host)}:{port or '*'}")
        except zmq.ZMQError as e:
            self._close_sockets()
            raise StoreError(f"cannot bind {what} to {_bracket(host)}:{port or 'any port'}: "
                             f"{e}") from None
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.host = host
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="slurm-etc-store",
                                        daemon=True)
        self._thread.start()
        logger.info("[job %s] %s on %s:%d (CURVE)", job, what, _bracket(host), self.port)

    def _bridge(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """The inproc pairs between this thread and the coordinator's loop; the loop's
        ends (inbox, outbox)."""
        loop = []
        for endpoint in (_INBOX, _OUTBOX):
            ends = (self._ctx.socket(zmq.PAIR), self._ctx.socket(zmq.PAIR))
            self._pairs.extend(ends)
            for end in ends:
                end.setsockopt(zmq.LINGER, 0)
                end.setsockopt(zmq.SNDHWM, _INBOX_QUEUE)
                end.setsockopt(zmq.RCVHWM, _INBOX_QUEUE)
            ends[0].bind(endpoint)
            ends[1].connect(endpoint)
            loop.append(ends[1])
        self._to_loop, self._from_loop = self._pairs[0], self._pairs[2]
        return loop[0], loop[1]

    # -- what the coordinator calls ----------------------------------------------------------

    @property
    def refused_handshakes(self) -> int:
        """Peers dropped at the handshake (no key of this job)."""
        return self._handshakes.drain()

    @property
    def serving(self) -> bool:
        """Whether the thread serving the socket runs."""
        return self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        """Keys held, bytes held (keys + values), requests refused for a bound, requests
        served."""
        with self._lock:
            return {"keys": len(self._data), "bytes": self._bytes, "refused": self.refused,
                    "requests": self.requests}

    def retire_generations(self, below: int) -> int:
        """Delete every key of this job's generations ``< below`` (``<job>/g<N>/...`` and
        ``<job>/g<N>.``...): a committed generation ``below`` made them dead. Returns how
        many keys went."""
        pattern = generation_pattern(self.job)
        with self._lock:
            dead = [k for k in self._data
                    if (m := pattern.match(k)) is not None and int(m.group(1)) < below]
            for k in dead:
                self._bytes -= len(k) + len(self._data.pop(k))
        if dead:
            logger.debug("[job %s] store: %d keys of generations < %d deleted", self.job,
                         len(dead), below)
        return len(dead)

    def close(self, linger_s: float = 0.0) -> None:
        """Stop serving and close the socket, giving what is queued for workers (a final
        order) ``linger_s`` to leave."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._close_sockets(linger_s)

    def __enter__(self) -> "StoreServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_sockets(self, linger_s: float = 0.0) -> None:
        if hasattr(self, "_handshakes"):
            self._handshakes.close()
        for pair in self._pairs:
            pair.close(linger=0)
        self._sock.close(linger=int(linger_s * 1000))
        self._zap.close()
        self._ctx.term()

    # -- the serving thread -----------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        sends = self._from_loop
        if sends is not None:
            poller.register(sends, zmq.POLLIN)
        while not self._stop.is_set():
            wait_ms = 100
            soonest = self._soonest()
            if soonest is not None:
                wait_ms = max(0, min(wait_ms, int((soonest - time.monotonic()) * 1000) + 1))
            try:
                ready = dict(poller.poll(wait_ms))
                if sends is not None and sends in ready:
                    self._send_batch(sends, sends.recv_multipart())
            except zmq.ZMQError as e:
                self._ended(e)
                return
            for i in range(1000 if self._sock in ready else 0):
                try:
                    # the coordinator's loop waits on its sends: they do not wait behind
                    # a burst of store requests
                    if i % _SENDS_EVERY == 0 and sends is not None and sends.poll(0):
                        self._send_batch(sends, sends.recv_multipart())
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as e:
                    self._ended(e)
                    return
                if len(frames) > 1 and frames[1] == STORE_FRAME:
                    self._handle(frames)
                else:
                    self._forward(frames)
            soonest = self._soonest()
            if soonest is not None and soonest <= time.monotonic():
                self._expire(time.monotonic())
            self._handshakes.drain()

    def _ended(self, error: zmq.ZMQError) -> None:
        if not self._stop.is_set():  # else closing: the socket went under it
            logger.error("[job %s] the store's socket failed; it serves no more: %s",
                         self.job, error)

    def _forward(self, frames: list[bytes]) -> None:
        """A frame that is not the store's: the control channel's, for the coordinator's
        loop (its :class:`~slurm_etc.protocol.channel.CoordinatorChannel` checks it);
        dropped where no channel is carried, or the loop is a whole queue behind."""
        try:
            if self._to_loop is None:
                raise zmq.Again
            self._to_loop.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.dropped += 1
            logger.debug("[job %s] a message of %d frames dropped (no store request, and "
                         "no channel takes it)", self.job, len(frames) - 1)

    def _send_batch(self, sends: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """Send the coordinator's loop's messages, ``[routing, envelope, mac]`` each after
        the first frame, and answer it (where that frame is ``ANSWER``) with one status
        byte per message (``SENT``, ``QUEUE_FULL``, ``UNREACHABLE`` of :mod:`.channel`):
        what a send of its own to the socket would have told it."""
        statuses = bytearray()
        for i in range(1, len(frames) - 2, 3):
            try:
                self._sock.send_multipart(frames[i:i + 3], zmq.NOBLOCK)
                statuses.append(SENT)
            except zmq.Again:
                statuses.append(QUEUE_FULL)
            except zmq.ZMQError:  # ROUTER_MANDATORY: no such worker connected
                statuses.append(UNREACHABLE)
        if frames[0] == ANSWER:
            sends.send(bytes(statuses))

    def _reply(self, routing: bytes, reply: Reply) -> None:
        try:
            self._sock.send_multipart([routing, STORE_FRAME, _ENCODER.encode(reply)],
                                      zmq.NOBLOCK)
        except zmq.ZMQError as e:  # a client gone, or its queue full: it retries or fails
            logger.debug("store: reply to a client not sent (%s)", e)

    def _handle(self, frames: list[bytes]) -> None:
        routing = frames[0]
        if len(frames) != 3:
            self._reply(routing, Reply(0, "bad", error=f"{len(frames) - 1} frames, expected 2"))
            return
        try:
            req = _REQUEST.decode(frames[2])
        except (msgspec.DecodeError, RecursionError) as e:
            self._reply(routing, Reply(0, "bad", error=str(e)[:200]))
            return
        self.requests += 1
        try:
            reply = self._apply(routing, req)
        except _Refused as r:
            self.refused += r.status == "full"
            reply = Reply(req.id, r.status, error=r.detail)
        if reply is not None:
            self._reply(routing, reply)

    def _apply(self, routing: bytes, req: Request) -> Reply | None:
        """Carry out one request: its reply, or None where it waits for keys (answered
        when they are set, or at its deadline)."""
        lim = self.limits
        if len(req.keys) > lim.keys_per_request or len(req.values) > lim.keys_per_request:
            raise _Refused("full", f"{len(req.keys)} keys in one request (at most "
                                   f"{lim.keys_per_request})")
        for k in req.keys:
            if len(k) > lim.key_bytes:
                raise _Refused("full", f"a key of {len(k)} characters (at most "
                                       f"{lim.key_bytes})")
        op = req.op
        with self._lock:
            reply = self._at_once(req)
            if reply is not None:
                return reply
            wake, seen = "", b""
            if op == "arrive":
                req = self._arrive(req)
                op = req.op
            if op == "agree":
                agreed = self._agree(req)
                if isinstance(agreed, Reply):
                    return agreed
                req, wake, seen = agreed
                op = req.op
            if op in ("get", "multi_get", "wait"):
                return self._get_or_wait(routing, req, wake, seen)
        raise _Refused("bad", f"unknown operation {op[:40]!r}")

    def _at_once(self, req: Request) -> Reply | None:  # noqa: C901 - one switch
        """The reply to an operation answered at once (every write, ``check``,
        ``num_keys``); None for the others."""
        op = req.op
        if op == "set":
            self._one(req)
            self._put(req.keys[0], req.values[0] if req.values else b"")
            return Reply(req.id, "ok")
        if op == "multi_set":
            if len(req.keys) != len(req.values):
                raise _Refused("bad", f"{len(req.keys)} keys, {len(req.values)} values")
            self._fits(req.keys, req.values)
            for k, v in zip(req.keys, req.values, strict=True):
                self._put(k, v)
            return Reply(req.id, "ok")
        if op == "add":
            self._one(req)
            key = req.keys[0]
            try:
                now = int(self._data.get(key, b"0")) + req.amount
            except ValueError:
                raise _Refused("bad", f"key {key[:80]!r} does not hold an integer") from None
            self._put(key, str(now).encode())
            return Reply(req.id, "ok", number=now)
        if op == "compare_set":
            return self._compare_set(req)
        if op == "check":
            return Reply(req.id, "ok", number=int(all(k in self._data for k in req.keys)))
        if op == "delete_key":
            self._one(req)
            value = self._data.pop(req.keys[0], None)
            if value is not None:
                self._bytes -= len(req.keys[0]) + len(value)
            return Reply(req.id, "ok", number=int(value is not None))
        if op == "num_keys":
            return Reply(req.id, "ok", number=len(self._data))
        return None

    def _compare_set(self, req: Request) -> Reply:
        self._one(req)
        if len(req.values) != 2:
            raise _Refused("bad", "compare_set takes expected and desired values")
        key, (expected, desired) = req.keys[0], req.values
        current = self._data.get(key)
        if current is None:
            if expected:
                return Reply(req.id, "ok", values=[expected])
            self._put(key, desired)
            if self.on_first_set is not None:
                self.on_first_set(key, desired)
            return Reply(req.id, "ok", values=[desired])
        if current == expected:
            self._put(key, desired)
            return Reply(req.id, "ok", values=[desired])
        return Reply(req.id, "ok", values=[current])

    def _arrive(self, req: Request) -> Request:
        """``arrive``: keys [decided, arrived, own, stale or "", wake or "", *keys], values
        [proposal or "", own's, wake's seen], amount the world: a rank's arrival at a step's
        decision in one request: the proposal set where the decision holds none yet
        (compare-and-set), ``arrived`` counted up by one, the decision closed as "-" (no
        order) by the last of the world to arrive where nobody proposed, then the
        ``agree`` of the rest (returned) that waits for the decision."""
        if len(req.keys) < 6 or len(req.values) != 3 or req.amount < 1:
            raise _Refused("bad", "arrive takes the decision's key, the count's, its own, a "
                                  "stale key, a wake key and the keys; a proposal, its value "
                                  "and the wake key's seen value; the world")
        decided, arrived = req.keys[0], req.keys[1]
        proposal = req.values[0]
        if proposal:
            self._compare_set(Request(req.id, "compare_set", [decided], [b"", proposal]))
        counted = self._at_once(Request(req.id, "add", [arrived], [], 1))
        if counted is not None and counted.number >= req.amount:
            self._compare_set(Request(req.id, "compare_set", [decided], [b"", b"-"]))
        return Request(req.id, "agree", req.keys[2:], req.values[1:], 0, req.timeout_ms)

    def _agree(self, req: Request) -> Reply | tuple[Request, str, bytes]:
        """``agree``: keys [own, stale or "", wake or "", *keys], values [own's, wake's
        seen]: set, delete, then a multi_get (returned, with the wake key and its seen
        value) that a new value of the wake key ends early (the reply where it has one)."""
        if len(req.keys) < 4 or len(req.values) != 2:
            raise _Refused("bad", "agree takes its key, a stale key, a wake key and "
                                  "the keys; its value and the wake key's seen value")
        self._put(req.keys[0], req.values[0])
        stale = self._data.pop(req.keys[1], None) if req.keys[1] else None
        if stale is not None:
            self._bytes -= len(req.keys[1]) + len(stale)
        wake, seen = req.keys[2], req.values[1]
        if wake and self._data.get(wake, seen) != seen:
            return Reply(req.id, "woken", values=[self._data[wake]])
        return Request(req.id, "multi_get", req.keys[3:], [], 0, req.timeout_ms), wake, seen

    def _get_or_wait(self, routing: bytes, req: Request, wake: str, seen: bytes
                     ) -> Reply | None:
        """``get``, ``multi_get``, ``wait``: the reply where every key is there (or the
        request does not wait), else None and the request waits for them."""
        missing = {k for k in req.keys if k not in self._data}
        if not missing:
            return self._answer(req)
        if req.timeout_ms <= 0:
            return Reply(req.id, "timeout", error=f"{len(missing)} keys missing")
        if len(self._blocked) >= self.limits.waiters:
            raise _Refused("full", f"{len(self._blocked)} requests already waiting")
        w = _Waiter(routing, req, time.monotonic() + req.timeout_ms / 1000, missing,
                    wake, seen)
        self._blocked.add(w)
        heapq.heappush(self._deadlines, (w.deadline, next(self._blocked_count), w))
        if len(self._deadlines) > 4 * len(self._blocked) + 1024:  # mostly answered: rebuilt
            self._deadlines = [e for e in self._deadlines if e[2] in self._blocked]
            heapq.heapify(self._deadlines)
        for k in missing:
            self._waiters.setdefault(k, {})[w] = None
        if wake:
            self._wakers.setdefault(wake, set()).add(w)
        return None

    def _answer(self, req: Request) -> Reply:
        if req.op == "wait":
            return Reply(req.id, "ok")
        return Reply(req.id, "ok", values=[self._data[k] for k in req.keys])

    @staticmethod
    def _one(req: Request) -> None:
        if len(req.keys) != 1:
            raise _Refused("bad", f"{req.op} takes one key, got {len(req.keys)}")

    def _fits(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        lim = self.limits
        grow_keys, grow_bytes = 0, 0
        for k, v in zip(keys, values, strict=True):
            if len(v) > lim.value_bytes:
                raise _Refused("full", f"a value of {len(v)} bytes for {k[:80]!r} (at most "
                                       f"{lim.value_bytes})")
            old = self._data.get(k)
            grow_keys += old is None
            grow_bytes += len(v) - (len(old) if old is not None else -len(k))
        if len(self._data) + grow_keys > lim.keys:
            raise _Refused("full", f"the store holds {len(self._data)} keys (at most "
                                   f"{lim.keys})")
        if self._bytes + grow_bytes > lim.total_bytes:
            raise _Refused("full", f"the store holds {self._bytes} bytes (at most "
                                   f"{lim.total_bytes}); {grow_bytes} more refused")

    def _put(self, key: str, value: bytes) -> None:
        """Store (the lock held), after the bounds; wake the waiters of ``key``."""
        self._fits([key], [value])
        old = self._data.get(key)
        self._bytes += len(value) - (len(old) if old is not None else -len(key))
        self._data[key] = value
        for w in self._waiters.pop(key, ()):
            w.missing.discard(key)
            if not w.missing and w in self._blocked:
                w.missing = {k for k in w.request.keys if k not in self._data}
                if w.missing:  # one of its keys was deleted meanwhile: wait on for it
                    for k in w.missing:
                        self._waiters.setdefault(k, {})[w] = None
                    continue
                self._unblock(w)
                self._reply(w.routing, self._answer(w.request))
        for w in [w for w in self._wakers.get(key, ()) if w.seen != value]:
            self._unblock(w)
            self._reply(w.routing, Reply(w.request.id, "woken", values=[value]))

    def _unblock(self, w: _Waiter) -> None:
        """Forget a blocked request (the lock held): answered, woken or expired."""
        self._blocked.discard(w)
        for k in w.missing:
            ws = self._waiters.get(k)
            if ws is not None:
                ws.pop(w, None)
                if not ws:
                    del self._waiters[k]
        wakers = self._wakers.get(w.wake)
        if wakers is not None:
            wakers.discard(w)
            if not wakers:
                del self._wakers[w.wake]

    def _soonest(self) -> float | None:
        """The soonest deadline of a request still blocked (None: none is); the answered
        ones ahead of it are dropped from the heap on the way."""
        heap = self._deadlines
        while heap and heap[0][2] not in self._blocked:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _expire(self, now: float) -> None:
        with self._lock:
            late = []
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                w = heapq.heappop(heap)[2]
                if w in self._blocked:
                    late.append(w)
            for w in late:
                self._unblock(w)
                self._reply(w.routing, Reply(w.request.id, "timeout",
                                             error=f"{len(w.missing)} keys missing"))


class _Refused(InternalError):
    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(eq=False)  # hashed by identity: a member of the checked-out set
class _Connection:
    """A DEALER socket to the store, the monitor of its disconnections, and the client's
    generation it was opened in (a ``close`` or ``repoint`` since makes it stale)."""

    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    generation: int

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class _OverChannel:
    """A client's requests on its worker's channel connection: sent as the channel's
    socket allows (:meth:`WorkerChannel.send_store`), answered by id to the thread that
    asked, whichever thread happens to read the socket (:meth:`WorkerChannel.pump_until`).
    The channel's link going down (the coordinator's process died) fails every request in
    flight at once, and every request after it until :meth:`follow`."""

    def __init__(self, channel: WorkerChannel) -> None:
        self.channel = channel
        self._answers: dict[int, Reply | None] = {}  # by id: the requests in flight
        self._drops = channel.link_drops  # the link's drops already followed
        channel.carry_store(self._take)

    def _take(self, frame: bytes) -> None:
        """A reply read off the channel's socket (by whichever thread reads it)."""
        try:
            reply = _REPLY.decode(frame)
        except (msgspec.DecodeError, RecursionError):
            return
        if reply.id in self._answers:  # else the answer to a request given up on
            self._answers[reply.id] = reply

    def disconnected(self) -> bool:
        return self.channel.link_drops != self._drops

    def follow(self) -> None:
        """The coordinator is back (its Welcome came): requests from now on go to it."""
        self._drops = self.channel.link_drops

    def exchange(self, rid: int, op: str, request: bytes, limit: float) -> Reply:
        channel = self.channel
        drops = self._drops
        self._answers[rid] = None
        try:
            if channel.link_drops == drops:
                channel.send_store(request)
                channel.pump_until(lambda: self._answers[rid] is not None
                                   or channel.link_drops != drops,
                                   time.monotonic() + limit + _REPLY_GRACE_S)
            reply = self._answers[rid]
        finally:
            del self._answers[rid]
        if reply is not None:
            return reply
        if channel.link_drops != drops:
            raise StoreUnreachable(f"the coordinator at {channel.address} closed the "
                                   f"connection ({op}: its process ended)")
        if channel.closed:
            raise StoreUnreachable(f"the channel to {channel.address} is closed ({op})")
        raise StoreUnreachable(f"no answer from the rendezvous store at {channel.address} "
                               f"within {limit + _REPLY_GRACE_S:.0f} s ({op})")


class StoreClient(dist.Store):
    """A worker's ``torch.distributed.Store`` over the job's :class:`StoreServer`.

    Usable from several threads at once, over one of two transports:

    * :meth:`over` a worker's control channel (a job's workers): the requests travel on the
      channel's connection, which the coordinator's store serves; a thread blocked in
      ``wait`` does not hold the others up, and a thread that lives for one request (NCCL's
      heartbeat asks ``check`` from a new one each second) leaves nothing behind;
    * connections of its own (``StoreClient(host, port, secret)``: the coordinator's own
      writes, the local pool's workers): a request takes an idle connection (a socket and
      its monitor) or opens one, and gives it back when answered; at most
      :data:`IDLE_CONNECTIONS` wait idle.

    gloo takes it through ``PrefixStore``. Blocking ``get``/``wait``/``multi_get`` wait on
    the server.

    Args:
        host, port: the server's address.
        secret: the job's secret bytes.
        timeout: default bound of blocking requests.
    """

    def __init__(self, host: str, port: int, secret: bytes, *,
                 timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
        self._start(timeout, None)
        self.host, self.port = host, port
        self._keys: CurveKeys = curve_keys(secret)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    @classmethod
    def over(cls, channel: WorkerChannel, *,
             timeout: timedelta = _DEFAULT_TIMEOUT) -> "StoreClient":
        """The store of the coordinator ``channel`` is joined to, on the channel's own
        connection (one per channel)."""
        client = cls.__new__(cls)
        client._start(timeout, _OverChannel(channel))
        return client

    def _start(self, timeout: timedelta, carrier: _OverChannel | None) -> None:
        dist.Store.__init__(self)
        self._timeout = timeout
        self._carrier = carrier
        self._local = threading.local()  # per thread: what its last wait fetched
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()  # checked out by a request in flight
        self._generation = 0  # one more at each close / repoint
        self._ids = 0  # requests sent, the id of the last
        # asked between slices of a blocking request (get, wait): a reason to give it up
        # (StoreInterrupted), or None to wait on; None: one request for the whole wait
        self.interrupt: Callable[[], str | None] | None = None

    def __repr__(self) -> str:
        return f"StoreClient({self._where()})"

    def _where(self) -> str:
        if self._carrier is not None:
            return f"over the channel to {self._carrier.channel.address}"
        return f"{_bracket(self.host)}:{self.port}"

    @property
    def requests(self) -> int:
        """Requests this client has sent."""
        return self._ids

    @property
    def open_connections(self) -> int:
        """Connections this client holds open of its own: idle, and in use by requests in
        flight (over a channel: none, its requests ride the channel's)."""
        with self._lock:
            return len(self._idle) + len(self._busy)

    def disconnected(self) -> bool:
        """Whether the store closed this client's connection (its process died: a
        coordinator SIGKILLed) since the last request on it (over a channel: since the
        client was made or last :meth:`repoint`-ed); asks nothing of the store. The next
        request on it fails at once."""
        if self._carrier is not None:
            return self._carrier.disconnected()
        with self._lock:
            return any(conn.monitor.poll(0) for conn in self._idle)

    # -- transport -------------------------------------------------------------------------

    def _connect(self) -> _Connection:
        """A new socket (the lock held) and a monitor of its disconnections: a store whose
        process died (its coordinator SIGKILLed) closes the connection at once, and a
        request waiting on it need not wait out the reply grace."""
        sock = self._ctx.socket(zmq.DEALER)
        try:
            make_client(sock, self._keys)
            sock.setsockopt(zmq.LINGER, 0)
            if ":" in self.host:
                sock.setsockopt(zmq.IPV6, 1)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except BaseException:
            sock.close(linger=0)
            raise
        conn = _Connection(sock, monitor, self._generation)
        try:
            sock.connect(f"tcp://{_bracket(self.host)}:{self.port}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _checkout(self) -> _Connection:
        with self._lock:
            conn = self._idle.pop() if self._idle else self._connect()
            self._busy.add(conn)
        return conn

    def _checkin(self, conn: _Connection, *, reusable: bool) -> None:
        """Give back a connection whose request ended: to the idle ones if its answer came
        (nothing more can arrive on it), this client was not closed or repointed since it
        opened, and fewer than :data:`IDLE_CONNECTIONS` are idle; else close it."""
        with self._lock:
            self._busy.discard(conn)
            if (reusable and conn.generation == self._generation
                    and len(self._idle) < IDLE_CONNECTIONS):
                self._idle.append(conn)
                return
        conn.close()

    def _exchange(self, conn: _Connection, rid: int, op: str, request: bytes,
                  limit: float) -> Reply:
        """Send ``request`` and return the store's answer to it, whatever its status."""
        sock, monitor = conn.sock, conn.monitor
        sock.send_multipart([STORE_FRAME, request])
        deadline = time.monotonic() + limit + _REPLY_GRACE_S
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            # past the deadline, one look without waiting: a reply that came in time is
            # taken even by a thread that runs late (over the channel: WorkerChannel.pump_until)
            remaining = deadline - time.monotonic()
            ready = dict(poller.poll(max(0, int(remaining * 1000))))
            if monitor in ready and sock not in ready:
                recv_monitor_message(monitor)  # only disconnections are monitored
                raise StoreUnreachable(
                    f"the rendezvous store at {_bracket(self.host)}:{self.port} closed the "
                    f"connection ({op}: its process ended, or it refused this client's "
                    "secret)")
            if sock not in ready:
                raise StoreUnreachable(f"no answer from the rendezvous store at "
                                       f"{_bracket(self.host)}:{self.port} within "
                                       f"{limit + _REPLY_GRACE_S:.0f} s ({op})")
            frames = sock.recv_multipart()
            try:
                reply = _REPLY.decode(frames[-1])
            except (msgspec.DecodeError, RecursionError):
                continue
            if reply.id == rid:
                return reply
            # else an answer to a request given up on (the id check makes a reused
            # connection safe even so; a connection whose request failed is closed)

    def _call(self, op: str, keys: Sequence[str] = (), values: Sequence[bytes] = (), *,
              amount: int = 0, timeout: timedelta | None = None) -> Reply:
        limit = (timeout if timeout is not None else self._timeout).total_seconds()
        with self._lock:
            self._ids += 1
            rid = self._ids
        request = _ENCODER.encode(Request(rid, op, list(keys), [bytes(v) for v in values],
                                          amount, int(limit * 1000)))
        if self._carrier is not None:
            reply = self._carrier.exchange(rid, op, request, limit)
        else:
            conn = self._checkout()
            answered = False
            try:
                reply = self._exchange(conn, rid, op, request, limit)
                answered = True
            finally:
                # unanswered (unreachable, interrupted): an answer may still come on it
                self._checkin(conn, reusable=answered)
        if reply.status in ("ok", "woken"):
            return reply
        if reply.status == "timeout":
            raise StoreTimeout(f"rendezvous store: {op} of {_first(keys)} timed out "
                               f"after {limit:g} s ({reply.error})")
        if reply.status == "full":
            raise StoreFull(f"rendezvous store refused {op} of {_first(keys)}: "
                            f"{reply.error}")
        raise StoreError(f"rendezvous store refused {op} of {_first(keys)}: {reply.error}")

    def repoint(self, host: str, port: int) -> None:
        """Send every request from now on to the store at ``host:port`` (a coordinator
        restarted on the job's record hosts a new one). The groups built over this client
        (gloo's rendezvous through a ``PrefixStore``) hold this object: they follow. Over a
        channel the address is the channel's own (a restarted coordinator binds it again,
        and its Welcome names it): the requests from now on go where the channel's
        connection leads again."""
        if self._carrier is not None:
            self._carrier.follow()
            self._local = threading.local()
            return
        with self._lock:
            self.host, self.port = host, port
        self.close()

    def close(self) -> None:
        """Close the idle connections now; those of requests in flight are closed by their
        request when it ends (a zmq socket is not closed under the thread polling it), and
        none of them is used again. The client stays usable: a request opens a new one."""
        with self._lock:
            self._generation += 1
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        self._local = threading.local()

    # -- torch.distributed.Store -----------------------------------------------------------

    # gloo connects every pair of a group by a wait and then a get of the peer's address:
    # the wait fetches the values, and the get that follows on this thread reads its key
    # from them (once) instead of a second round trip (a third of a group's requests). Any
    # change this client makes to a key drops what it holds of it.

    def _waited(self) -> dict[str, bytes]:
        held: dict[str, bytes] | None = getattr(self._local, "waited", None)
        if held is None:
            held = self._local.waited = {}
        return held

    def _forget(self, keys: Sequence[str]) -> None:
        held = self._waited()
        for k in keys:
            held.pop(k, None)

    def set(self, key: str, value: Any) -> None:
        self._forget([key])
        self._call("set", [key], [_bytes(value)])

    def get(self, key: str) -> bytes:
        held = self._waited().pop(key, None)
        if held is not None:
            return held
        return self._blocking("get", [key], None).values[0]

    def _blocking(self, op: str, keys: list[str], timeout: timedelta | None) -> Reply:
        """A request that waits for ``keys``: in slices of :data:`INTERRUPT_SLICE_S` while
        :attr:`interrupt` is set, which is asked between them."""
        interrupt = self.interrupt
        if interrupt is None:
            return self._call(op, keys, timeout=timeout)
        limit = (timeout if timeout is not None else self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            try:
                return self._call(op, keys, timeout=timedelta(
                    seconds=max(0.0, min(INTERRUPT_SLICE_S, left))))
            except StoreTimeout:
                if left <= INTERRUPT_SLICE_S:
                    raise StoreTimeout(f"rendezvous store: {op} of {_first(keys)} timed out "
                                       f"after {limit:g} s") from None
            why = interrupt()
            if why is not None:
                raise StoreInterrupted(f"rendezvous store: {op} of {_first(keys)} given up: "
                                       f"{why}")

    def add(self, key: str, amount: int) -> int:
        self._forget([key])
        return self._call("add", [key], amount=int(amount)).number

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        self._forget([key])
        return self._call("compare_set", [key],
                          [_bytes(expected_value), _bytes(desired_value)]).values[0]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        values = self._blocking("multi_get", list(keys), timeout).values
        self._local.waited = dict(zip(keys, values, strict=True))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)).number)

    def delete_key(self, key: str) -> bool:
        self._forget([key])
        return bool(self._call("delete_key", [key]).number)

    def num_keys(self) -> int:
        return self._call("num_keys").number

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return list(self._call("multi_get", list(keys)).values)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._forget(keys)
        self._call("multi_set", list(keys), [_bytes(v) for v in values])

    def agree(self, own: str, value: bytes, stale: str, keys: list[str], timeout_s: float,
              *, wake: str = "", seen: bytes = b"") -> list[bytes] | Woken | None:
        """One step's agreement in one round trip: set ``own``, delete ``stale`` (if not
        empty), and the values of ``keys`` once all are there; None after ``timeout_s``;
        :class:`Woken` as soon as ``wake`` (if not empty) holds a value other than
        ``seen``."""
        self._forget([own, stale])
        return self._agreed("agree", [own, stale, wake, *keys], [value, seen], 0, timeout_s)

    def arrive(self, decided: str, arrived: str, world: int, proposal: bytes, own: str,
               stale: str, keys: list[str], timeout_s: float, *, wake: str = "",
               seen: bytes = b"") -> list[bytes] | Woken | None:
        """A rank's arrival at a step's decision, then :meth:`agree` (``own``'s value
        "-"), in one round trip (:func:`arrive_step`)."""
        self._forget([decided, arrived, own, stale])
        return self._agreed("arrive", [decided, arrived, own, stale, wake, *keys],
                            [proposal, b"-", seen], world, timeout_s)

    def _agreed(self, op: str, keys: list[str], values: list[bytes], amount: int,
                timeout_s: float) -> list[bytes] | Woken | None:
        try:
            reply = self._call(op, keys, values, amount=amount,
                               timeout=timedelta(seconds=timeout_s))
        except StoreTimeout:
            return None
        if reply.status == "woken":
            return Woken(reply.values[0])
        return list(reply.values)


def arrive_step(store: Any, decided: str, arrived: str, world: int, proposal: bytes,
                own: str, stale: str, timeout_s: float, *, wake: str = "", seen: bytes = b""
                ) -> list[bytes] | Woken | None:
    """A rank's arrival at a step's decision and the first slice of its wait, as
    :func:`agree_step` answers it: ``proposal`` (b"": none) proposed under ``decided``
    (the first proposal is the decision), this rank counted in under ``arrived``, and the
    last of ``world`` to arrive closes the decision with "-" where nobody proposed. One round
    trip on the job's store (its ``arrive``); on another store (the tests' TCPStore) those
    steps one request each, then :func:`agree_step`. Not idempotent (it counts): call it
    once per store and step, then :func:`agree_step` for the next slices."""
    if isinstance(store, StoreClient):
        return store.arrive(decided, arrived, world, proposal, own, stale, [decided],
                            timeout_s, wake=wake, seen=seen)
    if proposal:
        store.compare_set(decided, b"", proposal)
    if store.add(arrived, 1) >= world:
        store.compare_set(decided, b"", b"-")
    return agree_step(store, own, b"-", stale, [decided], timeout_s, wake=wake, seen=seen)


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _first(keys: Sequence[str]) -> str:
    if not keys:
        return "no key"
    more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
    return f"{keys[0][:80]!r}{more}"


def agree_step(store: Any, own: str, value: bytes, stale: str, keys: list[str],
               timeout_s: float, *, wake: str = "", seen: bytes = b""
               ) -> list[bytes] | Woken | None:
    """Set ``own``, delete ``stale``, and the values of ``keys`` once every one is there
    (None after ``timeout_s``: call again, it is idempotent). One round trip on the job's
    store, which answers :class:`Woken` as soon as ``wake`` holds a value other than
    ``seen``; on another ``torch.distributed.Store`` (the tests' TCPStore) four, and no
    wake: the slice's timeout bounds the wait."""
    if isinstance(store, StoreClient):
        return store.agree(own, value, stale, keys, timeout_s, wake=wake, seen=seen)
    store.set(own, value)
    if stale:
        store.delete_key(stale)
    if not wait_for_keys(store, keys, timeout_s):
        return None
    return list(store.multi_get(keys))


def wait_for_keys(store: Any, keys: list[str], timeout_s: float) -> bool:
    """Whether every key of ``keys`` is in ``store`` within ``timeout_s`` (a wait the
    server answers, for this store and torch's; False on the timeout, which callers use as
    a slice to look at their orders)."""
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except (StoreTimeout, dist.DistStoreError):
        return False
    return True

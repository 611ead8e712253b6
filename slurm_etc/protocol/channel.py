"""The job's control channel: orders and rendezvous out to workers, reports back, authenticated.

One ``CoordinatorChannel`` (a zmq ROUTER socket the coordinator binds) and one
``WorkerChannel`` per worker process (a DEALER socket that connects to it), over TCP. The
coordinator binds an explicit interface and advertises an explicit address, since workers
may run on other nodes (loopback by default, for the local backend).

One connection per worker carries the channel and the job's rendezvous store (issue #42:
the coordinator's process holds one descriptor per rank, so 18,432 ranks fit under an
open-file limit of 20,000). The coordinator's socket belongs to the thread of the
:class:`~slurm_etc.protocol.store.StoreServer` the channel hosts: that thread answers store
requests itself and hands channel frames to the coordinator's loop thread over an inproc
socket; the loop's sends go back to it as one synchronous inproc request per send or per
broadcast (so ``send`` still says whether a worker was reached). On a worker, whichever
thread holds the channel's socket reads it for everyone: channel messages to the inbox,
store replies to the thread that asked (:meth:`WorkerChannel.pump_until`, used by
:meth:`StoreClient.over <slurm_etc.protocol.store.StoreClient.over>`); a thread with a
request to send while another holds the socket queues it and wakes the holder.

Transport: zmq CURVE with keys derived from the job's secret (:mod:`slurm_etc.protocol.keys`);
the coordinator's ZAP handler admits only the job's client key, so a peer without the secret
is dropped at the handshake, before zmq buffers anything it sends (a never-ending multipart
message of such a peer costs nothing). The envelope checks below stay behind it: they name
the sender, the generation and bound replays, which CURVE alone does not.

Wire format: every message is two zmq frames, ``[envelope, mac]``:

* ``envelope`` is a msgpack map (:class:`Envelope`): protocol version, job, generation,
  sender (a vrank or ``"coordinator"``), recipient, the sender's session (random per channel
  instance), its sequence number (1, 2, ... per session), the send time (unix seconds) and
  ``body``, the msgpack bytes of one message: an :data:`~slurm_etc.protocol.messages.Order` or a
  :class:`Welcome` to a worker, a :data:`~slurm_etc.protocol.messages.Report` to the coordinator;
* ``mac`` is HMAC-SHA256 over the exact envelope bytes with the job's 32-byte secret.

A receiver checks, in this order, and drops the message with a counted, rate-limited log line
naming the first check that failed (:data:`REJECT_REASONS`): frame count, size, MAC (nothing
is parsed before it), envelope decode, version, job, recipient, sender, timestamp within
``window_s`` of its clock, sequence number greater than the last accepted of that sender's
session (replays), body decode, and that the body names the envelope's job, generation and
(reports) sender vrank. A worker also drops orders of a generation older than its own and
orders it already delivered (a coordinator may resend an order; acting twice stays safe).
Nothing a peer sends can raise out of ``recv``/``poll``/``wait``.

The secret lives in an owner-only file (:func:`create_secret`, 0600 in a 0700 directory);
workers get its path through ``SLURM_ETC_SECRET_FILE`` and :func:`load_secret` refuses a file
that others can read or that someone else owns. The secret never appears in argv, the
environment, reprs or logs.

How the coordinator's reconcile loop uses it::

    secret = create_secret(job, exist_ok=True)        # a restarted coordinator reuses it
    with CoordinatorChannel(job, secret, bind="127.0.0.1") as channel:
        channel.store.retire_generations(g)             # the StoreServer it hosts
        env = channel.worker_env()                      # merged into every launch's env
        ...
        channel.generation = g + 1                      # before launching generation g+1
        channel.broadcast(Resize(job, g + 1, ...), vranks)   # returns vranks not reached
        while (got := channel.recv(timeout_s=0.5)) is not None:
            vrank, report = got      # Hello (already answered with a Welcome), Progress, ...

Orders are idempotent by generation: resending one that was not acknowledged is safe. A
worker that says Hello more than once (it resends until welcomed) is answered every time.

How a worker uses it (the trainer sees only the ``Control`` protocol)::

    channel = WorkerChannel.from_env()
    welcome = channel.join(timeout_s=120)      # Hello -> Welcome
    store = StoreClient.over(channel)          # the store, on this channel's connection
    ...
    order = channel.poll()                     # every step; never blocks
    channel.report(Progress(...))              # never blocks; bounded queue, drops when full
"""
from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, TypeAlias

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from slurm_etc.protocol.keys import curve_keys, make_client
from slurm_etc.protocol.messages import (
    ENCODER,
    HEARTBEAT_S,
    HEARTBEAT_TIMEOUT_S,
    REPORT_DECODER,
    Abort,
    Hello,
    Order,
    Report,
    Resize,
    Resized,
    Stop,
)

from ..errors import InputError, InternalError
from . import env as envvars

if TYPE_CHECKING:  # store.py imports torch (its client is a torch Store): a process that
    # speaks only the channel (bench/fake_worker.py) does not load it
    from .store import StoreServer

logger = logging.getLogger(__name__)

# 2: the rendezvous store rides the channel's connection (the Welcome names the channel)
PROTOCOL_VERSION: Final = 2
SECRET_BYTES: Final = 32
MAC_BYTES: Final = 32
# A Resize names two layouts of up to tens of thousands of vranks: well under a megabyte.
MAX_FRAME_BYTES: Final = 16 * 1024 * 1024
# Clocks of different nodes disagree a little and messages wait in queues; anything older
# (or further in the future) than this is a replay or hopelessly late.
DEFAULT_WINDOW_S: Final = 120.0
# Messages waiting for the peer, per direction (zmq high-water mark and the worker's outbox).
DEFAULT_QUEUE: Final = 1000
# At most one log line per rejection reason this often (a flood must not flood the log).
LOG_INTERVAL_S: Final = 10.0
# A worker waiting for orders looks at its outbox this often (reports never wait for it).
_WAIT_SLICE_S: Final = 0.02
# A thread reading the socket for others (a store request's wait) looks at the link's
# events this often: a coordinator's process that died fails the requests in flight.
_LEAD_SLICE_S: Final = 0.1
# A thread waiting for its store reply while another reads the socket is woken when the
# reader hands over; it looks again at least this often anyway.
_FOLLOW_S: Final = 0.5
# How often a send waiting for the socket's thread (busy with a burst of store requests,
# on a loaded machine) looks whether that thread still lives.
_DELIVER_LOOK_MS: Final = 1000
# The first frame of every store request and reply on the shared connection: the kind of
# the message (a channel message's first frame is a msgpack map, never this) and the
# version of the store's wire.
STORE_FRAME: Final = b"store/2"
# What a send of the coordinator's loop came to, one byte per message (the socket's thread
# answers them, where the batch's first frame asks it to: StoreServer._send_batch).
ANSWER: Final = b"answer"
SENT: Final = ord("s")
QUEUE_FULL: Final = ord("f")
UNREACHABLE: Final = ord("u")
# A process that exits without close() must not hang on messages nobody will take.
_DEFAULT_LINGER_MS: Final = 1000

COORDINATOR: Final = "coordinator"
Peer: TypeAlias = int | Literal["coordinator"]

RejectReason: TypeAlias = Literal[
    "frames", "size", "mac", "malformed", "version", "job", "recipient", "sender", "stale",
    "replay", "body", "mismatch", "old_generation", "duplicate", "internal",
]
REJECT_REASONS: Final[tuple[RejectReason, ...]] = (
    "frames", "size", "mac", "malformed", "version", "job", "recipient", "sender", "stale",
    "replay", "body", "mismatch", "old_generation", "duplicate", "internal",
)
# Not attacks: a late order after a newer generation, an order resent by the coordinator.
_QUIET_REASONS: Final = {"old_generation": logging.INFO, "duplicate": logging.DEBUG}

_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class ChannelError(InternalError, RuntimeError):
    """The channel cannot be set up or used (bind, connect, join, environment)."""


class SecretError(InputError, ChannelError):
    """The job's secret file is missing, malformed or not private to its owner."""


class Rejected(InternalError):
    """A received message failed a check; ``reason`` is one of :data:`REJECT_REASONS`."""

    def __init__(self, reason: RejectReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason: RejectReason = reason
        self.detail = detail


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What is signed: who sends what to whom, when, in which job and generation."""

    version: int
    job: str
    generation: int
    sender: Peer
    to: Peer
    session: int
    seq: int
    sent_at: float
    body: bytes


class Welcome(msgspec.Struct, frozen=True, tag="welcome", forbid_unknown_fields=True):
    """The coordinator's answer to a Hello: the job's rendezvous store is open.

    Workers build their training and migration process groups from the rendezvous store
    (:class:`~slurm_etc.protocol.store.StoreServer`, key prefixes per generation) that the
    coordinator hosts on the channel's own socket: ``store_host:store_port`` name the
    channel's address (a worker's store requests ride its channel connection:
    ``StoreClient.over``). A coordinator may send a new Welcome at any time (e.g.
    restarted: the store then starts empty)."""

    job: str
    generation: int
    vrank: int
    store_host: str
    store_port: int

    @property
    def store(self) -> str:
        return f"{self.store_host}:{self.store_port}"


ToWorker: TypeAlias = Resize | Stop | Abort | Welcome

_ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)
_TO_WORKER_DECODER = msgspec.msgpack.Decoder(ToWorker)


# --------------------------------------------------------------------------- the secret


@dataclass(frozen=True)
class JobSecret:
    """The per-job HMAC key and the file it came from (the key is left out of the repr)."""

    path: Path
    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.key) != SECRET_BYTES:
            raise SecretError(f"secret file {self.path} holds {len(self.key)} bytes; "
                              f"a job secret is {SECRET_BYTES} bytes")


def default_secret_dir() -> Path:
    """``~/.slurm-etc/secrets``: home directories are on the filesystem every node sees."""
    return Path.home() / ".slurm-etc" / "secrets"


def create_secret(job: str, directory: Path | None = None, *,
                  exist_ok: bool = False) -> JobSecret:
    """Create the job's secret (``secrets.token_bytes(32)``) as ``<directory>/<job>.key``.

    The directory is made (or tightened) to 0700, the file is created exclusively with mode
    0600. With ``exist_ok`` an existing file is loaded instead (a restarted coordinator keeps
    the key its running workers hold), after the same checks as :func:`load_secret`.

    Raises:
        SecretError: bad job name, a directory owned by someone else, or an existing file
            (without ``exist_ok``) or one that fails :func:`load_secret`'s checks.
    """
    if not _JOB_NAME.fullmatch(job):
        raise SecretError(f"job name {job!r} cannot name a secret file: use letters, digits, "
                          f"'.', '_' and '-' (at most 128, not starting with '.', '_' or '-')")
    directory = Path(directory) if directory is not None else default_secret_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(directory, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise SecretError(f"secret directory {directory} is not a directory")
    if st.st_uid != os.geteuid():
        raise SecretError(f"secret directory {directory} belongs to uid {st.st_uid}, "
                          f"not to this user ({os.geteuid()})")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(directory, 0o700)
    path = directory / f"{job}.key"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        if exist_ok:
            return load_secret(path)
        raise SecretError(f"secret file {path} already exists (another coordinator of job "
                          f"{job}? remove it or resume with exist_ok)") from None
    try:
        os.fchmod(fd, 0o600)
        key = secrets.token_bytes(SECRET_BYTES)
        os.write(fd, key)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return JobSecret(path, key)


def load_secret(path: str | os.PathLike[str]) -> JobSecret:
    """Read a job secret, refusing a file that is not private to this user.

    Raises:
        SecretError: missing, a symbolic link, not a regular file, owned by another user,
            readable or writable by group or others, or not exactly 32 bytes.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SecretError(f"secret file {path} does not exist") from None
    except OSError as e:
        if os.path.islink(path):
            raise SecretError(f"secret file {path} is a symbolic link; refusing it") from None
        raise SecretError(f"cannot open secret file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"secret file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise SecretError(f"secret file {path} belongs to uid {st.st_uid}, not to this "
                              f"user ({os.geteuid()}); refusing it")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise SecretError(f"secret file {path} is accessible to group or others (mode "
                              f"{mode:04o}); it must be 0600 (chmod 600 {path})")
        key = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    return JobSecret(path, key)


def check_addresses(bind: str, advertise: str | None = None) -> None:
    """Refuse, before anything is created, a bind address this host cannot listen on and an
    advertised address that does not resolve (both would otherwise surface only as workers
    and the rendezvous store retrying until their timeout).

    Raises:
        ChannelError: one line naming the address and what would be right.
    """
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            bind, 0, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ChannelError(f"--bind {bind!r} is not an address or host name of this host "
                           f"({getattr(e, 'strerror', None) or e}); e.g. 127.0.0.1 or 0.0.0.0"
                           ) from None
    with socket.socket(family, kind, proto) as probe:
        try:
            probe.bind(sockaddr)
        except OSError as e:
            raise ChannelError(f"--bind {bind}: cannot listen there ({e.strerror}); give an "
                               "address of this host, e.g. 127.0.0.1 or 0.0.0.0") from None
    if advertise is not None:
        try:
            socket.getaddrinfo(advertise, 0, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise ChannelError(f"--advertise {advertise!r} does not resolve "
                               f"({getattr(e, 'strerror', None) or e}); give the address "
                               "or host name workers reach this host by") from None


def _key_of(secret: bytes | JobSecret) -> bytes:
    key = secret.key if isinstance(secret, JobSecret) else bytes(secret)
    if len(key) < 16:
        raise SecretError(f"a channel key must have at least 16 bytes, got {len(key)}")
    return key


# --------------------------------------------------------------------------- pure codec


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.digest(key, data, "sha256")


class Sealer:
    """Signs outgoing messages of one sender: fresh session, sequence numbers 1, 2, ..."""

    def __init__(self, job: str, secret: bytes | JobSecret, me: Peer, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.job = job
        self.me = me
        self._key = _key_of(secret)
        self._clock = clock
        self.session = secrets.randbits(63)
        self._seq = 0
        self._lock = threading.Lock()

    def seal(self, to: Peer, generation: int, message: msgspec.Struct, *,
             body: bytes | None = None) -> list[bytes]:
        """The two frames ``[envelope, mac]`` carrying ``message`` to ``to``; ``body``: the
        message already encoded (one encoding for every receiver of a broadcast)."""
        if body is None:
            body = ENCODER.encode(message)
        with self._lock:
            self._seq += 1
            seq = self._seq
        envelope = Envelope(PROTOCOL_VERSION, self.job, generation, self.me, to, self.session,
                            seq, self._clock(), body)
        data = ENCODER.encode(envelope)
        return [data, _mac(self._key, data)]


class Opener:
    """Checks incoming frames for one receiver up to the envelope (see the module doc).

    Pure apart from its replay memory and the clock it is given; :meth:`open` raises only
    :class:`Rejected`."""

    def __init__(self, job: str, secret: bytes | JobSecret, me: Peer, *,
                 window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.job = job
        self.me = me
        self.window_s = window_s
        self._key = _key_of(secret)
        self._clock = clock
        # (sender, session) -> (last accepted seq, when); sessions silent for longer than
        # the window are forgotten: anything they sent is then rejected as stale anyway.
        self._last: dict[tuple[Peer, int], tuple[int, float]] = {}
        self._pruned_at = 0.0

    def open(self, frames: Sequence[bytes]) -> Envelope:
        """The authenticated, fresh, well-formed envelope in ``frames``.

        Raises:
            Rejected: the first check that failed.
        """
        if len(frames) != 2:
            raise Rejected("frames", f"{len(frames)} frames, expected 2")
        data, mac = bytes(frames[0]), bytes(frames[1])
        if len(data) > MAX_FRAME_BYTES:
            raise Rejected("size", f"{len(data)} bytes")
        if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, _mac(self._key, data)):
            raise Rejected("mac", f"{len(data)}-byte envelope with a MAC that does not match")
        try:
            env = _ENVELOPE_DECODER.decode(data)
        except (msgspec.DecodeError, RecursionError) as e:
            raise Rejected("malformed", _short(e)) from None
        if env.version != PROTOCOL_VERSION:
            raise Rejected("version", f"version {env.version!r}, expected {PROTOCOL_VERSION}")
        if env.job != self.job:
            raise Rejected("job", f"job {env.job!r}, expected {self.job!r}")
        if env.to != self.me:
            raise Rejected("recipient", f"addressed to {env.to!r}, not {self.me!r}")
        if self.me == COORDINATOR:
            if isinstance(env.sender, str) or env.sender < 0:
                raise Rejected("sender", f"sender {env.sender!r} is not a vrank")
        elif env.sender != COORDINATOR:
            raise Rejected("sender", f"sender {env.sender!r} is not the coordinator")
        if env.generation < 0 or env.seq < 1:
            raise Rejected("malformed", f"generation {env.generation}, seq {env.seq}")
        now = self._clock()
        if not abs(now - env.sent_at) <= self.window_s:  # also rejects NaN
            raise Rejected("stale", f"sent at {env.sent_at!r}, {now - env.sent_at:.1f} s "
                                    f"from now (window {self.window_s:g} s)")
        key = (env.sender, env.session)
        last = self._last.get(key)
        if last is not None and env.seq <= last[0]:
            raise Rejected("replay", f"seq {env.seq} from {env.sender!r} after {last[0]}")
        self._last[key] = (env.seq, now)
        if now - self._pruned_at > self.window_s:
            self._prune(now)
        return env

    def _prune(self, now: float) -> None:
        self._pruned_at = now
        horizon = now - 2 * self.window_s
        for k in [k for k, (_, seen) in self._last.items() if seen < horizon]:
            del self._last[k]


def decode_report(env: Envelope) -> Report:
    """The report in an opened envelope, which must name the envelope's job, generation and
    sender vrank.

    Raises:
        Rejected: ``body`` or ``mismatch``.
    """
    try:
        report = REPORT_DECODER.decode(env.body)
    except (msgspec.DecodeError, RecursionError) as e:
        raise Rejected("body", _short(e)) from None
    if (report.job, report.generation, report.vrank) != (env.job, env.generation, env.sender):
        raise Rejected("mismatch", f"{type(report).__name__} of job {report.job!r} "
                                   f"gen {report.generation} vrank {report.vrank} in an "
                                   f"envelope of gen {env.generation} from {env.sender!r}")
    return report


def decode_to_worker(env: Envelope) -> ToWorker:
    """The order or welcome in an opened envelope, which must name the envelope's job and
    generation (and a welcome its recipient).

    Raises:
        Rejected: ``body`` or ``mismatch``.
    """
    try:
        message = _TO_WORKER_DECODER.decode(env.body)
    except (msgspec.DecodeError, RecursionError) as e:
        raise Rejected("body", _short(e)) from None
    if (message.job, message.generation) != (env.job, env.generation) or (
            isinstance(message, Welcome) and message.vrank != env.to):
        raise Rejected("mismatch", f"{type(message).__name__} of job {message.job!r} "
                                   f"gen {message.generation} in an envelope of gen "
                                   f"{env.generation} to {env.to!r}")
    return message


def _short(e: BaseException) -> str:
    return str(e)[:200]


class _RejectLog:
    """Counts rejections by reason; logs at most one line per reason per interval."""

    def __init__(self, label: str, interval_s: float = LOG_INTERVAL_S) -> None:
        self.label = label
        self.interval_s = interval_s
        self.counts: Counter[str] = Counter()
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def note(self, reason: RejectReason, detail: str, peer: str = "") -> None:
        self.counts[reason] += 1
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval_s:
            self._suppressed[reason] += 1
            return
        self._last[reason] = now
        more = self._suppressed.pop(reason, 0)
        level = _QUIET_REASONS.get(reason, logging.WARNING)
        logger.log(level, "%s dropped a message (%s)%s: %s%s", self.label, reason,
                   f" from peer {peer}" if peer else "", detail,
                   f" [{more} more like it since the last line]" if more else "")


# --------------------------------------------------------------------------- sockets


def split_bind(bind: str) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` -> (host, port); port 0 = any."""
    if bind.startswith("["):
        host, _, rest = bind[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else "0"
    elif bind.count(":") == 1:
        host, port = bind.split(":")
    else:
        host, port = bind, "0"
    if not host or not port.isdigit() or int(port) > 65535:
        raise ChannelError(f"bind address {bind!r}: expected host, host:port or [v6]:port")
    return host, int(port)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class CoordinatorChannel:
    """The coordinator's end: binds, learns each vrank's connection from its authenticated
    messages, sends orders, receives reports, and hosts the job's rendezvous store on the
    same socket (:attr:`store`; a committed generation retires the keys of those before
    it).

    Args:
        job: the job id every message must name.
        secret: the job's :class:`JobSecret` (or raw key bytes, then :meth:`worker_env`
            cannot name the file).
        bind: interface to listen on: ``host``, ``host:port`` or ``[v6]:port`` (port 0 or
            none: any free port).
        advertise: the host workers connect to; defaults to the bind host, and is required
            when binding every interface (``0.0.0.0``, ``::``, ``*``).
        generation: the job's current generation (stamped on welcomes; the loop updates
            :attr:`generation` when it opens a new one).
        window_s: accepted distance between a message's timestamp and this clock.
        queue_limit: messages queued per worker before sends fail.
        store_class: the store to host (default ``StoreServer``; a subclass that counts:
            ``bench control``).

    Not thread-safe: use it from the coordinator's loop thread (the store serves from a
    thread of its own).
    """

    def __init__(self, job: str, secret: bytes | JobSecret, bind: str = "127.0.0.1", *,
                 advertise: str | None = None, generation: int = 0,
                 window_s: float = DEFAULT_WINDOW_S, queue_limit: int = DEFAULT_QUEUE,
                 clock: Callable[[], float] = time.time,
                 store_class: type[StoreServer] | None = None) -> None:
        from .store import CarriedChannel, StoreError, StoreServer

        host, port = split_bind(bind)
        if advertise is None:
            if host in ("0.0.0.0", "::", "*"):
                raise ChannelError(f"binding {host} listens on every interface: give the "
                                   f"address workers should connect to (advertise=...)")
            advertise = host
        self.job = job
        self.generation = generation
        self._secret = secret
        self._sealer = Sealer(job, secret, COORDINATOR, clock=clock)
        self._opener = Opener(job, secret, COORDINATOR, window_s=window_s, clock=clock)
        self._rejects = _RejectLog(f"[job {job} coordinator]")
        self._peers: dict[int, bytes] = {}
        # the generation each vrank's newest process said Hello in: a report of an older
        # generation comes from a process before it (an idle joiner still exiting)
        self._hello_generation: dict[int, int] = {}
        # the routing id each vrank was last found unreachable at: said once, not per send
        # (a relaunched vrank's old process is gone until its new one says hello)
        self._unreachable: dict[int, bytes] = {}
        self._committed = -1
        # which Hellos make their sender the vrank they name (None: every one); the others
        # are told to stop (see _accept)
        self.admit: Callable[[Hello], bool] | None = None
        self._closed = False
        try:
            self.store = (store_class or StoreServer)(
                _key_of(secret), host, port=port, job=job,
                channel=CarriedChannel(queue_limit, MAX_FRAME_BYTES))
        except StoreError as e:
            raise ChannelError(f"cannot bind the control channel of job {job} to "
                               f"{bind}: {e}") from None
        self._inbox, self._outbox = self.store.inbox, self.store.outbox
        self.port = self.store.port
        self.advertise = advertise
        self.bind = f"{_bracket(host)}:{self.port}"
        self.address = f"tcp://{_bracket(advertise)}:{self.port}"
        logger.info("[job %s coordinator] control channel on %s (workers connect to %s)",
                    job, self.bind, self.address)

    def __repr__(self) -> str:
        return f"CoordinatorChannel(job={self.job!r}, address={self.address!r})"

    def __enter__(self) -> "CoordinatorChannel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def rejected(self) -> Counter[str]:
        """How many received messages were dropped, by reason (a copy)."""
        return Counter(self._rejects.counts)

    @property
    def refused_handshakes(self) -> int:
        """Peers dropped at the CURVE handshake (no key of this job)."""
        return self.store.refused_handshakes

    @property
    def vranks(self) -> frozenset[int]:
        """Vranks heard from (that orders can be sent to)."""
        return frozenset(self._peers)

    def worker_env(self) -> dict[str, str]:
        """What a launched worker needs in its environment to reach this channel (the
        backend adds its vrank, generation and device)."""
        if not isinstance(self._secret, JobSecret):
            raise ChannelError("this channel was given raw key bytes; give it the JobSecret "
                               "so that workers can be told where its file is")
        return {envvars.JOB: self.job, envvars.COORDINATOR: self.address,
                envvars.SECRET_FILE: str(self._secret.path)}

    def send(self, vrank: int, message: ToWorker) -> bool:
        """Queue ``message`` for ``vrank``; never blocks.

        Returns:
            False when the vrank has not been heard from, is not connected any more, or its
            queue is full (the loop retries later; orders are idempotent by generation).
        """
        return not self._send_all(message, [vrank])

    def broadcast(self, message: Order, vranks: Iterable[int]) -> list[int]:
        """Send ``message`` to every vrank; returns those it could not be sent to (one
        request to the socket's thread for them all)."""
        return self._send_all(message, sorted(set(vranks)))

    def _send_all(self, message: ToWorker, vranks: Sequence[int], *,
                  answered: bool = True) -> list[int]:
        """Seal ``message`` to each vrank and hand them to the socket's thread; the vranks
        it did not reach. Not ``answered`` (a Welcome: nothing waits on it, and a burst of
        Hellos must not wait on a round trip each), the loop goes on at once and only the
        vranks never heard from are returned."""
        if message.job != self.job:
            raise ValueError(f"message of job {message.job!r} sent on the channel of "
                             f"job {self.job!r}")
        name = type(message).__name__
        body = ENCODER.encode(message)  # once, whatever the number of receivers
        missed, batch = [], []
        for vrank in vranks:
            routing = self._peers.get(vrank)
            if routing is None:
                logger.debug("[job %s coordinator] vrank %d has not said hello; %s not sent",
                             self.job, vrank, name)
                missed.append(vrank)
            else:
                batch.append((vrank, routing, self._sealer.seal(
                    vrank, message.generation, message, body=body)))
        if not batch:
            return missed
        statuses = self._deliver([(routing, frames) for _, routing, frames in batch],
                                 answered=answered)
        if not answered:
            return missed
        for (vrank, routing, _), status in zip(batch, statuses, strict=True):
            if status == SENT:
                self._unreachable.pop(vrank, None)
                continue
            missed.append(vrank)
            if status == QUEUE_FULL:
                logger.warning("[job %s coordinator] queue to vrank %d is full; %s not sent",
                               self.job, vrank, name)
                continue
            first = self._unreachable.get(vrank) != routing
            self._unreachable[vrank] = routing
            logger.log(logging.INFO if first else logging.DEBUG,
                       "[job %s coordinator] vrank %d unreachable (not connected); %s not "
                       "sent%s", self.job, vrank, name,
                       " (said once until it says hello again)" if first else "")
        return sorted(missed)

    def _deliver(self, batch: Sequence[tuple[bytes, list[bytes]]], *,
                 answered: bool = True) -> bytes:
        """Send ``(routing, frames)`` messages through the socket's thread; one status
        byte each (:data:`SENT`, ...), or none where not ``answered``."""
        if self._closed:
            return bytes(len(batch))  # none of them SENT
        self._outbox.send_multipart([ANSWER if answered else b"",
                                     *(f for routing, frames in batch for f in (routing, *frames))])
        if not answered:
            return b""
        while not self._outbox.poll(_DELIVER_LOOK_MS):
            if not self.store.serving:
                raise ChannelError(f"the control channel of job {self.job}: its socket's "
                                   "thread ended")
        return self._outbox.recv()

    def recv(self, timeout_s: float) -> tuple[int, Report] | None:
        """The next accepted report as ``(vrank, report)``, or None after ``timeout_s``.

        Rejected messages are counted and skipped; nothing a peer sends raises here."""
        if self._closed:
            raise ChannelError(f"the control channel of job {self.job} is closed")
        deadline = time.monotonic() + max(0.0, timeout_s)
        late = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late += 1
                if late > 256:  # a flood of garbage does not hold the loop past its timeout
                    return None
            if not self._inbox.poll(max(0, int(remaining * 1000))):
                return None
            try:
                frames = self._inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            got = self._accept(frames)
            if got is not None:
                return got

    def _accept(self, frames: list[bytes]) -> tuple[int, Report] | None:
        routing = frames[0]
        try:
            env = self._opener.open(frames[1:])
            report = decode_report(env)
        except Rejected as r:
            self._rejects.note(r.reason, r.detail, routing.hex()[:16])
            return None
        except Exception as e:  # noqa: BLE001 - a peer must never crash the coordinator
            self._rejects.note("internal", f"{type(e).__name__} while checking a message",
                               routing.hex()[:16])
            return None
        vrank = env.sender
        if isinstance(vrank, str):  # Opener lets only vranks through to the coordinator
            return None
        if isinstance(report, Hello) and self.admit is not None and not self.admit(report):
            # a process this coordinator neither launched nor reattached (a worker of the one
            # before it, after a restart that started the job again): never taken for the
            # vrank it names, told to stop instead of holding out its reattach wait
            stop = Stop(self.job, report.generation + 1, "the restarted coordinator started "
                        "the job again without this process")
            self._deliver([(routing, self._sealer.seal(vrank, stop.generation, stop))],
                          answered=False)
            return None
        if isinstance(report, Hello):
            self._hello_generation[vrank] = report.generation
        elif report.generation < self._hello_generation.get(vrank, 0):
            # a process of this vrank before the one that said Hello last: its report is
            # taken, but what is sent to the vrank keeps going to the newer process
            return vrank, report
        self._peers[vrank] = routing
        if isinstance(report, Hello):  # the store is open: on this connection
            self._send_all(Welcome(self.job, self.generation, vrank, self.advertise, self.port),
                           [vrank], answered=False)
        if (isinstance(report, Resized) and report.outcome == "committed"
                and report.generation > self._committed):
            self._committed = report.generation
            self.store.retire_generations(report.generation)
        return vrank, report

    def close(self, linger_s: float = 0.5) -> None:
        """Close the socket (and the store on it), giving queued orders ``linger_s`` to
        leave."""
        if self._closed:
            return
        self._closed = True
        self.store.close(linger_s)


class WorkerChannel:
    """A worker's end of the channel; implements :class:`~slurm_etc.protocol.messages.Control`.

    ``poll`` never blocks, ``report`` never blocks (a bounded outbox in front of a bounded
    zmq queue; when both are full the report is dropped and counted in :attr:`dropped`),
    ``wait`` blocks up to its timeout. Safe to report from another thread while the main
    thread polls or waits.

    It also carries the worker's rendezvous store (``StoreClient.over(channel)``), whose
    requests come from several threads (the trainer's, gloo's and NCCL's through
    ``PrefixStore``, a preparation thread). The socket is not thread-safe, so the thread
    holding ``_lock`` reads it for everyone (leader and followers): orders go to the
    inbox, store replies to the store client (:meth:`carry_store`), which the thread
    waiting for each takes (:meth:`pump_until`); a thread that cannot take the socket
    queues what it sends and wakes the holder (an eventfd the holder polls beside the
    socket).

    Args:
        job, vrank: who this worker is.
        address: the coordinator's advertised address (``tcp://host:port``).
        secret: the job's secret (:func:`load_secret` of ``SLURM_ETC_SECRET_FILE``).
        generation: the generation the worker was launched into; orders of older
            generations are dropped, and the generation follows accepted orders.
        context: a zmq context to open the socket in, which the caller owns (many
            simulated workers in one process share one: ``slurm-etc bench control``);
            None (a real worker): one of its own, terminated by :meth:`close`.
        poller: what makes the socket's poller: ``zmq.Poller``, or the poller of the
            context's kind (``zmq.green.Poller`` beside a ``zmq.green.Context``: the
            simulated workers of ``bench control`` are greenlets).
    """

    def __init__(self, job: str, vrank: int, address: str, secret: bytes | JobSecret, *,
                 generation: int = 0, window_s: float = DEFAULT_WINDOW_S,
                 queue_limit: int = DEFAULT_QUEUE,
                 clock: Callable[[], float] = time.time,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None,
                 poller: Callable[[], zmq.Poller] = zmq.Poller) -> None:
        self.job = job
        self.vrank = vrank
        self.address = address
        self._generation = generation
        self._queue_limit = queue_limit
        self._sealer = Sealer(job, secret, vrank, clock=clock)
        self._opener = Opener(job, secret, vrank, window_s=window_s, clock=clock)
        self._rejects = _RejectLog(f"[job {job} gen {generation} vrank {vrank}]")
        self._inbox: deque[Order] = deque()
        self._outbox: deque[list[bytes]] = deque()
        self._delivered: set[Order] = set()
        self._welcome: Welcome | None = None
        self._heard = time.monotonic()  # the last authenticated message, or the link's end
        self._linked = False  # a CURVE session with the coordinator is up (libzmq's heartbeats)
        self._lock = threading.Lock()  # held by the thread that uses the socket
        self._watch_lock = threading.Lock()
        # followers wait on it for their store replies, or for the socket to be free
        self._turn = threading.Condition()
        self._store_out: deque[list[bytes]] = deque()  # store requests: never dropped
        self._on_store: Callable[[bytes], None] | None = None
        self._drops = 0  # times the link to the coordinator went down
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._closed = False
        self.dropped = 0
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._sock = self._ctx.socket(zmq.DEALER)
        try:
            make_client(self._sock, curve_keys(_key_of(secret)))
            self._sock.setsockopt(zmq.LINGER, _DEFAULT_LINGER_MS)
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            self._sock.setsockopt(zmq.SNDHWM, queue_limit)
            self._sock.setsockopt(zmq.RCVHWM, queue_limit)
            # liveness without a message per worker from the coordinator's Python loop:
            # libzmq pings every HEARTBEAT_S and the coordinator's I/O thread answers; no
            # answer within HEARTBEAT_TIMEOUT_S drops the link, and the coordinator's end
            # drops it when no ping came for both (a dead coordinator's closes at once)
            ivl, timeout = int(HEARTBEAT_S * 1000), int(HEARTBEAT_TIMEOUT_S * 1000)
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
            self._sock.setsockopt(zmq.HEARTBEAT_TTL, ivl + timeout)
            self._link = self._sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            if address.startswith("tcp://["):
                self._sock.setsockopt(zmq.IPV6, 1)
            self._sock.connect(address)
        except zmq.ZMQError as e:
            self.close(linger_s=0)
            raise ChannelError(f"cannot connect to the coordinator at {address!r}: {e}") from None
        self._poller = poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake, zmq.POLLIN)
        # the link's events in the same poll: a read of the socket asks the kernel once
        self._poller.register(self._link, zmq.POLLIN)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: object
                 ) -> "WorkerChannel":
        """The channel described by ``SLURM_ETC_JOB``, ``_VRANK``, ``_GENERATION``,
        ``_COORDINATOR`` and ``_SECRET_FILE`` (what the backend and
        :meth:`CoordinatorChannel.worker_env` put in a launched worker's environment)."""
        environ = os.environ if environ is None else environ
        missing = [name for name in (envvars.JOB, envvars.VRANK, envvars.COORDINATOR,
                                     envvars.SECRET_FILE) if not environ.get(name)]
        if missing:
            raise ChannelError(f"not launched as a slurm-etc worker: {', '.join(missing)} "
                               f"not set")
        try:
            vrank = int(environ[envvars.VRANK])
            generation = int(environ.get(envvars.GENERATION, "0"))
        except ValueError:
            raise ChannelError(f"{envvars.VRANK} and {envvars.GENERATION} must be integers, "
                               f"got {environ[envvars.VRANK]!r} and "
                               f"{environ.get(envvars.GENERATION)!r}") from None
        secret = load_secret(environ[envvars.SECRET_FILE])
        return cls(environ[envvars.JOB], vrank, environ[envvars.COORDINATOR], secret,
                   generation=generation, **kwargs)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return (f"WorkerChannel(job={self.job!r}, vrank={self.vrank}, "
                f"address={self.address!r}, generation={self._generation})")

    def __enter__(self) -> "WorkerChannel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def heard_at(self) -> float:
        """When the coordinator was last known alive (monotonic): now while the link to it
        is up, a CURVE session that libzmq's heartbeats keep (the coordinator's I/O thread
        answers them: nothing per worker in its Python loop); else its last message or the
        link's end, whichever came later. A coordinator killed closes the link at once; one
        whose process hangs but lives still answers (its job's time limit bounds it)."""
        self._watch()
        return time.monotonic() if self._linked else self._heard

    def _watch(self) -> None:
        """Take the link's events (up: a handshake succeeded; down: disconnected)."""
        with self._watch_lock:
            if self._closed:
                return
            while self._link.poll(0):
                event = recv_monitor_message(self._link)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._linked = True
                elif event == zmq.EVENT_DISCONNECTED:
                    self._drops += 1
                    if self._linked:
                        self._linked = False
                        self._heard = max(self._heard, time.monotonic())

    @property
    def link_drops(self) -> int:
        """How many times the connection to the coordinator went down (its process died,
        or its heartbeats stopped); a store request in flight fails on a new drop."""
        self._watch()
        return self._drops

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def generation(self) -> int:
        """The newest generation this worker has been ordered into (or launched into)."""
        return self._generation

    @generation.setter
    def generation(self, value: int) -> None:
        self._generation = value
        self._rejects.label = f"[job {self.job} gen {value} vrank {self.vrank}]"

    @property
    def rendezvous(self) -> Welcome | None:
        """The latest Welcome (rendezvous store address), or None before the first."""
        return self._welcome

    @property
    def rejected(self) -> Counter[str]:
        """How many received messages were dropped, by reason (a copy)."""
        return Counter(self._rejects.counts)

    # -- Control ---------------------------------------------------------------------
    def poll(self) -> Order | None:
        """An order waiting for this worker, or None; never blocks."""
        if self._lock.acquire(blocking=False):
            try:
                self._pump(0.0)
            finally:
                self._hand_over()
        return self._inbox.popleft() if self._inbox else None

    def wait(self, timeout_s: float) -> Order | None:
        """Block until an order arrives, or None after ``timeout_s``."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            if self._inbox:
                return self._inbox.popleft()
            if self._closed:
                return None
            remaining = deadline - time.monotonic()
            self._lead(min(max(remaining, 0.0), _WAIT_SLICE_S))
            if remaining <= 0:
                return self._inbox.popleft() if self._inbox else None

    def report(self, message: Report) -> None:
        """Queue a report for the coordinator; never blocks (drops when the queue is full).

        Raises:
            ValueError: the report names another job or vrank (a bug in the caller).
        """
        if message.job != self.job or message.vrank != self.vrank:
            raise ValueError(f"report of job {message.job!r} vrank {message.vrank} on the "
                             f"channel of job {self.job!r} vrank {self.vrank}")
        frames = self._sealer.seal(COORDINATOR, message.generation, message)
        if len(self._outbox) >= self._queue_limit:
            self.dropped += 1
            logger.debug("%s report queue full; %s dropped", self._rejects.label,
                         type(message).__name__)
            return
        self._outbox.append(frames)
        self._send_soon()

    # -- rendezvous ------------------------------------------------------------------
    def join(self, timeout_s: float = 120.0, *, host: str | None = None,
             pid: int | None = None, resend_s: float = 2.0) -> Welcome:
        """Say Hello (again every ``resend_s``) until the coordinator answers with a Welcome.

        Orders that arrive meanwhile are kept for :meth:`poll`.

        Raises:
            ChannelError: no Welcome within ``timeout_s``.
        """
        hello = Hello(self.job, self._generation, self.vrank, host or socket.gethostname(),
                      os.getpid() if pid is None else pid)
        deadline = time.monotonic() + timeout_s
        next_hello = 0.0
        while self._welcome is None:
            now = time.monotonic()
            if now >= deadline or self._closed:
                raise ChannelError(
                    f"{self._rejects.label} no welcome from the coordinator at "
                    f"{self.address} within {timeout_s:g} s (is it running and reachable, "
                    f"and is this the job's secret?)")
            if now >= next_hello:
                self.report(hello)
                next_hello = now + resend_s
            self._lead(min(0.05, max(0.0, deadline - now)))
        return self._welcome

    def rejoin(self, step: int, trained: int) -> None:
        """Say Hello again, with the step this worker trained to in generation ``trained``,
        and forget the Welcome of the coordinator before: :attr:`rendezvous` is None until
        a coordinator answers. A coordinator restarted on the job's record binds the address
        this channel connects to (zmq reconnects by itself) and learns this worker from it."""
        self._welcome = None
        self.report(Hello(self.job, self._generation, self.vrank, socket.gethostname(),
                          os.getpid(), step=step, trained=trained))

    # -- the store's requests on this connection (StoreClient.over) --------------------
    def carry_store(self, on_reply: Callable[[bytes], None]) -> None:
        """Hand every store reply read off this connection to ``on_reply`` (called by
        whichever thread reads the socket, holding it); one store client per channel.

        Raises:
            ChannelError: a store client rides this channel already.
        """
        if self._on_store is not None:
            raise ChannelError(f"{self._rejects.label} carries a store client already")
        self._on_store = on_reply

    def send_store(self, request: bytes) -> None:
        """Send a store request (never dropped: queued while the socket is busy)."""
        self._store_out.append([STORE_FRAME, request])
        self._send_soon()

    def pump_until(self, done: Callable[[], bool], deadline: float) -> None:
        """Return once ``done()`` (evaluated under the turn's condition, after every read
        of the socket), at ``deadline`` (monotonic), or when the channel is closed. The
        calling thread reads the socket for everyone while it is free; else it waits for
        the holder to wake it (a reply of its own read, or the socket handed over).

        At the deadline the socket is read once more, without waiting, before giving up: a
        thread that runs late (a busy host, a long GIL hold, a paused process) takes a reply
        that came in time for one, and a waiting rank is not taken for one whose
        coordinator died (it would rejoin: a handshake and a new arrival at the store)."""
        last_read = False
        while True:
            with self._turn:
                while True:
                    now = time.monotonic()
                    if done() or self._closed or last_read:
                        return
                    if self._lock.acquire(blocking=False):
                        break
                    if now >= deadline:  # another thread reads the socket now
                        return
                    self._turn.wait(min(deadline - now, _FOLLOW_S))
            last_read = time.monotonic() >= deadline
            try:
                self._pump(max(0.0, min(deadline - time.monotonic(), _LEAD_SLICE_S)))
            finally:
                self._hand_over()

    def close(self, linger_s: float = 1.0) -> None:
        """Close the socket, giving queued reports (e.g. a final Exited) ``linger_s``.
        Store requests waiting on it end at once (unanswered)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._flush(closing=True)
            self._sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
            if hasattr(self, "_link"):
                with self._watch_lock:
                    self._sock.disable_monitor()
                    self._link.close(linger=0)
            self._sock.close()
        with self._turn:
            os.close(self._wake)
            self._turn.notify_all()
        if self._own_ctx:
            self._ctx.term()

    # -- internals -----------------------------------------------------------------------
    def _send_soon(self) -> None:
        """Send what is queued now if the socket is free, else wake the thread holding it."""
        if self._lock.acquire(blocking=False):
            try:
                self._flush()
            finally:
                self._hand_over()
            return
        with self._turn:
            if not self._closed:
                os.eventfd_write(self._wake, 1)

    def _lead(self, timeout_s: float) -> None:
        """Take the socket (waiting for it), read it for ``timeout_s`` at most, hand it over."""
        self._lock.acquire()
        try:
            self._pump(timeout_s)
        finally:
            self._hand_over()

    def _hand_over(self) -> None:
        """Free the socket and wake the threads waiting for their store replies: one of
        them may take the socket over."""
        self._lock.release()
        with self._turn:
            self._turn.notify_all()

    # -- with the lock held ---------------------------------------------------------------
    def _flush(self, *, closing: bool = False) -> None:
        if self._closed and not closing:
            return
        for queue in (self._store_out, self._outbox):
            while queue:
                try:
                    self._sock.send_multipart(queue[0], flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as e:
                    logger.debug("%s cannot send: %s", self._rejects.label, e)
                    return
                queue.popleft()

    def _pump(self, timeout_s: float) -> None:
        """Send what is queued, wait up to ``timeout_s`` for something to read (or a wake),
        read what is there: orders to the inbox, store replies to the store client."""
        if self._closed:
            return
        self._flush()
        ready = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        if self._wake in ready:
            try:
                os.eventfd_read(self._wake)
            except BlockingIOError:
                pass
            self._flush()
        replies = False
        if self._sock in ready:
            for _ in range(10_000):  # drain what is there, but a flood cannot keep us here
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if frames[0] == STORE_FRAME and len(frames) == 2 and self._on_store:
                    self._on_store(frames[1])
                    replies = True
                else:
                    self._take(frames)
        drops = self._drops
        if self._link in ready:
            self._watch()
        if replies or self._drops != drops:
            with self._turn:
                self._turn.notify_all()

    def _take(self, frames: list[bytes]) -> None:
        try:
            env = self._opener.open(frames)
            message = decode_to_worker(env)
        except Rejected as r:
            self._rejects.note(r.reason, r.detail)
            return
        except Exception as e:  # noqa: BLE001 - a peer must never crash a worker
            self._rejects.note("internal", f"{type(e).__name__} while checking a message")
            return
        self._heard = time.monotonic()
        if isinstance(message, Welcome):
            self._welcome = message
            return
        if message.generation < self._generation:
            self._rejects.note("old_generation", f"{type(message).__name__} of gen "
                                                 f"{message.generation} < {self._generation}")
            return
        if message in self._delivered:
            self._rejects.note("duplicate", f"{type(message).__name__} of gen "
                                            f"{message.generation} delivered before")
            return
        if message.generation > self._generation:
            self.generation = message.generation
            self._delivered = {m for m in self._delivered if m.generation >= message.generation}
        self._delivered.add(message)
        self._inbox.append(message)

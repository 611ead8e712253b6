"""Closing a live process's gloo connections, so that peers blocked on it fail at once.

Gloo has no abort. A rank whose collective failed (a peer died) leaves the collective, but
its process lives on and its groups' TCP pairs stay open: a peer blocked on it in another
collective of the step waits out the group's timeout (300 s), and ``ProcessGroup.shutdown``
does not close the pairs (measured on torch 2.13: rank 1 shuts its group down, rank 0's
``all_reduce`` waits its full 20 s timeout). ``shutdown(2)`` on the pairs' sockets does:
the peer's read fails at once with "Connection closed by peer" (measured: 2 and 4
processes, every peer blocked in an ``all_reduce`` fails within 30 ms of the shutdown);
that peer then closes its own, so a ring of blocked ranks unwinds hop by hop.

Which sockets: the TCP connections this process opened after :func:`snapshot` was taken
(before its first process group), less those to the coordinator (its channel and store:
``spare_ports``) and those of a world kept (groups prepared beside the failed ones:
``keep``, recorded by :func:`opened_during`). Linux only (``/proc``); elsewhere nothing is
closed and peers wait out their timeout as before.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Collection, Iterator

log = logging.getLogger(__name__)

_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED = "01"


def _socket_fds() -> dict[int, int]:
    """This process's sockets: inode -> file descriptor."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def _established() -> dict[int, int]:
    """Established TCP connections of this network namespace: inode -> remote port."""
    out: dict[int, int] = {}
    for table in _TCP_TABLES:
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _ESTABLISHED:
                out[int(fields[9])] = int(fields[2].rsplit(":", 1)[1], 16)
    return out


def snapshot() -> frozenset[int]:
    """The sockets this process holds now (taken before its first process group)."""
    return frozenset(_socket_fds())


@contextlib.contextmanager
def opened_during() -> Iterator[set[int]]:
    """The sockets opened while the block runs (filled in when it ends): a world's groups."""
    before = set(_socket_fds())
    opened: set[int] = set()
    try:
        yield opened
    finally:
        opened.update(set(_socket_fds()) - before)


def close_group_connections(base: Collection[int], *, spare_ports: Collection[int] = (),
                            keep: Collection[int] = ()) -> int:
    """Shut down (both directions) every established TCP connection of this process not in
    ``base`` or ``keep`` and not to a port in ``spare_ports``; the descriptors stay open (their
    owner closes them). How many were shut down."""
    connections = _established()
    shut = 0
    for inode, fd in _socket_fds().items():
        if inode in base or inode in keep or inode not in connections:
            continue
        if connections[inode] in spare_ports:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError:
            pass
        finally:
            sock.close()
    log.debug("shut down %d group connection(s)", shut)
    return shut

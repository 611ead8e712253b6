"""How a worker knows its coordinator is there, at no cost to the coordinator's process.

A coordinator killed closes its connections at once (its process's sockets close: the
kernel resets them). A coordinator's host gone, or the network between, is found by TCP's
keepalive, which the kernels at both ends run: a connection idle for :data:`LINK_IDLE_S` is
probed every :data:`LINK_PROBE_S`, and :data:`LINK_PROBES` probes unanswered drop it; on a
worker's end, a request unacknowledged for as long drops it too (``TCP_MAXRT``: keepalive
probes only an idle link). The coordinator's kernel answers a worker's probes and sends its
own, so its process does nothing per worker and per interval (issue #42); before, libzmq's
heartbeats (a CURVE-sealed ping a worker every 10 s, answered by the coordinator's I/O
thread) cost its process ~18 us a ping, 1,638 pings a second at 16,384 ranks. What neither
finds: a coordinator whose process hangs but lives (libzmq's I/O thread answered its pings
too; its job's time limit bounds it).

The coordinator's end has no ``TCP_MAXRT``: with it, healthy idle links dropped under load
(``bench control --ranks 2048 --no-resizes``: every rank reconnected, 282 messages a step at
the coordinator against 1.0, 40 store requests timed out; none with it on the workers' end
alone). A dead worker is the backend's to find (its process's exit, its node's state), not
its link's; the link's keepalive only frees the descriptor.
"""
from __future__ import annotations

import zmq

LINK_IDLE_S = 10
LINK_PROBE_S = 5
LINK_PROBES = 4


def watch_link(sock: zmq.Socket[bytes], *, requests: bool = True) -> None:
    """Have the kernel watch ``sock``'s TCP connections (before it binds or connects);
    ``requests``: a worker's end, whose unanswered requests drop the link too."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, LINK_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, LINK_PROBE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, LINK_PROBES)
    if requests:
        sock.setsockopt(zmq.TCP_MAXRT, lost_after_s() * 1000)


def lost_after_s() -> int:
    """How long after its last word a link that stopped answering is dropped, at most."""
    return LINK_IDLE_S + LINK_PROBE_S * LINK_PROBES

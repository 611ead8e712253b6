"""scripts/slurm-local.sh on a running cluster: `up` again is a quick no-op, `status` is 0,
and the supervisor reaps: no daemon of ours is a zombie."""
import json
import subprocess
import time
from pathlib import Path

from .conftest import SCRIPT, _cluster_dir


def test_up_again_is_a_no_op(cluster):
    t0 = time.monotonic()
    res = subprocess.run([str(SCRIPT), "up"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "already up" in res.stderr and f"SLURM_CONF={cluster.conf}" in res.stdout
    assert time.monotonic() - t0 < 10
    assert subprocess.run([str(SCRIPT), "status"], capture_output=True).returncode == 0


def test_daemons_are_children_of_the_supervisor(cluster):
    run = _cluster_dir() / "run"
    supervisor = int((run / "supervisor.pid").read_text())
    pids = json.loads((run / "pids.json").read_text())
    assert {"munged", "mariadb", "slurmdbd", "slurmctld"} <= set(pids)
    for name, pid in pids.items():
        stat = Path(f"/proc/{pid}/stat").read_text()
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        assert int(ppid) == supervisor and state not in ("Z", "X"), (name, pid, state, ppid)

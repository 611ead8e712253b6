"""Workers forked from the preloader (slurm_etc.local.preload) start as a fresh interpreter
would: argv, environment, working directory, sys.path, stdout and stderr to the log, a
session of their own, and the exit status (a code, a signal, an uncaught exception) reported
back; commands a fresh interpreter would start differently are not forked; the children
outlive a coordinator that died. One preloader (torch and megatron-core imported once) for
the module."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slurm_etc.coordinator.processes import process_start
from slurm_etc.local.preload import Preloader, forkable

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch
    mode = sys.argv[1]
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                      "env": os.environ.get("PRELOAD_TEST"), "threads": torch.get_num_threads(),
                      "sid": os.getsid(0) == os.getpid(), "main": __name__}), flush=True)
    print("to stderr", file=sys.stderr)
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise ValueError("planted")
    if mode == "sleep":
        time.sleep(60)
""")


@pytest.fixture(scope="module")
def preloader():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = Preloader(env)
    assert p.usable(120.0)
    yield p
    p.close()


def _run(preloader: Preloader, tmp_path: Path, mode: str, **env: str):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    log = tmp_path / f"{mode}.log"
    proc = preloader.launch([sys.executable, str(script), mode],
                            {**preloader.env, **env}, str(log))
    assert proc is not None
    return proc, log


def test_a_forked_worker_starts_as_a_fresh_interpreter(preloader, tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    proc, log = _run(preloader, tmp_path, "exit3", PRELOAD_TEST="seen", OMP_NUM_THREADS="1")
    assert proc.wait(60) == 3
    out = log.read_text().splitlines()
    seen = json.loads(out[0])
    assert seen["argv"] == [str(tmp_path / "w.py"), "exit3"]
    assert seen["cwd"] == str(tmp_path) and seen["path0"] == str(tmp_path)
    assert seen["env"] == "seen" and seen["threads"] == 1 and seen["sid"]
    assert seen["main"] == "__main__"
    assert "to stderr" in out


def test_an_uncaught_exception_is_status_1_with_its_traceback(preloader, tmp_path):
    proc, log = _run(preloader, tmp_path, "raise")
    assert proc.wait(60) == 1
    text = log.read_text()
    assert "Traceback" in text and "ValueError: planted" in text


def test_a_killed_worker_reports_the_signal(preloader, tmp_path):
    proc, _log = _run(preloader, tmp_path, "sleep")
    time.sleep(0.5)
    assert proc.poll() is None
    # what ps shows: the worker's command, not the preloader's
    title = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert "w.py sleep" in title and "slurm_etc.local.preload" not in title, title
    os.killpg(proc.pid, signal.SIGKILL)  # as the backend does: the worker's session
    assert proc.wait(30) == -signal.SIGKILL


def test_a_module_runs_as_with_dash_m(preloader, tmp_path):
    log = tmp_path / "m.log"
    proc = preloader.launch([sys.executable, "-m", "json.tool", "--help"], preloader.env,
                            str(log))
    assert proc is not None and proc.wait(60) == 0
    assert "usage:" in log.read_text()


def test_only_what_a_fresh_interpreter_starts_alike_is_forked():
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    py = sys.executable
    assert forkable([py, "-m", "slurm_etc.worker.preset_worker"], env, env)
    assert forkable([py, "train.py", "--steps", "3"], {**env, "SLURM_ETC_VRANK": "2"}, env)
    assert not forkable(["/usr/bin/python3.11", "train.py"], env, env)  # another python
    # another name of this python in its own directory (a venv's bin/python beside the
    # bin/python3.11 its console scripts run): the same interpreter and environment
    alias = os.path.join(os.path.dirname(py), "python")
    if alias != py and os.path.realpath(alias) == os.path.realpath(py):
        assert forkable([alias, "train.py"], env, env)
    # a bare name found on the PATH the worker is given
    assert forkable([os.path.basename(py), "train.py"],
                    {**env, "PATH": os.path.dirname(py)}, {**env, "PATH": os.path.dirname(py)})
    assert not forkable(["python-that-is-not-there", "train.py"], env, env)
    assert not forkable([py, "-u", "train.py"], env, env)  # interpreter options
    assert not forkable([py, "-c", "print(1)"], env, env)
    assert not forkable(["bash", "run.sh"], env, env)
    assert not forkable([py, "train.py"], {**env, "OMP_NUM_THREADS": "4"}, env)
    assert not forkable([py, "train.py"], {**env, "PYTHONPATH": "/x"}, env)


def test_workers_outlive_a_coordinator_that_died(tmp_path):
    """The preloader exits when its coordinator's end of the pipe closes; the workers it
    forked train on (a restarted coordinator adopts them)."""
    p = Preloader({**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.usable(120.0)
    proc, _log = _run(p, tmp_path, "sleep")
    start = process_start(proc.pid)
    p._conn.close()  # the coordinator's side gone, as when it is SIGKILLed
    p._proc.wait(30)
    time.sleep(0.3)
    try:
        assert process_start(proc.pid) == start  # still the same process, running
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


def test_a_worker_without_a_log_writes_to_the_coordinators_stdout_and_stderr(tmp_path):
    """As a cold worker inherits them (slurm-etc run's local backend gives no log): a
    forked one's output is not lost to the preloader's /dev/null."""
    worker = tmp_path / "w.py"
    worker.write_text("import sys\nprint('worker says out')\n"
                      "print('worker says err', file=sys.stderr)\n")
    coordinator = tmp_path / "c.py"
    coordinator.write_text(
        "import os, sys\n"
        "from slurm_etc.local.preload import Preloader\n"
        "p = Preloader({**os.environ, 'OMP_NUM_THREADS': '1'})\n"
        "assert p.usable(120.0)\n"
        f"w = p.launch([sys.executable, {str(worker)!r}], p.env, None)\n"
        "assert w is not None and w.wait(60) == 0\n"
        "p.close()\n")
    done = subprocess.run([sys.executable, str(coordinator)], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "worker says out" in done.stdout and "worker says err" not in done.stdout
    assert "worker says err" in done.stderr

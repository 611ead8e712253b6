"""The Slurm backend's pure parts, its task wrapper and its member script, without a cluster
(the backend itself runs against a real cluster in tests/slurm/test_backend.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_etc.protocol.gpus import gpu_env, gpus_present, one_gpu
from slurm_etc.slurm.backend import (
    clean_shrink,
    devices_of,
    key_of_comment,
    member_comment,
)
from slurm_etc.slurm.member import notice_path
from slurm_etc.slurm.parsers import (
    gpus_per_node_of_job,
    parse_scontrol_jobs,
    parse_scontrol_partition,
)
from slurm_etc.slurm.task import MARK, decode_payload, encode_payload, worker_env

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm" / "22.05.8"

pytestmark = pytest.mark.timeout(60)


def test_partition_parser():
    p = parse_scontrol_partition((FIXTURES / "scontrol_partition_scavenge.out").read_text())
    assert p is not None and p.name == "scavenge" and p.grace_time == 10
    assert p.preempt_mode == "REQUEUE" and p.priority_tier == 1 and p.max_nodes is None
    assert parse_scontrol_partition(
        (FIXTURES / "scontrol_partition_unknown.out").read_text()) is None


def test_gpus_per_node_of_job():
    (job,) = parse_scontrol_jobs((FIXTURES / "scontrol_job_running.out").read_text())
    assert gpus_per_node_of_job(job) == 2  # TresPerNode=gres:gpu:2
    fields = {k: v for k, v in job.fields.items() if k != "TresPerNode"}
    assert gpus_per_node_of_job(job.__class__(**{**job.__dict__, "fields": fields})) == 2
    later = {**job.fields, "TresPerNode": "gres/gpu:a100:4"}  # 23.02+ spelling, typed
    assert gpus_per_node_of_job(job.__class__(**{**job.__dict__, "fields": later})) == 4
    (done,) = parse_scontrol_jobs((FIXTURES / "scontrol_job_completed.out").read_text())
    assert gpus_per_node_of_job(done) is None


@pytest.mark.parametrize("key", ["grow-1", "gen 3=grow", "a:b/c", "ünï", "%41"])
def test_comment_round_trip(key):
    comment = member_comment(key)
    assert " " not in comment and "=" not in comment
    assert key_of_comment(comment) == key
    assert key_of_comment("someone else's comment") is None


def test_clean_shrink():
    nodes = ("n2", "n3", "n4")
    assert clean_shrink(nodes, {"n4"}) == 2
    assert clean_shrink(nodes, {"n3", "n4"}) == 1
    assert clean_shrink(nodes, {"n3"}) is None  # Slurm would drop n4, not n3
    assert clean_shrink(nodes, set(nodes)) is None  # all of it: scancel
    assert clean_shrink(nodes, set()) is None
    assert devices_of(["a", "b"], 2)[-1].node == "b" and len(devices_of(["a"], 3)) == 3


def test_one_gpu_per_worker_and_env(tmp_path):
    assert one_gpu("0,1", 1) == "1" and one_gpu("2,3", 0) == "2" and one_gpu(None, 3) == "3"
    with pytest.raises(ValueError, match="not among this node's GPUs"):
        one_gpu("0", 1)
    with pytest.raises(SystemExit, match="not among this node's GPUs"):
        worker_env({"CUDA_VISIBLE_DEVICES": "0"}, {"vrank": 1, "local": 1})
    # the local backend narrows only where the node has GPUs (a CPU worker's environment
    # is left as it was: preloaded forks need it unchanged)
    assert gpu_env({"CUDA_VISIBLE_DEVICES": "6,7"}, 1, gpus=True) == {"CUDA_VISIBLE_DEVICES": "7"}
    assert gpu_env({}, 2, gpus=True) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert gpu_env({"CUDA_VISIBLE_DEVICES": "6,7"}, 1, gpus=False) == {}
    (tmp_path / "nvidiactl").touch()
    assert gpus_present(str(tmp_path / "nvidiactl")) and not gpus_present(str(tmp_path / "x"))
    env = worker_env({"CUDA_VISIBLE_DEVICES": "4,5", "A": "x"},
                     {"vrank": 9, "local": 1, "env": {"SLURM_ETC_VRANK": "9"}})
    assert env == {"CUDA_VISIBLE_DEVICES": "5", "A": "x", "SLURM_ETC_VRANK": "9"}
    payload = {"argv": ["a b", "ü"], "tasks": [{"vrank": 1, "local": 0, "env": {}}]}
    word = encode_payload(payload)
    assert word.isascii() and " " not in word and decode_payload(word) == payload


def _wrapper(tmp_path: Path, argv: list[str], localid: int, **extra) -> subprocess.Popen:
    payload = {"argv": argv, "ignore": extra.get("ignore", ["USR2"]),
               "stop_signal": extra.get("stop_signal", "TERM"),
               "tasks": [{"vrank": 3, "local": 0, "env": {"WHO": "three"}},
                         {"vrank": 7, "local": 1, "env": {"WHO": "seven"}}]}
    env = {**os.environ, "SLURM_LOCALID": str(localid), "CUDA_VISIBLE_DEVICES": "0,1",
           "SLURM_STEP_ID": "4"}
    return subprocess.Popen([sys.executable, "-m", "slurm_etc.slurm.task",
                             encode_payload(payload)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_task_wrapper_picks_worker_and_reports_exit(tmp_path):
    code = ("import os, signal, sys; print(os.environ['WHO'], os.environ['CUDA_VISIBLE_DEVICES'],"
            " signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN); sys.exit(5)")
    proc = _wrapper(tmp_path, [sys.executable, "-c", code], localid=1)
    out, err = proc.communicate(timeout=30)
    assert out.splitlines() == [f"{MARK} start 7 {out.split()[3]} 4", f"{MARK} exit 7 5"]
    assert err.strip() == "seven 1 True"  # the worker's stdout goes to the step's stderr
    assert proc.returncode == 5


def test_task_wrapper_stop_and_kill_over_stdin(tmp_path):
    # The worker ignores SIGTERM (as a stubborn one would): stop, then kill.
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    proc = _wrapper(tmp_path, [sys.executable, "-c", code], localid=0)
    assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(f"{MARK} start 3 ")
    assert proc.stderr.readline().strip() == "ready"
    proc.stdin.write("stop 7\nstop 3\n")  # another task's stop is not ours
    proc.stdin.flush()
    time.sleep(0.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)  # Slurm's SIGTERM does not end the wrapper
    proc.stdin.write("kill 3\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == f"{MARK} exit 3 -9"
    assert proc.wait(10) == 128 + 9


def test_task_wrapper_stop_signal_int_where_term_is_the_notice(tmp_path):
    code = "import time; time.sleep(60)"
    proc = _wrapper(tmp_path, [sys.executable, "-c", code], localid=0, ignore=["TERM"],
                    stop_signal="INT")
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdout.readline()
    proc.stdin.write("stop 3\n")
    proc.stdin.flush()
    last = proc.stdout.readline().split()
    assert last[:3] == [MARK, "exit", "3"] and int(last[3]) in (1, -2)  # KeyboardInterrupt


def _member(tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0",
           "SLURM_CONF": str(tmp_path / "no-such-slurm.conf")}
    proc = subprocess.Popen([sys.executable, "-m", "slurm_etc.slurm.member", "--run-dir",
                             str(tmp_path), "--signal", "USR2"], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and "holding" in proc.stdout.readline()
    return proc


def _wait_file(path: Path) -> dict:
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return json.loads(path.read_text())


def test_member_notice_then_end_of_grace(tmp_path):
    proc = _member(tmp_path)
    try:
        t0 = time.time()
        proc.send_signal(signal.SIGUSR2)
        notice = _wait_file(notice_path(tmp_path, "4242", "0", "USR2"))
        assert notice["job"] == "4242" and notice["signal"] == "USR2"
        assert t0 - 1 < notice["time"] < time.time()
        time.sleep(0.7)
        assert proc.poll() is None  # a notice does not end the allocation
        # SIGTERM after the notice: the grace is over; it exits.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert notice_path(tmp_path, "4242", "0", "TERM").exists()
    finally:
        proc.kill()
        proc.wait()


def test_member_term_is_a_notice_too(tmp_path):
    # Sites without preempt_send_user_signal: SIGTERM starts the grace. Slurm cannot be asked
    # here (whether it is a cancel), so it stays: the grace is the safe guess.
    proc = _member(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        assert _wait_file(notice_path(tmp_path, "4242", "0", "TERM"))["signal"] == "TERM"
        time.sleep(1.0)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_member_cancel_is_asked_again_until_slurm_answers(tmp_path):
    """A SIGTERM with no notice before it: Slurm is asked why until it can say. Here its
    first two answers fail (slurmctld busy); the third says CANCELLED and the member exits,
    instead of holding its nodes to KillWait."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        f"echo x >> {calls}\n"
        f"if [ $(wc -l < {calls}) -le 2 ]; then echo 'Socket timed out on send/recv' >&2; "
        "exit 1; fi\n"
        "echo 'JobId=4242 JobName=etc-1-member JobState=CANCELLED Reason=None NumNodes=1'\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = {**os.environ, "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "slurm_etc.slurm.member", "--run-dir",
                             str(tmp_path), "--signal", "USR2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "holding" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert "cancelled; exiting" in proc.stdout.read()
        assert calls.read_text().count("x") == 3
    finally:
        proc.kill()
        proc.wait()

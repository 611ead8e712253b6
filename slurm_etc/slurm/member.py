"""The batch script of a member allocation: ``python -m slurm_etc.slurm.member``.

A member allocation only lends its nodes to the job: the coordinator (in the anchor job)
launches workers into it with ``srun --jobid``. Its batch shell (this process, ``exec``'d by
the script the backend submits) does nothing but wait and pass Slurm's preemption notice on
to the coordinator, at once:

- the notice signal (``--signal=B:USR2@<lead>``, the default; configurable) or SIGTERM
  (sites without ``preempt_send_user_signal`` send only SIGTERM when the grace starts)
  writes ``<run-dir>/notices/<job>.<restart>.<SIGNAL>.json`` (atomically: temporary file,
  then rename), with the job, the signal and the time; the coordinator's backend polls that
  directory. A shared filesystem directory works wherever the coordinator runs (the anchor's
  batch host is another node than the member's) and needs no open port;
- when it starts it writes ``<job>.<restart>.START.json`` there: the backend asks Slurm
  about the grant at once, instead of polling a pending member often;
- every 30 s it asks Slurm whether the anchor job still runs (``scontrol show job``: two
  RPCs), and ends when it does not: a
  coordinator killed before it could cancel its members leaves no allocation behind;
- a SIGTERM after the notice is the end of the grace: it exits (the node is freed at once,
  not KillWait later). A SIGTERM with no notice before it: it asks Slurm (every second until
  Slurm can say) whether the job is being cancelled (the coordinator released it, or a user
  ran scancel) and then exits; a job being preempted keeps its batch shell
  alive to the end of the grace, since the allocation (and the workers in it) ends when the
  batch shell ends.

Python handlers, not a bash trap: a bash trap can miss a USR2 arriving together with
SIGCONT (NOTES).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

NOTICES = "notices"
# The "signal" name of the file a member writes when its batch shell starts (not a signal).
STARTED = "START"
# How long an unexplained SIGTERM (Slurm neither shows a cancel nor a preemption) is asked about.
UNEXPLAINED_TERM_S = 60.0


def notice_path(run_dir: Path, job_id: str, restart: str, signame: str) -> Path:
    return run_dir / NOTICES / f"{job_id}.{restart}.{signame}.json"


def write_notice(run_dir: Path, job_id: str, restart: str, signame: str,
                 when: float) -> Path:
    """Writes one notice file atomically; returns its path."""
    path = notice_path(run_dir, job_id, restart, signame)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"job": job_id, "restart": restart, "signal": signame,
                               "time": when, "host": os.uname().nodename}))
    tmp.replace(path)
    return path


def why_terminated(job_id: str, timeout: float = 5.0) -> str | None:
    """Why Slurm sent this job SIGTERM: ``"cancelled"`` (cancelled, ending or forgotten without
    a preemption), ``"preempted"`` (the grace started), or None while it cannot tell (Slurm
    cannot be asked, or still shows the job running): ask again."""
    from .client import CliSlurmClient
    from .model import SlurmError, SlurmJobState
    from .runner import SlurmRunner

    try:
        job = CliSlurmClient(SlurmRunner(timeout=timeout)).job(job_id)
    except SlurmError as e:
        print(f"slurm-etc member: cannot ask Slurm about job {job_id}: {e}", file=sys.stderr,
              flush=True)
        return None
    if job is None:
        return "cancelled"
    if job.preempt_time is not None:
        return "preempted"
    if job.state in (SlurmJobState.CANCELLED, SlurmJobState.ENDING) or job.state.finished:
        return "cancelled"
    return None


def anchor_gone(anchor: str, timeout: float = 10.0) -> bool:
    """True when Slurm says the anchor job ended (or forgot it); False while it runs or when
    Slurm cannot be asked."""
    from .client import CliSlurmClient
    from .model import SlurmError
    from .runner import SlurmRunner

    try:
        # scontrol show job: two RPCs where squeue of one job costs three
        job = CliSlurmClient(SlurmRunner(timeout=timeout)).job(anchor)
    except SlurmError:
        return False
    return job is None or job.state.finished


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm_etc.slurm.member",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, type=Path,
                    help="the job's shared run directory (notices/ goes there)")
    ap.add_argument("--signal", default="USR2", help="the preemption signal (default USR2)")
    ap.add_argument("--anchor", help="the anchor's job id: the member ends when it ends")
    ap.add_argument("--anchor-check-s", type=float, default=30.0,
                    help="how often to ask Slurm whether the anchor still runs")
    args = ap.parse_args(argv)
    job_id = os.environ.get("SLURM_JOB_ID", "unknown")
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    notice_sig = signal.Signals["SIG" + args.signal.upper().removeprefix("SIG")]
    got: list[signal.Signals] = []

    def on_signal(signum: int, frame: object) -> None:
        sig = signal.Signals(signum)
        got.append(sig)
        write_notice(args.run_dir, job_id, restart, sig.name.removeprefix("SIG"),
                     time.time())

    signal.signal(notice_sig, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    write_notice(args.run_dir, job_id, restart, STARTED, time.time())
    print(f"slurm-etc member {job_id}: holding {os.environ.get('SLURM_JOB_NODELIST', '?')} "
          f"for the coordinator; notices go to {args.run_dir / NOTICES}", flush=True)
    next_check = time.monotonic() + args.anchor_check_s
    unexplained: float | None = None  # when a SIGTERM came that Slurm has not explained yet
    next_ask = 0.0
    while True:
        time.sleep(0.5)
        now = time.monotonic()
        if args.anchor and now >= next_check:
            next_check = now + args.anchor_check_s
            if anchor_gone(args.anchor):
                print(f"slurm-etc member {job_id}: anchor job {args.anchor} ended; exiting",
                      flush=True)
                return 0
        if signal.SIGTERM in got:
            noticed_before = notice_sig != signal.SIGTERM and notice_sig in got
            got[:] = [sig for sig in got if sig != signal.SIGTERM]
            if noticed_before:
                # The notice came first: this SIGTERM is the end of the grace. Nothing is
                # left to protect; ending now frees the node KillWait sooner.
                print(f"slurm-etc member {job_id}: grace over; exiting", flush=True)
                return 0
            unexplained, next_ask = now, now
        if unexplained is not None and now >= next_ask:
            # Asked until Slurm says why: one failed or early answer must not keep a
            # cancelled member (and its nodes) to KillWait.
            why = why_terminated(job_id)
            if why == "cancelled":
                print(f"slurm-etc member {job_id}: cancelled; exiting", flush=True)
                return 0
            if why == "preempted" or now - unexplained > UNEXPLAINED_TERM_S:
                unexplained = None
            next_ask = now + 1.0

if __name__ == "__main__":
    sys.exit(main())

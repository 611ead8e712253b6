"""Slurm RPCs per minute that one elastic job's Slurm backend costs slurmctld: steady, and
during a resize (a member request pending, then granted).

The backend is the real :class:`~slurm_etc.slurm.backend.SlurmBackend` on a real cluster
(``scripts/slurm-local.sh up``; SLURM_CONF set); no workers: what is counted is the backend's
own traffic. Its anchor is a ``sleep`` job on n1 in ``main``; every other node is held by a
blocker job in ``main`` (which a ``scavenge`` member cannot preempt), so that the member
request pends until the bench cancels one blocker. The bench polls the backend as the
coordinator's loop does (every ``--tick-s``) and, like the coordinator, asks it for the
partition's usable nodes every ``PARTITION_REREAD_S`` and after a grant.

slurmctld's own counters (``sdiag``; ``sdiag -r`` resets them: root or SlurmUser) are read
after each phase. Counted as the job's: every RPC type except ``sdiag``'s own
(REQUEST_STATS_INFO), the bench's cancel of a blocker and the slurmd daemons' messages
(``OUTSIDE``); ``queries``: the read-only types (job, node, partition, federation info).

    PYTHONPATH=$PWD .venv/bin/python bench/slurm_rpc_rate.py [--steady-s 60] [--pending-s 20]
        [--json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slurm_etc.coordinator.backend import Grant, RequestNodes
from slurm_etc.coordinator.deciding import PARTITION_REREAD_S
from slurm_etc.slurm import BatchSpec, CliSlurmClient, SlurmJobState, SlurmRunner
from slurm_etc.slurm.backend import SlurmBackend

# RPC types that are not the job's: sdiag itself, the bench's cancel of a blocker, and what
# slurmd and slurmstepd send on their own (registration, a batch script's or step's end).
OUTSIDE = ("REQUEST_STATS_INFO", "REQUEST_KILL_JOB", "REQUEST_CANCEL_JOB_STEP",
           "MESSAGE_NODE_REGISTRATION_STATUS", "MESSAGE_EPILOG_COMPLETE",
           "REQUEST_COMPLETE_BATCH_SCRIPT", "REQUEST_COMPLETE_PROLOG", "REQUEST_STEP_COMPLETE",
           "REQUEST_STEP_COMPLETE_AGGR", "REQUEST_PING", "REQUEST_NODE_REGISTRATION_STATUS")
QUERIES = ("REQUEST_JOB_INFO", "REQUEST_JOB_INFO_SINGLE", "REQUEST_JOB_USER_INFO",
           "REQUEST_NODE_INFO", "REQUEST_NODE_INFO_SINGLE", "REQUEST_PARTITION_INFO",
           "REQUEST_FED_INFO")
_ROW = re.compile(r"^\s*([A-Z_]+)\s+\(\s*\d+\)\s+count:(\d+)")


def sdiag_reset() -> None:
    subprocess.run(["sdiag", "--reset"], check=True, capture_output=True, timeout=30)


def sdiag_by_type() -> dict[str, int]:
    """slurmctld's RPC counts by message type since the last reset."""
    out = subprocess.run(["sdiag"], check=True, capture_output=True, text=True,
                         timeout=30).stdout
    counts: dict[str, int] = {}
    section = False
    for line in out.splitlines():
        if line.startswith("Remote Procedure Call statistics by message type"):
            section = True
            continue
        if section:
            m = _ROW.match(line)
            if not m:
                if line.strip():
                    break  # the next section
                continue
            counts[m.group(1)] = int(m.group(2))
    return counts


def summary(counts: dict[str, int], seconds: float) -> dict:
    job = {k: v for k, v in sorted(counts.items()) if k not in OUTSIDE}
    queries = sum(v for k, v in job.items() if k in QUERIES)
    return {"seconds": round(seconds, 1), "by_type": job,
            "outside": {k: v for k, v in sorted(counts.items()) if k in OUTSIDE},
            "rpcs": sum(job.values()), "queries": queries,
            "rpcs_per_min": round(sum(job.values()) * 60.0 / seconds, 1),
            "queries_per_min": round(queries * 60.0 / seconds, 1)}


def wait_running(client: CliSlurmClient, job_id: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = client.jobs([job_id])
        if found and found[0].state is SlurmJobState.RUNNING:
            return
        time.sleep(0.2)
    raise SystemExit(f"job {job_id} did not start within {timeout:g} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steady-s", type=float, default=60.0, help="steady phase length")
    p.add_argument("--pending-s", type=float, default=20.0,
                   help="how long the member request pends before a node is freed")
    p.add_argument("--tick-s", type=float, default=0.1, help="the loop's poll period")
    p.add_argument("--json", action="store_true")
    p.add_argument("-v", action="store_true", help="log the backend")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO if args.v else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not os.environ.get("SLURM_CONF"):
        print("set SLURM_CONF to the local cluster's (scripts/slurm-local.sh env)",
              file=sys.stderr)
        return 2
    client = CliSlurmClient(SlurmRunner(timeout=30))
    nodes = [n.name for n in client.nodes()]
    if len(nodes) < 2:
        print(f"need at least 2 nodes, the cluster has {nodes}", file=sys.stderr)
        return 2
    anchor_node, others = nodes[0], nodes[1:]
    submitted: list[str] = []
    backend: SlurmBackend | None = None
    with tempfile.TemporaryDirectory(prefix="etc-rpc-rate-") as tmp:
        try:
            anchor = client.submit(BatchSpec(
                script="#!/bin/sh\nsleep 3600\n", name="rpc-rate-anchor", partition="main",
                nodes=1, gpus_per_node=2, exclusive=True, nodelist=(anchor_node,),
                output=f"{tmp}/anchor-%j.out"))
            submitted.append(anchor)
            blockers = {}
            for node in others:
                blockers[node] = client.submit(BatchSpec(
                    script="#!/bin/sh\nsleep 3600\n", name="rpc-rate-blocker",
                    partition="main", nodes=1, exclusive=True, nodelist=(node,),
                    output=f"{tmp}/blocker-%j.out"))
                submitted.append(blockers[node])
            for job_id in submitted:
                wait_running(client, job_id)
            backend = SlurmBackend(Path(tmp) / "run", anchor_job=anchor,
                                   log_dir=Path(tmp) / "logs")
            backend.poll()  # the anchor's grant
            backend.usable_nodes()  # the coordinator's first count (and the topology)
            settings = {k: getattr(backend, k) for k in ("poll_interval_s", "steady_poll_s")
                        if hasattr(backend, k)}

            def run(seconds: float | None, until_grant: bool = False) -> float:
                t0 = time.monotonic()
                reread = t0 + PARTITION_REREAD_S
                while True:
                    now = time.monotonic()
                    if seconds is not None and now >= t0 + seconds:
                        return now - t0
                    events = backend.poll()
                    if now >= reread:
                        reread = now + PARTITION_REREAD_S
                        backend.usable_nodes()
                    if until_grant and any(isinstance(e, Grant) and e.request for e in events):
                        backend.usable_nodes()  # the coordinator decides on the grant
                        return time.monotonic() - t0
                    time.sleep(args.tick_s)

            sdiag_reset()
            took = run(args.steady_s)
            steady = summary(sdiag_by_type(), took)

            sdiag_reset()
            t0 = time.monotonic()
            backend.request(RequestNodes(1, "grow-1", "bench"))
            run(args.pending_s)
            client.cancel(blockers[others[0]])
            grant_s = run(None, until_grant=True)
            resize = summary(sdiag_by_type(), time.monotonic() - t0)
            # from the blocker's cancel (its node free) to the Grant event
            resize["grant_after_free_s"] = round(grant_s, 2)
        finally:
            if backend is not None:
                backend.close()
            for job_id in submitted:
                subprocess.run(["scancel", job_id], capture_output=True)
    version = subprocess.run(["sinfo", "--version"], capture_output=True,
                             text=True).stdout.strip()
    result = {"slurm": version, "backend": settings, "steady": steady, "resize": resize}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{version}; backend {settings}")
    for name, phase in (("steady", steady), ("resize (request pending -> grant)", resize)):
        print(f"{name}: {phase['seconds']:.0f} s, {phase['rpcs']} RPCs = "
              f"{phase['rpcs_per_min']:.1f}/min ({phase['queries_per_min']:.1f}/min queries)")
        if "grant_after_free_s" in phase:
            print(f"    grant seen {phase['grant_after_free_s']:.2f} s after a node was freed")
        for k, v in phase["by_type"].items():
            print(f"    {k:<28} {v:>5}  {v * 60.0 / phase['seconds']:7.1f}/min")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Policies slurmctld enforces (`slurm-etc policy apply|check`) on the local cluster.

A coordinator that ignores the policy (a backend built without one) asks for members past
the partition's max_nodes: Slurm holds them PENDING with the QOS's reason while a node is
free; a plain sbatch past the account's max_nodes is held by the association limit, with nodes free.
Everything is taken off again at the end (other tests share the cluster).
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from slurm_etc.coordinator.backend import RequestNodes
from slurm_etc.slurm import BatchSpec, NodeState, SlurmJobState

from .test_backend import backend_for
from .test_client import partition, running, wait_for, wait_free

CLI = str(Path(sys.executable).parent / "slurm-etc")
QOS = "slurm-etc-partition-scavenge"


def policy(db: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, "policy", "--db", str(db), *args], capture_output=True,
                          text=True, timeout=120)


def findings(db: Path) -> tuple[int, dict[tuple[str, str], dict]]:
    res = policy(db, "check", "--json")
    out = json.loads(res.stdout)
    return res.returncode, {(f["scope"], f["field"]): f for f in out["findings"]}


def pending_reason(client, job_id: str) -> str | None:
    (job,) = client.jobs([job_id])
    return job.reason if job.state is SlurmJobState.PENDING else None


def test_slurm_holds_members_past_the_policy(client, jobs, anchor, tmp_path, caplog):
    db = tmp_path / "policies.db"
    wait_free(client, ["n2", "n3", "n4"])
    try:
        assert policy(db, "set", "--partition", "scavenge", "max_nodes=2",
                      "max_resizes_per_hour=6").returncode == 0
        assert policy(db, "set", "--account", "slurmetc", "max_nodes=1").returncode == 0
        code, before = findings(db)
        assert code == 1 and before[("partition:scavenge", "max_nodes")]["state"] == "drift"

        dry = policy(db, "apply", "--dry-run")
        assert dry.returncode == 0 and "would run: sacctmgr -i add qos " + QOS in dry.stdout
        assert partition("scavenge").get("QoS") in (None, "N/A")  # a dry run changes nothing

        applied = policy(db, "apply")
        assert applied.returncode == 0, applied.stderr
        assert partition("scavenge")["QoS"] == QOS
        code, after = findings(db)
        assert code == 0, after
        assert after[("partition:scavenge", "max_nodes")]["state"] == "enforced"
        assert after[("partition:scavenge", "max_nodes")]["slurm"] == "2 nodes"
        assert after[("account:slurmetc", "max_nodes")]["state"] == "enforced"
        assert after[("partition:scavenge", "max_resizes_per_hour")]["state"] == \
            "coordinator only"
        again = policy(db, "apply")
        assert "nothing to change" in again.stdout, again.stdout  # idempotent

        # A coordinator that ignores the policy: members past max_nodes in scavenge.
        backend = backend_for(anchor, tmp_path)
        try:
            for key in ("m1", "m2", "m3"):
                backend.request(RequestNodes(1, key))
                jobs.append(backend.members[key])
            for key in ("m1", "m2"):
                wait_for(running(client, backend.members[key]), f"{key} RUNNING")
            # n4 is free, yet Slurm holds the third member for the QOS's per-user limit
            held = wait_for(lambda: pending_reason(client, backend.members["m3"]),
                            "m3 held", 15)
            assert held == "QOSMaxNodePerUserLimit", held
            # the coordinator's backend says why Slurm holds it, in one line

            def seen() -> str | None:
                backend.poll()
                return backend.pending_reasons.get("m3")
            with caplog.at_level(logging.INFO, logger="slurm_etc.slurm.backend"):
                assert wait_for(seen, "the backend sees m3 held", 20) == held
            assert "member request m3 pending: QOSMaxNodePerUserLimit (held by Slurm: QOS " \
                   "limit)" in caplog.text, caplog.text
            idle = [n.name for n in client.nodes() if n.state is NodeState.IDLE]
            assert idle, "a node must be free for the hold to be Slurm's limit"
        finally:
            members = list(backend.members.values())
            backend.close()
        for job in members:
            subprocess.run(["scancel", job], capture_output=True)
        wait_free(client, ["n2", "n3", "n4"])
        # the account's limit (root's jobs run in account root: these name slurmetc)
        extras = [client.submit(BatchSpec(script="#!/bin/sh\nsleep 60\n", name="extra",
                                          partition="main", nodes=1, exclusive=True,
                                          account="slurmetc",
                                          output=str(tmp_path / "extra-%j.out")))
                  for _ in range(2)]
        jobs.extend(extras)
        wait_for(lambda: any(running(client, j)() for j in extras), "an extra RUNNING")
        held = wait_for(lambda: [r for j in extras if (r := pending_reason(client, j))],
                        "an extra held", 15)
        assert held == ["AssocGrpNodeLimit"], held
    finally:
        for job in jobs:
            subprocess.run(["scancel", job], capture_output=True)
        policy(db, "unset", "--partition", "scavenge")
        policy(db, "unset", "--account", "slurmetc")
        off = policy(db, "apply")
        cleared = policy(db, "apply", "--account", "slurmetc")
    assert off.returncode == 0 and cleared.returncode == 0, (off.stderr, cleared.stderr)
    assert partition("scavenge").get("QoS") in (None, "N/A")
    qos = subprocess.run(["sacctmgr", "-n", "-P", "show", "qos", "format=name"],
                         capture_output=True, text=True).stdout.split()
    assert QOS not in qos
    assoc = subprocess.run(["sacctmgr", "-n", "-P", "show", "assoc", "where",
                            "account=slurmetc", "format=user,grptres,maxtres"],
                           capture_output=True, text=True).stdout
    assert "node=" not in assoc, assoc

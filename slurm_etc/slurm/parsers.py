"""Pure parsers of Slurm's output (formats chosen in :mod:`.commands`); tested on real output
kept under tests/fixtures/slurm/."""
from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime

from .commands import SEP, SINFO_FIELDS, SQUEUE_FIELDS
from .model import JobInfo, NodeInfo, PartitionInfo, job_state, node_state

_NONE = {"", "none", "(null)", "n/a", "unknown", "none assigned"}


def _opt(value: str) -> str | None:
    value = value.strip()
    return None if value.lower() in _NONE else value


def _time(value: str) -> datetime | None:
    value = value.strip()
    if value.lower() in _NONE:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _int(value: str, default: int = 0) -> int:
    value = value.strip()
    return int(value) if value.isdigit() else default


def parse_sbatch(stdout: str) -> str:
    """The job id from ``sbatch --parsable`` (``12`` or ``12;cluster``)."""
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    job_id = line.split(";", 1)[0].strip()
    if not job_id or not job_id.replace("_", "").isdigit():
        raise ValueError(f"sbatch --parsable printed no job id: {stdout!r}")
    return job_id


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """Slurm's compressed host list to names: ``n[1-3,5],gpu-a[01-02]`` ->
    ``('n1', 'n2', 'n3', 'n5', 'gpu-a01', 'gpu-a02')``; zero padding is kept; several
    bracket groups in one name expand as a product."""
    nodelist = nodelist.strip()
    if not nodelist or nodelist.lower() in _NONE:
        return ()
    names: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodelist + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if i > start:
                names.extend(_expand_one(nodelist[start:i]))
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced brackets in node list {nodelist!r}")
    return tuple(names)


def _expand_one(pattern: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end():]
    out = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not hi:
            values = [lo]
        else:
            width = len(lo)
            values = [str(v).zfill(width) for v in range(int(lo), int(hi) + 1)]
        for v in values:
            out.extend(_expand_one(head + v + tail))
    return out


def _split(line: str, nfields: int) -> list[str]:
    """Fields of one -O line: every field ends with SEP; the last one may contain SEP."""
    if line.endswith(SEP):
        line = line[: -len(SEP)]
    parts = line.split(SEP, nfields - 1)
    if len(parts) != nfields:
        raise ValueError(f"expected {nfields} '{SEP}'-separated fields, got {len(parts)}: "
                         f"{line!r}")
    return parts


def parse_squeue(stdout: str) -> list[JobInfo]:
    """Jobs from :func:`.commands.squeue` output."""
    jobs = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        f = dict(zip(SQUEUE_FIELDS, _split(line, len(SQUEUE_FIELDS))))
        nodelist = (_opt(f["NodeList"]) or "")
        raw = f["State"].strip()
        jobs.append(JobInfo(
            job_id=f["JobID"].strip(),
            state=job_state(raw),
            slurm_state=raw,
            name=f["Name"],
            partition=f["Partition"].strip(),
            num_nodes=_int(f["NumNodes"]),
            nodelist=nodelist,
            nodes=expand_nodelist(nodelist),
            reason=_opt(f["Reason"]),
            batch_host=_opt(f["BatchHost"]),
            preempt_time=_time(f["PreemptTime"]),
            user=f["UserName"].strip(),
            fields=f,
        ))
    return jobs


# A key=value record of `scontrol show -o`: keys are words (with / : . allowed, e.g.
# "AllocNode:Sid", "CPUs/Task", "ReqB:S:C:T"); values run to the next " key=".
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:.]*)=")


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One ``scontrol show -o`` line as a dict (values may contain spaces)."""
    matches = list(_KEY.finditer(line))
    record = {}
    for m, nxt in zip(matches, matches[1:] + [None]):
        end = nxt.start() if nxt is not None else len(line)
        record[m.group(1)] = line[m.end():end].strip()
    return record


def parse_scontrol_jobs(stdout: str) -> list[JobInfo]:
    """Jobs from ``scontrol -o show job [id]`` (``No jobs in the system`` -> [])."""
    jobs = []
    for line in stdout.splitlines():
        if "JobId=" not in line:
            continue
        jobs.append(job_from_record(parse_scontrol_record(line)))
    return jobs


def job_from_record(r: Mapping[str, str]) -> JobInfo:
    nodelist = _opt(r.get("NodeList", "")) or ""
    raw = r.get("JobState", "")
    user = r.get("UserId", "").split("(", 1)[0]
    return JobInfo(
        job_id=r["JobId"],
        state=job_state(raw),
        slurm_state=raw,
        name=r.get("JobName", ""),
        partition=r.get("Partition", ""),
        num_nodes=_int(r.get("NumNodes", "").split("-", 1)[0]),
        nodelist=nodelist,
        nodes=expand_nodelist(nodelist),
        reason=_opt(r.get("Reason", "")),
        batch_host=_opt(r.get("BatchHost", "")),
        preempt_time=_time(r.get("PreemptTime", "")),
        restarts=_int(r.get("Restarts", ""), default=0) if "Restarts" in r else None,
        user=user,
        fields=dict(r),
    )


def parse_scontrol_partition(stdout: str) -> PartitionInfo | None:
    """The partition from ``scontrol -o show partition NAME`` (None when the output has
    none)."""
    for line in stdout.splitlines():
        if "PartitionName=" in line:
            r = parse_scontrol_record(line)
            max_nodes = r.get("MaxNodes", "").strip()
            return PartitionInfo(
                name=r["PartitionName"],
                grace_time=_int(r.get("GraceTime", "")),
                preempt_mode=r.get("PreemptMode", ""),
                priority_tier=_int(r.get("PriorityTier", "")),
                max_nodes=int(max_nodes) if max_nodes.isdigit() else None,
                fields=r,
            )
    return None


def gpus_per_node_of_job(job: JobInfo) -> int | None:
    """GPUs the job holds on each node, from its ``TresPerNode`` (``gres:gpu:2`` on 22.05,
    ``gres/gpu:2`` later) or, failing that, its ``TRES`` total over its nodes; None when
    neither says (the job asked for no GPUs, or the record is from squeue)."""
    per_node = job.fields.get("TresPerNode", "")
    for part in per_node.split(","):
        m = re.fullmatch(r"gres[:/]gpu(?::[^:]+)?:(\d+)", part.strip())
        if m:
            return int(m.group(1))
    m = re.search(r"(?:^|,)gres/gpu=(\d+)", job.fields.get("TRES", ""))
    if m and job.num_nodes:
        return int(m.group(1)) // job.num_nodes
    return None


_GPU = re.compile(r"(?:^|,)gpu(?::[^:(,]+)?:(\d+)")


def count_gpus(gres: str) -> int:
    """GPUs in a GRES string: ``gpu:2``, ``gpu:a100:4(S:0-1)``, ``gpu:2(IDX:0-1),mps:100``."""
    return sum(int(n) for n in _GPU.findall(gres.strip()))


def parse_sinfo_nodes(stdout: str) -> list[NodeInfo]:
    """Nodes from :func:`.commands.sinfo_nodes` output, one per node (partitions merged),
    in sinfo's order."""
    rows: dict[str, dict] = {}
    for line in stdout.splitlines():
        if not line.strip():
            continue
        f = dict(zip(SINFO_FIELDS, _split(line, len(SINFO_FIELDS))))
        for name in expand_nodelist(f["NodeList"]):
            row = rows.setdefault(name, {"f": f, "partitions": []})
            part = f["Partition"].strip().rstrip("*")
            if part and part not in row["partitions"]:
                row["partitions"].append(part)
    nodes = []
    for name, row in rows.items():
        f = row["f"]
        raw = f["StateLong"].strip()
        state, responding = node_state(raw)
        gres = _opt(f["Gres"]) or ""
        nodes.append(NodeInfo(
            name=name,
            state=state,
            slurm_state=raw,
            responding=responding,
            cpus=_int(f["CPUs"]),
            gres=gres,
            gpus=count_gpus(gres),
            gpus_used=count_gpus(_opt(f["GresUsed"]) or ""),
            partitions=tuple(row["partitions"]),
            reason=_opt(f["Reason"]),
        ))
    return nodes


_INVALID_JOB = "invalid job id"


def is_unknown_job(stderr: str) -> bool:
    """Slurm's answer for a job id it does not know (never existed, or aged out)."""
    return _INVALID_JOB in stderr.lower()


# What Slurm's clients print when slurmctld is busy or out of reach: its rate limit
# (``rl_enable``, 23.02+: "Rate limit exceeded, please retry momentarily"; the client itself
# sleeps and retries, so a rate-limited command mostly ends by our timeout instead), EAGAIN,
# socket timeouts, a controller that does not answer.
_BUSY = ("rate limit", "resource temporarily unavailable", "socket timed out",
         "unable to contact slurm controller", "connection refused",
         "transport endpoint is not connected", "slurmctld is not responding",
         "please retry")


def is_busy(output: str) -> bool:
    """Slurm's answer (a command's stderr/stdout) says slurmctld is busy or unreachable: ask
    again later, less often."""
    low = output.lower()
    return any(s in low for s in _BUSY)

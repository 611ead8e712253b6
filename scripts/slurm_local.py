#!/usr/bin/env python3
"""A real Slurm cluster on this one machine, for development and the tests/slurm tier.

Called by scripts/slurm-local.sh (which installs the Debian packages first); standard library
only, so it runs with the system Python and does not import slurm_etc.

Everything lives in one directory of its own (default /tmp/slurm-etc-cluster, or
$SLURM_ETC_CLUSTER_DIR): configuration, munge key, fake GPU device files, MariaDB datadir,
state, logs. Nothing is written to /etc.

Daemons run in the foreground (-D) as children of one supervisor started in a new session.
The supervisor is a child subreaper: slurmstepd and job processes that Slurm detaches are
re-parented to it (PID 1 on these machines does not reap orphans), it reaps them, and on
`down` it stops its daemons by PID in reverse start order, then kills the processes it
adopted. Nothing is found or stopped by name.

Layout of the directory:
    etc/     slurm.conf gres.conf slurmdbd.conf (0600) plugstack.conf dbpass
    munge/   munge.key, seed        run/munge/ socket (0755)
    dev/     nvidia0.. (character devices 195:i, shared by every node)
    mysql/   MariaDB datadir (kept across down/up: slurmdbd's tables are created once)
    state/   slurmctld state, slurmd spool per node
    log/     one log per daemon, supervisor.log
    run/     supervisor.pid, pids.json, status.json, params.json, plan.json
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

CLUSTER = "slurmetc"
ACCOUNT = "slurmetc"
DB_NAME = "slurm_acct_db"
DB_USER = "slurm"
PR_SET_CHILD_SUBREAPER = 36
DEFAULTS = {
    "nodes": 4,
    "gpus_per_node": 2,
    "cpus_per_node": 4,
    "memory_mb": 4096,
    "grace_time": 30,
    "kill_wait": 30,
    "port_base": 16800,
}


def log(msg: str) -> None:
    print(f"slurm-local: {msg}", file=sys.stderr, flush=True)


class Fail(Exception):
    """A failure with one clear line for the user."""


# ----------------------------------------------------------------------------------- paths
class Paths:
    def __init__(self, root: Path):
        self.root = root
        self.etc = root / "etc"
        self.conf = self.etc / "slurm.conf"
        self.gres = self.etc / "gres.conf"
        self.dbd_conf = self.etc / "slurmdbd.conf"
        self.plugstack = self.etc / "plugstack.conf"
        self.dbpass = self.etc / "dbpass"
        self.munge = root / "munge"
        self.munge_key = self.munge / "munge.key"
        self.munge_seed = self.munge / "munged.seed"
        self.dev = root / "dev"
        self.mysql = root / "mysql"
        self.state = root / "state"
        self.ctld_state = self.state / "ctld"
        self.spool = self.state / "spool"
        self.log = root / "log"
        self.run = root / "run"
        self.munge_run = self.run / "munge"
        self.munge_socket = self.munge_run / "munge.socket.2"
        self.mysql_socket = self.run / "mysqld.sock"
        self.supervisor_pid = self.run / "supervisor.pid"
        self.pids = self.run / "pids.json"
        self.status = self.run / "status.json"
        self.params = self.run / "params.json"
        self.plan = self.run / "plan.json"
        self.lock = root.parent / (root.name + ".lock")


def cluster_dir(arg: str | None) -> Path:
    raw = arg or os.environ.get("SLURM_ETC_CLUSTER_DIR") or "/tmp/slurm-etc-cluster"
    return Path(raw).absolute()


# ------------------------------------------------------------------------------ processes
def proc_state(pid: int) -> str | None:
    """The /proc state letter of pid, or None if there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2]


def alive(pid: int) -> bool:
    state = proc_state(pid)
    return state is not None and state not in ("Z", "X")


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def supervisor_pid(p: Paths) -> int | None:
    """The PID of this directory's live supervisor, checked by its command line."""
    try:
        pid = int(p.supervisor_pid.read_text())
    except (OSError, ValueError):
        return None
    args = cmdline(pid)
    if alive(pid) and "supervise" in args and str(p.root) in args:
        return pid
    return None


def tcp_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def binary(*names: str) -> str:
    for name in names:
        for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
            if os.access(f"{d}/{name}", os.X_OK):
                return f"{d}/{name}"
    raise Fail(f"none of {', '.join(names)} is installed (run scripts/slurm-local.sh up)")


def slurm_version() -> str:
    out = subprocess.run([binary("slurmctld"), "-V"], capture_output=True, text=True).stdout
    return out.split()[-1] if out.split() else "unknown"


def version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def daemon_env(p: Paths) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(p.conf)
    return env


# --------------------------------------------------------------------------------- config
def ports(params: dict) -> dict[str, int]:
    base = params["port_base"]
    return {"slurmctld": base, "slurmdbd": base + 1, "mysql": base + 2, "slurmd0": base + 10}


def node_names(params: dict) -> list[str]:
    return [f"n{i}" for i in range(1, params["nodes"] + 1)]


def write_config(p: Paths, params: dict) -> None:
    """Writes slurm.conf, gres.conf, slurmdbd.conf; creates key, devices, directories."""
    for d in (p.etc, p.munge, p.dev, p.ctld_state, p.spool, p.log, p.run):
        d.mkdir(parents=True, exist_ok=True)
    p.munge.chmod(0o700)
    p.munge_run.mkdir(exist_ok=True)
    p.munge_run.chmod(0o755)  # munged refuses a socket directory others can write to
    if not p.munge_key.exists():
        p.munge_key.write_bytes(secrets.token_bytes(1024))
    p.munge_key.chmod(0o400)
    if not p.dbpass.exists():
        p.dbpass.write_text(secrets.token_hex(16))
    p.dbpass.chmod(0o600)
    gpus = params["gpus_per_node"]
    for i in range(gpus):
        dev = p.dev / f"nvidia{i}"
        if dev.exists() and not stat.S_ISCHR(dev.stat().st_mode):
            dev.unlink()
        if not dev.exists():
            try:
                os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(195, i))
            except OSError as e:  # regular files are rejected by slurmd's GRES checks
                raise Fail(f"mknod {dev} c 195 {i} failed ({e}); fake GPUs need root") from e
    port = ports(params)
    names = node_names(params)
    host = socket.gethostname().split(".")[0]
    r = p.root
    conf = [
        f"# Written by scripts/slurm_local.py for the local cluster in {r}.",
        f"# Slurm {slurm_version()}.",
        f"ClusterName={CLUSTER}",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={port['slurmctld']}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={p.munge_socket}",
        "CredType=cred/munge",
        f"StateSaveLocation={p.ctld_state}",
        f"SlurmdSpoolDir={p.spool}/%n",
        f"SlurmctldPidFile={p.run}/slurmctld.pid",
        f"SlurmdPidFile={p.run}/slurmd-%n.pid",
        f"SlurmctldLogFile={p.log}/slurmctld.log",
        f"SlurmdLogFile={p.log}/slurmd-%n.log",
        f"PlugStackConfig={p.plugstack}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        # Nodes declare more CPUs and memory than the machine has.
        "SlurmdParameters=config_overrides",
        "SchedulerType=sched/backfill",
        # Start batch jobs at once (0.2-0.8 s instead of up to 3 s).
        "SchedulerParameters=batch_sched_delay=0",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        # Send the job's --signal at preemption, not only at its time limit.
        "SlurmctldParameters=preempt_send_user_signal",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=127.0.0.1",
        f"AccountingStoragePort={port['slurmdbd']}",
        # Connections to slurmdbd take their munge socket from here, not from AuthInfo.
        f"AccountingStoragePass={p.munge_socket}",
        # limits,qos: slurmctld enforces association and QOS limits (`slurm-etc policy apply`).
        "AccountingStorageEnforce=associations,limits,qos",
        "AccountingStorageTRES=gres/gpu",
        "JobCompType=jobcomp/none",
        # 1: a node DOWN for not responding returns when its slurmd registers; one set DOWN
        # by an administrator (or a fault-injecting test) stays DOWN until RESUME.
        "ReturnToService=1",
        "SlurmdTimeout=30",
        f"KillWait={params['kill_wait']}",
        "MailProg=/bin/true",
    ]
    for i, name in enumerate(names):
        gres = f" Gres=gpu:{gpus}" if gpus else ""
        conf.append(
            f"NodeName={name} NodeAddr=127.0.0.1 Port={port['slurmd0'] + i + 1}"
            f" CPUs={params['cpus_per_node']} RealMemory={params['memory_mb']}{gres} State=UNKNOWN"
        )
    conf += [
        # Anchors: never preempted.
        "PartitionName=main Nodes=ALL Default=YES PriorityTier=5 PreemptMode=OFF"
        " MaxTime=INFINITE State=UP",
        # Members: preempted by `high`, requeued after GraceTime.
        f"PartitionName=scavenge Nodes=ALL PriorityTier=1 PreemptMode=REQUEUE"
        f" GraceTime={params['grace_time']} MaxTime=INFINITE State=UP",
        "PartitionName=high Nodes=ALL PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP",
    ]
    p.conf.write_text("\n".join(conf) + "\n")
    gres_lines = ["AutoDetect=off"]
    if gpus:
        files = f"{p.dev}/nvidia0" if gpus == 1 else f"{p.dev}/nvidia[0-{gpus - 1}]"
        gres_lines.append(f"NodeName={names[0] if len(names) == 1 else f'n[1-{len(names)}]'}"
                          f" Name=gpu File={files}")
    p.gres.write_text("\n".join(gres_lines) + "\n")
    p.plugstack.write_text("")
    cgroup = p.etc / "cgroup.conf"
    if version_tuple(slurm_version()) >= (24, 5):
        # proctrack/linuxproc + task/none need no cgroups, but slurmd 24.x initialises its
        # cgroup plugin anyway, which fails in containers; "disabled" exists from 24.05 on
        # (22.05 rejects it).
        cgroup.write_text("CgroupPlugin=disabled\n")
    else:
        cgroup.unlink(missing_ok=True)
    p.dbd_conf.write_text("\n".join([
        "AuthType=auth/munge",
        f"AuthInfo=socket={p.munge_socket}",
        "DbdHost=localhost",
        "DbdAddr=127.0.0.1",
        f"DbdPort={port['slurmdbd']}",
        "SlurmUser=root",
        f"PidFile={p.run}/slurmdbd.pid",
        f"LogFile={p.log}/slurmdbd.log",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={port['mysql']}",
        f"StorageUser={DB_USER}",
        f"StoragePass={p.dbpass.read_text().strip()}",
        f"StorageLoc={DB_NAME}",
    ]) + "\n")
    p.dbd_conf.chmod(0o600)


def init_mysql(p: Paths) -> None:
    if (p.mysql / "mysql").is_dir():
        return
    if p.mysql.exists():
        shutil.rmtree(p.mysql)
    log("initialising MariaDB datadir (first start only)")
    cmd = [binary("mariadb-install-db", "mysql_install_db"), "--no-defaults",
           f"--datadir={p.mysql}", "--user=root", "--auth-root-authentication-method=socket",
           "--skip-test-db"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise Fail(f"{' '.join(cmd)} failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


def build_plan(p: Paths, params: dict) -> list[dict]:
    """The supervisor's start sequence: daemons (with a readiness check) and one-shot steps."""
    port = ports(params)
    slurm = lambda name: binary(name)  # noqa: E731  argv[0] must be slurmctld/slurmd, not *-wlm
    pw = p.dbpass.read_text().strip()
    mysql_client = binary("mariadb", "mysql")
    sql = (
        f"CREATE DATABASE IF NOT EXISTS {DB_NAME}; "
        f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{pw}'; "
        f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'127.0.0.1'; FLUSH PRIVILEGES;"
    )
    users = ["root"]
    sudo_user = os.environ.get("SUDO_USER")
    if sudo_user and sudo_user != "root":
        users.append(sudo_user)
    sacctmgr = binary("sacctmgr")
    register = (
        f"set -e; S={sacctmgr}; "
        f"$S -n -P show cluster format=cluster | grep -qx {CLUSTER} || "
        f"$S -i add cluster {CLUSTER}; "
        f"$S -n -P show account format=account | grep -qx {ACCOUNT} || "
        f"$S -i add account {ACCOUNT} Cluster={CLUSTER} Description=slurm-etc "
        "Organization=slurm-etc; "
    )
    for user in users:
        register += (
            f"$S -n -P show assoc where cluster={CLUSTER} account={ACCOUNT} user={user} "
            f"format=user | grep -qx {user} || "
            f"$S -i add user {user} Account={ACCOUNT} Cluster={CLUSTER}; "
        )
    plan = [
        {"name": "munged", "kind": "daemon", "ready": {"file": str(p.munge_socket)},
         "argv": [binary("munged"), "--foreground", "--force", f"--key-file={p.munge_key}",
                  f"--socket={p.munge_socket}", f"--pid-file={p.run}/munged.pid",
                  f"--log-file={p.log}/munged.log", f"--seed-file={p.munge_seed}"]},
        {"name": "mariadb", "kind": "daemon",
         "ready": {"file": str(p.mysql_socket), "tcp": port["mysql"]},
         "argv": [binary("mariadbd", "mysqld"), "--no-defaults", f"--datadir={p.mysql}",
                  f"--socket={p.mysql_socket}", f"--port={port['mysql']}",
                  "--bind-address=127.0.0.1", "--user=root", f"--pid-file={p.run}/mariadb.pid",
                  f"--log-error={p.log}/mariadb.log", "--skip-log-bin", "--skip-name-resolve",
                  "--innodb-buffer-pool-size=64M", "--innodb-lock-wait-timeout=900",
                  "--innodb-flush-log-at-trx-commit=2", "--max-connections=50"]},
        {"name": "database", "kind": "oneshot",
         "argv": [mysql_client, "--no-defaults", "-S", str(p.mysql_socket), "-u", "root",
                  "-e", sql]},
        {"name": "slurmdbd", "kind": "daemon", "ready": {"tcp": port["slurmdbd"]},
         "timeout": 180, "argv": [slurm("slurmdbd"), "-D"]},
        {"name": "accounting", "kind": "oneshot", "argv": sh(register)},
        {"name": "slurmctld", "kind": "daemon", "ready": {"tcp": port["slurmctld"]},
         # -c: start clean (no jobs or node states from an earlier run), -i: ignore bad state
         "argv": [slurm("slurmctld"), "-D", "-c", "-i"]},
    ]
    for name in node_names(params):
        plan.append({"name": f"slurmd-{name}", "kind": "daemon", "ready": None,
                     "argv": [slurm("slurmd"), "-D", "-N", name]})
    return plan


# ----------------------------------------------------------------------------- supervisor
class Supervisor:
    """Runs the plan, reaps every child and adopted orphan, stops all on SIGTERM."""

    def __init__(self, p: Paths):
        self.p = p
        self.daemons: dict[int, str] = {}  # pid -> name, in start order
        self.exited: dict[int, int] = {}  # pid -> wait status, for daemons
        self.env = daemon_env(p)

    def status(self, phase: str, **extra) -> None:
        write_json(self.p.status, {"phase": phase, "pid": os.getpid(), "time": time.time(),
                                   "daemons": {n: pid for pid, n in self.daemons.items()},
                                   **extra})

    def reap(self) -> None:
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.daemons:
                self.exited[pid] = st
                print(f"{time.strftime('%H:%M:%S')} {self.daemons[pid]} (pid {pid}) exited "
                      f"with status {st}", flush=True)

    def spawn(self, step: dict) -> int:
        out = open(self.p.log / f"{step['name']}.out", "ab")
        proc = subprocess.Popen(step["argv"], env=self.env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, cwd=self.p.root)
        out.close()
        self.daemons[proc.pid] = step["name"]
        write_json(self.p.pids, {n: pid for pid, n in self.daemons.items()})
        return proc.pid

    def ready(self, spec: dict | None) -> bool:
        if not spec:
            return True
        if "file" in spec and not os.path.exists(spec["file"]):
            return False
        return not ("tcp" in spec and not tcp_open(spec["tcp"]))

    def start(self, plan: list[dict], stop: list[bool]) -> None:
        for step in plan:
            if stop[0]:
                raise Fail("stopped while starting")
            self.status("starting", step=step["name"])
            t0 = time.monotonic()
            if step["kind"] == "oneshot":
                res = subprocess.run(step["argv"], env=self.env, capture_output=True, text=True,
                                     timeout=step.get("timeout", 60), cwd=self.p.root)
                print(f"{step['name']}: exit {res.returncode} {res.stdout}{res.stderr}",
                      flush=True)
                if res.returncode != 0:
                    raise Fail(f"{step['name']} failed (exit {res.returncode}): "
                               f"{(res.stderr or res.stdout).strip()[-400:]}")
                continue
            pid = self.spawn(step)
            deadline = t0 + step.get("timeout", 60)
            while not self.ready(step.get("ready")):
                self.reap()
                if pid in self.exited:
                    raise Fail(f"{step['name']} exited during start-up; see "
                               f"{self.p.log}/{step['name']}.out and its log")
                if time.monotonic() > deadline:
                    raise Fail(f"{step['name']} not ready after {step.get('timeout', 60)} s")
                time.sleep(0.05)
            print(f"{step['name']} (pid {pid}) ready in {time.monotonic() - t0:.2f} s", flush=True)

    def children(self) -> list[int]:
        me = os.getpid()
        kids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()
            if int(fields[1]) == me and fields[0] not in ("Z", "X"):
                kids.append(int(entry))
        return kids

    def shutdown(self) -> None:
        self.status("stopping")
        for pid, name in reversed(list(self.daemons.items())):
            self.reap()
            if pid in self.exited:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 20
            while pid not in self.exited and time.monotonic() < deadline:
                time.sleep(0.05)
                self.reap()
            if pid not in self.exited:
                print(f"{name} (pid {pid}) ignored SIGTERM for 20 s: SIGKILL", flush=True)
                os.kill(pid, signal.SIGKILL)
                while pid not in self.exited:
                    time.sleep(0.05)
                    self.reap()
        # What is left are processes Slurm detached (slurmstepd, job tasks), re-parented to
        # us as their subreaper: the cluster started them, so the cluster stops them.
        for _ in range(100):
            kids = self.children()
            if not kids:
                break
            for pid in kids:
                print(f"killing adopted process {pid} {' '.join(cmdline(pid))[:120]}", flush=True)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
            self.reap()
        self.reap()

    def run(self) -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            print("prctl(PR_SET_CHILD_SUBREAPER) failed: orphans will not be reaped", flush=True)
        self.p.supervisor_pid.write_text(str(os.getpid()))
        stop = [False]
        wanted = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}

        def on_signal(signum, frame):
            stop[0] = True

        for s in wanted:
            signal.signal(s, on_signal)
        plan = read_json(self.p.plan)["steps"]
        try:
            self.start(plan, stop)
        except (Fail, OSError, subprocess.SubprocessError) as e:
            print(f"start failed: {e}", flush=True)
            self.shutdown()
            self.status("failed", error=str(e))
            return 1
        self.status("ready")
        signal.pthread_sigmask(signal.SIG_BLOCK, wanted | {signal.SIGCHLD})
        while not stop[0]:
            info = signal.sigtimedwait(wanted | {signal.SIGCHLD}, 5.0)
            self.reap()
            if info is not None and info.si_signo in wanted:
                stop[0] = True
            dead = [self.daemons[pid] for pid in self.exited]
            if dead:
                self.status("degraded", dead=dead)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, wanted | {signal.SIGCHLD})
        self.shutdown()
        self.status("stopped")
        return 0


# ------------------------------------------------------------------------------- commands
def node_states(p: Paths) -> dict[str, str]:
    res = subprocess.run([binary("sinfo"), "-h", "-N", "-o", "%N %T"], capture_output=True,
                         text=True, env=daemon_env(p), timeout=20)
    if res.returncode != 0:
        return {}
    return dict(line.split(None, 1) for line in res.stdout.splitlines() if line.strip())


def exports(p: Paths) -> str:
    return f"export SLURM_CONF={p.conf}"


def is_up(p: Paths) -> bool:
    st = read_json(p.status) or {}
    return supervisor_pid(p) is not None and st.get("phase") == "ready"


def stop_stale(p: Paths) -> None:
    """Kills daemons left by a supervisor that died (e.g. SIGKILL), by PID, checked by argv."""
    pids = read_json(p.pids) or {}
    for name, pid in pids.items():
        args = cmdline(pid)
        binname = name.split("-")[0] if name.startswith("slurmd-") else name
        if alive(pid) and args and (binname in os.path.basename(args[0]) or
                                    (name == "mariadb" and "mysql" in args[0])):
            log(f"stopping leftover {name} (pid {pid})")
            os.kill(pid, signal.SIGKILL)
    p.pids.unlink(missing_ok=True)


def cmd_up(p: Paths, params: dict, asked: dict) -> int:
    """Starts the cluster; when it is already up, only options given explicitly (``asked``)
    must match the running cluster's."""
    t0 = time.monotonic()
    p.root.mkdir(parents=True, exist_ok=True)
    if is_up(p):
        running = read_json(p.params) or {}
        diff = {k: (running.get(k), v) for k, v in asked.items() if running.get(k) != v}
        if diff:
            what = ", ".join(f"{k}={a} (asked {b})" for k, (a, b) in diff.items())
            raise Fail(f"cluster in {p.root} is already up with {what}; run `down` first")
        log(f"already up in {p.root} ({', '.join(f'{k}={v}' for k, v in running.items())})")
        print(exports(p))
        return 0
    pid = supervisor_pid(p)
    if pid is not None:  # a supervisor that is starting, failed or degraded
        log(f"supervisor {pid} is not ready ({(read_json(p.status) or {}).get('phase')}): "
            "stopping it first")
        stop_supervisor(p, pid)
    stop_stale(p)
    port = ports(params)
    wanted = [port["slurmctld"], port["slurmdbd"], port["mysql"]] + [
        port["slurmd0"] + i + 1 for i in range(params["nodes"])]
    busy = [n for n in wanted if tcp_open(n)]
    if busy:
        raise Fail(f"ports {busy} on 127.0.0.1 are in use by another program; choose other "
                   "ports with --port-base or SLURM_ETC_PORT_BASE")
    write_config(p, params)
    init_mysql(p)
    write_json(p.plan, {"steps": build_plan(p, params)})
    write_json(p.params, params)
    p.status.unlink(missing_ok=True)
    p.supervisor_pid.unlink(missing_ok=True)
    python = sys.executable or "/usr/bin/python3"
    with open(p.log / "supervisor.log", "ab") as out:
        proc = subprocess.Popen([python, os.path.abspath(__file__), "supervise", "--dir",
                                 str(p.root)], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=p.root)
    deadline = time.monotonic() + 240
    last = None
    while True:
        st = read_json(p.status) or {}
        phase = st.get("phase")
        step = st.get("step") if phase == "starting" else phase
        if step != last and phase == "starting":
            log(f"starting {step}")
        last = step
        if phase == "ready":
            break
        if phase == "failed" or proc.poll() is not None:
            raise Fail(f"start failed: {st.get('error', 'supervisor exited')}; "
                       f"logs in {p.log}")
        if time.monotonic() > deadline:
            stop_supervisor(p, proc.pid)
            raise Fail(f"cluster not ready after 240 s; logs in {p.log}")
        time.sleep(0.05)
    names = node_names(params)
    while True:
        states = node_states(p)
        if all(states.get(n, "").startswith("idle") for n in names):
            break
        if time.monotonic() > deadline:
            raise Fail(f"nodes not idle after 240 s: {states}; logs in {p.log}")
        time.sleep(0.1)
    log(f"up in {time.monotonic() - t0:.1f} s: {len(names)} nodes x {params['gpus_per_node']} "
        f"GPUs, Slurm {slurm_version()}, partitions main/scavenge/high, dir {p.root}")
    print(exports(p))
    return 0


def stop_supervisor(p: Paths, pid: int, timeout: float = 90) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            log(f"supervisor {pid} still running after {timeout:.0f} s: SIGKILL")
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
            break
        time.sleep(0.05)


def cmd_down(p: Paths, purge: bool) -> int:
    t0 = time.monotonic()
    pid = supervisor_pid(p)
    if pid is None:
        log(f"not running ({p.root})")
    else:
        stop_supervisor(p, pid)
        log(f"stopped in {time.monotonic() - t0:.1f} s")
    stop_stale(p)
    for f in (p.supervisor_pid, p.status, p.plan):
        f.unlink(missing_ok=True)
    if purge and p.root.exists():
        shutil.rmtree(p.root)
        log(f"removed {p.root}")
    return 0


def cmd_status(p: Paths) -> int:
    st = read_json(p.status) or {}
    pid = supervisor_pid(p)
    if pid is None:
        left = [f"{n} {d}" for n, d in (read_json(p.pids) or {}).items() if alive(d)]
        if left:
            print(f"stale: supervisor gone, daemons left ({', '.join(left)}); run down")
            return 2
        print(f"down ({p.root})")
        return 1
    params = read_json(p.params) or {}
    print(f"{st.get('phase', 'unknown')}: supervisor {pid}, dir {p.root}, "
          f"Slurm {slurm_version()}, params {json.dumps(params, sort_keys=True)}")
    for name, dpid in (st.get("daemons") or {}).items():
        print(f"  {name:<14} pid {dpid} {'running' if alive(dpid) else 'EXITED'}")
    for node, state in node_states(p).items():
        print(f"  node {node}: {state}")
    print(exports(p))
    return 0 if st.get("phase") == "ready" else 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="slurm-local.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="cluster directory (default $SLURM_ETC_CLUSTER_DIR or "
                                  "/tmp/slurm-etc-cluster)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the cluster (no-op when it is already up)")
    up.add_argument("--nodes", type=int, default=None, help="slurmd count (default 4)")
    up.add_argument("--gpus-per-node", type=int, default=None,
                    help="fake GPUs per node (default 2)")
    up.add_argument("--cpus-per-node", type=int, default=None,
                    help="CPUs each node declares (default 4)")
    up.add_argument("--memory-mb", type=int, default=None,
                    help="RealMemory each node declares (default 4096)")
    up.add_argument("--grace-time", type=int, default=None,
                    help="GraceTime of the scavenge partition (default 30 s)")
    up.add_argument("--kill-wait", type=int, default=None,
                    help="KillWait: SIGTERM to SIGKILL (default 30 s)")
    up.add_argument("--port-base", type=int,
                    default=None, help="slurmctld port; slurmdbd +1, MariaDB +2, slurmd +11.. "
                    "(default $SLURM_ETC_PORT_BASE or 16800)")
    down = sub.add_parser("down", help="stop everything the cluster started")
    down.add_argument("--purge", action="store_true", help="also delete the directory")
    sub.add_parser("status", help="exit 0 when up and ready, 1 when down, 2 otherwise")
    sub.add_parser("env", help="print the export line")
    sv = sub.add_parser("supervise", help=argparse.SUPPRESS)
    sv.add_argument("--dir", dest="sdir", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "supervise":
        return Supervisor(Paths(Path(args.sdir))).run()
    p = Paths(cluster_dir(args.dir))
    if args.cmd == "env":
        print(exports(p))
        return 0
    if args.cmd == "status":
        return cmd_status(p)
    if os.geteuid() != 0:
        raise Fail("must run as root (daemons, mknod of fake GPU devices)")
    p.lock.parent.mkdir(parents=True, exist_ok=True)
    with open(p.lock, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one up/down at a time per directory
        if args.cmd == "up":
            # Options given on the command line; the rest take their defaults.
            asked = {k: getattr(args, k) for k in DEFAULTS if getattr(args, k) is not None}
            if "port_base" not in asked and os.environ.get("SLURM_ETC_PORT_BASE"):
                asked["port_base"] = int(os.environ["SLURM_ETC_PORT_BASE"])
            params = {**DEFAULTS, **asked}
            if not 1 <= params["nodes"] <= 89:
                raise Fail(f"--nodes must be 1..89 (got {params['nodes']})")
            return cmd_up(p, params, asked)
        return cmd_down(p, args.purge)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Fail as e:
        log(f"error: {e}")
        sys.exit(1)

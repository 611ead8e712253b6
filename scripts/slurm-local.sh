#!/usr/bin/env bash
# A real Slurm cluster on this machine: slurmctld, N slurmd (one port each, NodeAddr=127.0.0.1),
# slurmdbd on its own MariaDB, munged, fake GPUs for GRES. Needs root (Debian 12 or 13).
#
# Usage:
#   scripts/slurm-local.sh up [--nodes N] [--gpus-per-node G] [--cpus-per-node C]
#                             [--memory-mb M] [--grace-time S] [--kill-wait S] [--port-base P]
#   scripts/slurm-local.sh down [--purge]     stop exactly what `up` started (by PID);
#                                             --purge also deletes the cluster directory
#   scripts/slurm-local.sh status             exit 0 when up and ready; daemons, node states
#   scripts/slurm-local.sh env                print the export line
#   then: export SLURM_CONF=/tmp/slurm-etc-cluster/etc/slurm.conf  (what `up` prints), or
#         eval "$(scripts/slurm-local.sh env)"
#
# Options (defaults): --nodes 4, --gpus-per-node 2, --cpus-per-node 4, --memory-mb 4096,
#   --grace-time 30 (GraceTime of `scavenge`), --kill-wait 30, --port-base 16800
#   (slurmctld 16800, slurmdbd 16801, MariaDB 16802 on 127.0.0.1, slurmd n<i> 16810+i).
# Environment: SLURM_ETC_CLUSTER_DIR (default /tmp/slurm-etc-cluster; also --dir DIR before
#   the command), SLURM_ETC_PORT_BASE.
#
# Partitions: main (Default, PriorityTier=5, PreemptMode=OFF: anchors), scavenge
#   (PriorityTier=1, PreemptMode=REQUEUE, GraceTime: members), high (PriorityTier=10: its jobs
#   preempt scavenge jobs). PreemptType=preempt/partition_prio with preempt_send_user_signal,
#   so a member submitted with --signal=[B:]SIG@T gets SIG when it is preempted.
# Accounting: slurmdbd + MariaDB (repeated `scontrol update JobId=.. NumNodes=..` needs it on
#   22.05), AccountingStorageEnforce=associations,limits,qos; cluster `slurmetc`, account `slurmetc`,
#   users root (and $SUDO_USER) are registered.
#
# `up` installs missing Debian packages (apt-get update only when something is missing),
# writes everything under the cluster directory (never /etc), starts the daemons in the
# foreground under one supervisor (new session, child subreaper: it reaps slurmstepd and job
# processes, since PID 1 here does not), waits until every node is idle. It is idempotent:
# when the cluster is already up it says so and exits 0. slurmctld starts clean (-c) on each
# `up`; MariaDB's datadir is kept across down/up so slurmdbd's tables are made only once.
# Implementation: scripts/slurm_local.py (Python standard library only).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
packages=(slurm-wlm munge slurmdbd mariadb-server)

ensure_packages() {
    local missing=()
    for pkg in "${packages[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' \
            || missing+=("$pkg")
    done
    # slurm-wlm-emulator replaces the daemons through alternatives: refuse to run with it.
    if dpkg-query -W -f='${Status}' slurm-wlm-emulator 2>/dev/null | grep -q 'ok installed'; then
        echo "slurm-local: error: slurm-wlm-emulator is installed; it replaces slurmd/slurmctld" >&2
        exit 1
    fi
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "slurm-local: error: missing packages ${missing[*]} and not root" >&2
        exit 1
    fi
    echo "slurm-local: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    # policy-rc.d keeps the packages' own services from starting where there is no init;
    # the cluster runs its own daemons from its own directory.
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# The system Python: the helper uses only the standard library.
python=/usr/bin/python3
[ -x "$python" ] || python="$(command -v python3)"

cmd=""
for arg in "$@"; do
    case "$arg" in up|down|status|env) cmd="$arg"; break ;; esac
done
if [ "$cmd" = up ]; then
    ensure_packages
fi
exec "$python" "$here/slurm_local.py" "$@"

#!/usr/bin/env bash
# Prometheus for the tests that scrape a running job's metrics (slurm-etc run --metrics-port).
#
# Usage: scripts/prometheus-local.sh install    Debian's `prometheus` package when missing
#                                               (apt-get update only then; needs root)
#
# The tests start Prometheus themselves, in the foreground, on a port and data directory of
# their own, and stop it by PID: nothing is left running, nothing under /etc is used.
set -euo pipefail

case "${1:-}" in
  install)
    if command -v prometheus >/dev/null 2>&1; then
      exit 0
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || {
      apt-get update -qq
      apt-get install -y -q --no-install-recommends prometheus >/dev/null
    }
    command -v prometheus >/dev/null
    ;;
  *)
    echo "usage: $0 install" >&2
    exit 2
    ;;
esac

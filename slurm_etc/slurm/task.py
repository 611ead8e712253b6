"""The task wrapper of a worker step: ``python -m slurm_etc.slurm.task <payload>``.

The Slurm backend launches one step per node and generation (``srun --jobid=<allocation>
-N1 -w <node> --ntasks=<k> --overlap --input=all``); each of its k tasks runs this wrapper,
which:

- picks its worker from the payload by ``SLURM_LOCALID`` (task i of the step is worker i),
  sets the worker's environment (``SLURM_ETC_*`` and the launch's extra variables) and its
  one GPU: ``CUDA_VISIBLE_DEVICES`` becomes entry ``device.local`` of the step's list (the
  job's GPUs on this node), so the worker's device is the one the coordinator chose, not
  one Slurm picked (``--gpus-per-task=1`` in concurrent ``--overlap`` steps does not say
  which GPU a task gets);
- starts the worker as its child with the preemption signal ignored (and SIGTERM too where
  that is the site's notice: see :class:`~slurm_etc.slurm.backend.SlurmBackend`): the
  coordinator, not the worker, acts on a notice, and workers train on until the migration
  committed;
- listens on stdin, which srun broadcasts to every task, for ``stop <vrank>`` (the stop
  signal to its worker) and ``kill <vrank>`` (SIGKILL): per-worker stops inside a step of
  several workers, with no extra step and no shared file;
- prints ``@slurm-etc start <vrank> <pid> <step>`` and ``@slurm-etc exit <vrank> <code>``
  on stdout, which srun forwards to the coordinator (the worker's own stdout goes to the
  wrapper's stderr, i.e. the step's log). ``srun`` exits 0 even when its step was killed, so
  exit codes come from these lines; a task with no exit line died with its allocation.

The wrapper itself ignores SIGTERM, SIGINT, SIGHUP and the notice signal: it lives until its
worker ends (or SIGKILL), so that it can report the exit.

Standard library only; it must start fast on every node.
"""
from __future__ import annotations

import base64
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from slurm_etc.protocol.gpus import VISIBLE_GPUS, one_gpu

MARK = "@slurm-etc"


def encode_payload(payload: Mapping[str, Any]) -> str:
    """The payload as one argv word (URL-safe base64 of compact JSON)."""
    raw = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_payload(word: str) -> dict[str, Any]:
    return dict(json.loads(base64.urlsafe_b64decode(word.encode())))


def worker_env(environ: Mapping[str, str], task: Mapping[str, Any]) -> dict[str, str]:
    """The worker's environment: the step's plus the task's variables and its one GPU."""
    env = dict(environ)
    env.update({str(k): str(v) for k, v in task.get("env", {}).items()})
    try:
        env[VISIBLE_GPUS] = one_gpu(environ.get(VISIBLE_GPUS), int(task["local"]))
    except ValueError as err:
        raise SystemExit(f"slurm-etc task: {err}") from None
    return env


def _signum(name: str) -> signal.Signals:
    return signal.Signals[name if name.startswith("SIG") else "SIG" + name]


def _say(*words: object) -> None:
    sys.stdout.write(" ".join([MARK, *map(str, words)]) + "\n")
    sys.stdout.flush()


def run(payload: Mapping[str, Any], environ: Mapping[str, str]) -> int:
    index = int(environ.get("SLURM_LOCALID", environ.get("SLURM_PROCID", "0")))
    tasks: Sequence[Mapping[str, Any]] = payload["tasks"]
    if index >= len(tasks):
        raise SystemExit(f"slurm-etc task: task {index} of a step with {len(tasks)} workers")
    task = tasks[index]
    vrank = int(task["vrank"])
    ignored = [_signum(s) for s in payload.get("ignore", [])]
    stop_sig = _signum(payload.get("stop_signal", "TERM"))
    for sig in {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, *ignored}:
        signal.signal(sig, signal.SIG_IGN)

    def child_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            if sig not in ignored:
                signal.signal(sig, signal.SIG_DFL)

    try:
        proc = subprocess.Popen(list(payload["argv"]), env=worker_env(environ, task),
                                stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                                preexec_fn=child_signals)
    except OSError as e:
        print(f"slurm-etc task: vrank {vrank}: cannot start {payload['argv'][0]!r}: "
              f"{e.strerror}", file=sys.stderr, flush=True)
        _say("exit", vrank, 127)
        return 127
    _say("start", vrank, proc.pid, environ.get("SLURM_STEP_ID", "?"))
    stdin_open = True
    buf = b""
    while proc.poll() is None:
        if not stdin_open:
            try:
                proc.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
            continue
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], 0.2)
        if not ready:
            continue
        chunk = os.read(sys.stdin.fileno(), 4096)
        if not chunk:
            stdin_open = False  # the coordinator's srun went away; the worker trains on
            continue
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            verb, _, who = line.decode(errors="replace").strip().partition(" ")
            if who.strip() != str(vrank) or proc.poll() is not None:
                continue
            if verb == "stop":
                proc.send_signal(stop_sig)
            elif verb == "kill":
                proc.kill()
    code = proc.returncode
    _say("exit", vrank, code)
    return code if code >= 0 else 128 - code


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m slurm_etc.slurm.task <payload>", file=sys.stderr)
        return 2
    return run(decode_payload(args[0]), os.environ)


if __name__ == "__main__":
    sys.exit(main())

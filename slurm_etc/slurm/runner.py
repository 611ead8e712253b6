"""The one place that runs Slurm commands: a timeout on each, failures as one SlurmError."""
from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .model import Command, SlurmError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    """What a finished command printed."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float


class SlurmRunner:
    """Runs :class:`Command` objects with a timeout.

    Args:
        timeout: seconds per command (Slurm clients retry a busy slurmctld for up to
            MessageTimeout, 10 s by default, so keep this above it).
        env: environment of the commands (default: this process's, at each call); set
            ``SLURM_CONF`` here to talk to a cluster other than the default one.
    """

    def __init__(self, timeout: float = 30.0, env: Mapping[str, str] | None = None):
        self.timeout = timeout
        self.env = dict(env) if env is not None else None

    def run(self, cmd: Command, *, check: bool = True, timeout: float | None = None,
            env: Mapping[str, str] | None = None) -> Result:
        """Run ``cmd``; with ``check`` a non-zero exit raises :class:`SlurmError`."""
        limit = self.timeout if timeout is None else timeout
        use_env = dict(env) if env is not None else (self.env or dict(os.environ))
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd.argv, input=cmd.stdin, capture_output=True, text=True,
                                  timeout=limit, env=use_env, cwd=cmd.cwd,
                                  stdin=None if cmd.stdin is not None else subprocess.DEVNULL)
        except FileNotFoundError as e:
            raise SlurmError(cmd.argv, None, f"{cmd.argv[0]} not found on PATH "
                             "(is Slurm's client installed?)", what="not found") from e
        except subprocess.TimeoutExpired as e:
            stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (
                e.stderr or "")
            raise SlurmError(cmd.argv, None, stderr,
                             what=f"timed out after {limit:g} s") from e
        seconds = time.monotonic() - t0
        log.debug("%s -> exit %d in %.3f s", cmd, proc.returncode, seconds)
        if check and proc.returncode != 0:
            raise SlurmError(cmd.argv, proc.returncode, proc.stderr, proc.stdout)
        return Result(proc.returncode, proc.stdout, proc.stderr, seconds)

"""The preset worker with the faults its environment asks for (:mod:`.hooks`): what
``slurm-etc demo --inject`` and the fault tests launch.

    SLURM_ETC_INJECT=after-commit python -m slurm_etc.testing.worker --model tiny ...
"""
from __future__ import annotations

import sys

from slurm_etc.worker.entry import run_worker
from slurm_etc.worker.preset_worker import build

from .hooks import trainer_hooks_from_env


def main(argv: list[str] | None = None) -> int:
    trainer = build(argv, prog="python -m slurm_etc.testing.worker")
    trainer.hooks = trainer_hooks_from_env()
    return run_worker(trainer)


if __name__ == "__main__":
    sys.exit(main())

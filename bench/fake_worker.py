"""A stand-in worker for the coordinator benchmark: speaks the real control protocol (joins
the authenticated channel, reports progress, answers resizes at once) without training, so
that what is timed is the coordinator alone."""
from __future__ import annotations

import os
import sys
import time

from slurm_etc.protocol.channel import WorkerChannel
from slurm_etc.protocol.env import LAYOUT
from slurm_etc.protocol.messages import (
    Exited,
    Progress,
    Ready,
    Resize,
    Resized,
    Stop,
    parse_layout,
)

STEP_S = float(os.environ.get("FAKE_STEP_S", "0.2"))
STEPS = int(os.environ.get("FAKE_STEPS", "0"))  # > 0: every worker ends after that many


def main() -> int:
    ch = WorkerChannel.from_env()
    ch.join(60.0, pid=os.getpid())
    job, vrank = os.environ["SLURM_ETC_JOB"], int(os.environ["SLURM_ETC_VRANK"])
    layout = parse_layout(os.environ[LAYOUT]) if os.environ.get(LAYOUT) else None
    # a joining worker takes the first resize of its launch generation
    gen = int(os.environ.get("SLURM_ETC_GENERATION", "0")) - (layout is None)
    step = int(os.environ.get("FAKE_START_STEP", "0"))
    try:
        while True:
            order = ch.wait(STEP_S)
            if isinstance(order, Stop):
                ch.report(Exited(job, gen, vrank, "stopped", step))
                return 0
            if isinstance(order, Resize) and order.generation > gen:
                gen = order.generation
                if layout is None:  # a joiner: warmed up at once (nothing to import)
                    ch.report(Ready(job, gen, vrank))
                if vrank not in order.new.devices:
                    ch.report(Resized(job, gen, vrank, "left", step))
                    ch.report(Exited(job, gen, vrank, "left", step))
                    time.sleep(0.2)
                    return 0
                layout = order.new.layout()
                ch.report(Resized(job, gen, vrank, "committed", step, pause_seconds=0.001))
                continue
            if layout is not None:
                step += 1
                if vrank == layout.devices[0]:
                    ch.report(Progress(job, gen, vrank, step, 1.0, 1e-3, step * 8,
                                       str(layout.config)))
                if STEPS and step >= STEPS:
                    ch.report(Exited(job, gen, vrank, "done", step))
                    time.sleep(0.2)
                    return 0
    finally:
        ch.close()


if __name__ == "__main__":
    sys.exit(main())

"""A worker process launched by the coordinator's backend (a local process or an srun task).

The user's training script ends with ``sys.exit(run_worker(make_trainer(...)))``. The
backend's environment says who the process is (``SLURM_ETC_JOB``, ``_VRANK``,
``_GENERATION``, the channel's address and the path of the job's secret file, and the
run's peer-copy and checkpoint settings: ``protocol.recovery.Recovery``); the worker
joins the control channel, is welcomed, reaches the job's rendezvous store on the same
connection (:meth:`StoreClient.over <slurm_etc.protocol.store.StoreClient.over>`: the
coordinator holds one connection per worker), and trains: from the start in
``SLURM_ETC_LAYOUT`` when it is part of the first layout, else it waits for the resize that
brings it in.
"""
from __future__ import annotations

import logging
import os
import signal
from datetime import timedelta
from typing import Any

from slurm_etc.plan import Topology

from ..protocol.env import WorkerEnv
from ..protocol.messages import parse_layout
from ..protocol.recovery import Recovery
from .trainer import ElasticTrainer, WorkerProcess

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 120.0


def run_worker(trainer: ElasticTrainer, environ: Any = None) -> int:
    """Join the job described by the environment and train; the exit status.

    The preemption signal of a member allocation goes to the coordinator, which orders the
    resize: a worker ignores SIGUSR2 so that it trains on until the migration committed.
    """
    from slurm_etc.protocol.channel import WorkerChannel
    from slurm_etc.protocol.store import StoreClient

    env = os.environ if environ is None else environ
    # the run's --peer-copy-every / --checkpoint-every / --checkpoint-dir, over the
    # trainer's own settings (a bad value ends the worker with one line, before it joins)
    trainer.recovery = Recovery.from_env(env, trainer.recovery)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    control = WorkerChannel.from_env(env)
    try:
        me = WorkerEnv.of(env)
        layout = parse_layout(me.layout) if me.layout else None
        control.join(JOIN_TIMEOUT_S, pid=os.getpid())
        # the store's requests ride the channel's connection (CURVE with keys derived from
        # the job's secret: nobody without it can read or write what the workers agree on)
        store = StoreClient.over(control, timeout=timedelta(seconds=me.timeout_s))
        proc = WorkerProcess(
            job=me.job, vrank=me.vrank, store=store, control=control, layout=layout,
            generation=me.generation, topology=Topology(gpus_per_node=me.gpus_per_node),
            keep_tp_in_node=True, timeout_s=me.timeout_s, reattach_wait_s=me.reattach_wait_s)
        why = trainer.run(proc)
        trainer.close()
        logger.info("worker vrank %s finished: %s", proc.vrank, why)
        return 0
    finally:
        control.close()

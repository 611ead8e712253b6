"""The seam ``bench control`` holds thousands of simulated ranks with: a worker's channel (and
the store client that rides it) may open its socket in a zmq context the caller owns; closing
them leaves that context alone (a real worker's own context, the default, is terminated as
before)."""
from __future__ import annotations

import secrets
import threading
from datetime import timedelta

import zmq

from slurm_etc.protocol.channel import CoordinatorChannel, WorkerChannel
from slurm_etc.protocol.messages import Progress
from slurm_etc.protocol.store import StoreClient

JOB = "shared"


def test_channels_and_store_clients_in_one_context() -> None:
    key = secrets.token_bytes(32)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with CoordinatorChannel(JOB, key, "127.0.0.1") as coordinator:
        workers = [WorkerChannel(JOB, v, coordinator.address, key, context=ctx)
                   for v in range(3)]
        stores = [StoreClient.over(w, timeout=timedelta(seconds=10)) for w in workers]
        joins = [threading.Thread(target=w.join, args=(10.0,)) for w in workers]
        for t in joins:
            t.start()
        while any(t.is_alive() for t in joins):
            coordinator.recv(0.05)  # answers each Hello with a Welcome
        assert all(w.rendezvous is not None for w in workers)
        stores[0].set("k", b"v")
        assert [s.get("k") for s in stores] == [b"v"] * 3
        workers[0].close(linger_s=0)
        stores[0].close()
        assert not ctx.closed  # the caller's: not terminated by a close
        workers[1].report(Progress(JOB, 0, 1, 1, 1.0, 1e-4, 8, "dp=1,tp=1,pp=1"))
        got = None
        for _ in range(100):
            got = coordinator.recv(0.1)
            if got is not None and isinstance(got[1], Progress):
                break
        assert got is not None and got[0] == 1
        assert stores[1].get("k") == b"v"
        for w in workers[1:]:
            w.close(linger_s=0)
        for s in stores[1:]:
            s.close()
    ctx.term()


def test_a_worker_channel_of_its_own_context_terminates_it() -> None:
    w = WorkerChannel(JOB, 0, "tcp://127.0.0.1:1", secrets.token_bytes(32))
    own = w._ctx
    w.close(linger_s=0)
    assert own.closed

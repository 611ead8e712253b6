"""What the per-step agreement costs through the rendezvous store: torch's TCPStore (the
old store, polled with ``check`` every 2 ms as the trainer did) against the job's CURVE
store (:mod:`slurm_etc.protocol.store`, the server answers the wait).

Each of ``--ranks`` processes does, per step, what ``ElasticTrainer._agree`` does: set its
key of this step, delete its key of step - 2, wait for every rank's key, read them all
(before: four requests and polling; now: one request the server answers when all are there).
Prints the median and 90th percentile of one step's agreement per store, in ms::

    OMP_NUM_THREADS=1 python bench/store_agreement.py --ranks 4 --steps 300
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import secrets
import statistics
import time
from datetime import timedelta


def _rank(kind: str, rank: int, world: int, port: int, secret: bytes, steps: int,
          out: mp.Queue) -> None:
    import torch.distributed as dist

    from slurm_etc.protocol.store import StoreClient, agree_step

    if kind == "tcpstore":
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=60))
    else:
        store = StoreClient("127.0.0.1", port, secret, timeout=timedelta(seconds=60))
    times = []
    for step in range(steps):
        keys = [f"j/g0/agree/{step}/{r}" for r in range(world)]
        stale = f"j/g0/agree/{step - 2}/{rank}" if step >= 2 else ""
        t0 = time.perf_counter()
        if kind == "tcpstore":  # the trainer before: set, delete, poll check, multi_get
            store.set(keys[rank], b"-")
            if stale:
                store.delete_key(stale)
            while not store.check(keys):
                time.sleep(0.002)
            store.multi_get(keys)
        else:  # the trainer now (ElasticTrainer._agree)
            while agree_step(store, keys[rank], b"-", stale, keys, 0.05) is None:
                pass
        times.append(time.perf_counter() - t0)
    out.put(times[10:])  # the first steps include connecting


def measure(kind: str, world: int, steps: int) -> dict:
    import torch.distributed as dist

    from slurm_etc.protocol.store import StoreServer

    secret = secrets.token_bytes(32)
    server = None
    if kind == "tcpstore":
        master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = master.port
    else:
        server = StoreServer(secret, "127.0.0.1", job="j")
        port = server.port
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(kind, r, world, port, secret, steps, out))
             for r in range(world)]
    for p in procs:
        p.start()
    per_rank = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    if server is not None:
        server.close()
    every = sorted(t for ts in per_rank for t in ts)
    return {"store": kind, "ranks": world, "steps": steps,
            "median_ms": round(statistics.median(every) * 1000, 3),
            "p90_ms": round(every[int(0.9 * len(every))] * 1000, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    if not 1 <= args.ranks <= 64 or not 20 <= args.steps <= 100_000:
        parser.error("--ranks must be in 1..64 and --steps in 20..100000")
    for kind in ("tcpstore", "curve"):
        print(json.dumps(measure(kind, args.ranks, args.steps)))


if __name__ == "__main__":
    main()

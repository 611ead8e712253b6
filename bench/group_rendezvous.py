"""What starting gloo process groups asks of the job's rendezvous store, by world size.

``--ranks`` real processes each connect a :class:`StoreClient` to a real
:class:`StoreServer` (CURVE) and start the world group (``init_process_group("gloo")`` over
a ``PrefixStore``) and ``--groups`` more all-ranks groups (``new_group``), as a training
world's start does. Prints the store's requests and keys per group start: gloo exchanges
every rank's address through the store and connects every pair (each rank gets every other
rank's key), so its requests grow as ranks x ranks. NCCL (not measurable here: no GPU)
stores one key per communicator, the unique id rank 0 writes and every other rank reads
(``ProcessGroupNCCL::broadcastUniqueNCCLID``), and a ``new_group`` split from an existing
communicator (``ncclCommSplit``) asks the store nothing.

Each size runs twice, side by side: gloo as it starts by default (every pair connected when
a group starts) and with ``TORCH_GLOO_LAZY_INIT=1`` (a pair connected at its first
collective), which a worker on a GPU sets (``migrate/device.py: use``): there the world's
gloo half carries nothing per step, and its groups cost a rank one address each. The world's
barrier at the end is the only collective (it connects the pairs it uses).

    OMP_NUM_THREADS=1 python bench/group_rendezvous.py --ranks 2,4,8
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
from datetime import timedelta

from slurm_etc.migrate.device import GLOO_LAZY_INIT


def _rank(rank: int, world: int, port: int, secret: bytes, groups: int, out) -> None:
    import torch.distributed as dist

    from slurm_etc.protocol.store import StoreClient

    store = StoreClient("127.0.0.1", port, secret, timeout=timedelta(seconds=120))
    before = store.requests
    dist.init_process_group("gloo", store=dist.PrefixStore("w", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    for _ in range(groups):
        dist.new_group(list(range(world)), backend="gloo")
    dist.barrier()
    out.put(store.requests - before)
    dist.destroy_process_group()
    store.close()


def measure(world: int, groups: int, lazy: bool) -> dict:
    from slurm_etc.protocol.store import StoreServer

    secret = secrets.token_bytes(32)
    server = StoreServer(secret, "127.0.0.1", job="j")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, server.port, secret, groups, out))
             for r in range(world)]
    was = os.environ.pop(GLOO_LAZY_INIT, None)
    if lazy:  # the children inherit it
        os.environ[GLOO_LAZY_INIT] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        os.environ.pop(GLOO_LAZY_INIT, None)
        if was is not None:
            os.environ[GLOO_LAZY_INIT] = was
    sent = sum(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    stats = server.stats()
    server.close()
    starts = groups + 1
    return {"ranks": world, "gloo": "lazy" if lazy else "eager", "group_starts": starts,
            "store_requests_per_group": round(sent / starts, 1),
            "per_rank_per_group": round(sent / starts / world, 1),
            "keys_per_group": round(stats["keys"] / starts, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--groups", type=int, default=2)
    args = parser.parse_args()
    sizes = [int(x) for x in args.ranks.split(",")]
    if not all(2 <= n <= 32 for n in sizes) or not 0 <= args.groups <= 20:
        parser.error("--ranks: sizes in 2..32; --groups in 0..20")
    for n in sizes:
        for lazy in (False, True):
            print(json.dumps(measure(n, args.groups, lazy)), flush=True)


if __name__ == "__main__":
    main()

"""What a step boundary asks of the coordinator's store, before and after the step gate.

``--ranks`` simulated ranks, each with its own connection to a real :class:`StoreServer`
(CURVE, the job's store), spread over a few processes as threads. Per boundary:

* ``agree-all`` (before): every rank sets its key and waits for every rank's key in one
  request (``agree_step`` naming all ranks' keys): ranks x ranks keys at the store.
* ``decide`` (now, a boundary whose gate is open: some rank holds an order): the trainer's
  ``_arrive`` (one told rank proposes by compare-and-set, every rank counts itself in with
  ``add``, the last closes the decision) and the wait for the decision (``agree_step`` naming
  one key): at most 3 requests a rank, O(1) keys each.
* a boundary whose gate is closed asks the store nothing (0 requests; counted in
  tests/dist/test_step_gate.py), so it has no row here.

Prints, per mode and size, the median wall time of one boundary (first rank in to last rank
out) and the store's requests per boundary; ``--json`` for one JSON line each::

    OMP_NUM_THREADS=1 python bench/step_decision.py --ranks 64,256,1024 --boundaries 5
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import secrets
import statistics
import threading
import time
from datetime import timedelta

PROCESSES = 4


def _ranks(mode: str, ranks: list[int], world: int, port: int, secret: bytes,
           boundaries: int, start: mp.Barrier, out: mp.Queue) -> None:
    from slurm_etc.protocol.store import StoreClient, agree_step

    clients = {r: StoreClient("127.0.0.1", port, secret, timeout=timedelta(seconds=600))
               for r in ranks}
    spans: dict[int, list[tuple[float, float]]] = {r: [] for r in ranks}
    local = threading.Barrier(len(ranks))

    def rank(r: int) -> None:
        store = clients[r]
        for b in range(boundaries):
            local.wait()
            if r == ranks[0]:
                start.wait()  # every process's ranks begin the boundary together
            local.wait()
            t0 = time.time()
            decided, arrived = f"j/g0/agree/{b}/decided", f"j/g0/agree/{b}/arrived"
            if mode == "agree-all":
                keys = [f"j/g0/agree/{b}/{q}" for q in range(world)]
                while agree_step(store, keys[r], b"-", "", keys, 5.0) is None:
                    pass
            else:
                if r == 0:  # the one told rank
                    store.compare_set(decided, b"", b"order")
                if store.add(arrived, 1) == world:
                    store.compare_set(decided, b"", b"-")
                while agree_step(store, f"j/g0/agree/{b}/{r}", b"-", "", [decided],
                                 5.0) is None:
                    pass
            spans[r].append((t0, time.time()))

    threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put([spans[r] for r in ranks])
    for c in clients.values():
        c.close()


def measure(mode: str, world: int, boundaries: int) -> dict:
    from slurm_etc.protocol.store import StoreServer

    secret = secrets.token_bytes(32)
    server = StoreServer(secret, "127.0.0.1", job="j")
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    nproc = min(PROCESSES, world)
    start = ctx.Barrier(nproc)
    parts = [list(range(world))[i::nproc] for i in range(nproc)]
    procs = [ctx.Process(target=_ranks, args=(mode, part, world, server.port, secret,
                                              boundaries, start, out)) for part in parts]
    for p in procs:
        p.start()
    per_rank = [s for _ in procs for s in out.get(timeout=3600)]
    for p in procs:
        p.join(60)
    requests = server.stats()["requests"]
    server.close()
    walls = [max(spans[b][1] for spans in per_rank) - min(spans[b][0] for spans in per_rank)
             for b in range(boundaries)]
    return {"mode": mode, "ranks": world, "boundaries": boundaries,
            "boundary_ms": round(statistics.median(walls) * 1000, 1),
            "store_requests_per_boundary": round(requests / boundaries, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,256,1024")
    parser.add_argument("--boundaries", type=int, default=5)
    parser.add_argument("--modes", default="agree-all,decide")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [int(x) for x in args.ranks.split(",")]
    if not all(2 <= n <= 4096 for n in sizes) or not 1 <= args.boundaries <= 1000:
        parser.error("--ranks: sizes in 2..4096; --boundaries in 1..1000")
    for n in sizes:
        for mode in args.modes.split(","):
            row = measure(mode, n, args.boundaries)
            print(json.dumps(row) if args.json else
                  f"{mode:>9} {n:>6} ranks: {row['boundary_ms']:>9.1f} ms a boundary, "
                  f"{row['store_requests_per_boundary']:>9.1f} store requests", flush=True)


if __name__ == "__main__":
    main()

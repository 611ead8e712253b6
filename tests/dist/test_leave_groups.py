"""A rank that leaves its gloo groups (a collective of its failed) releases the peers blocked
on it at once: real processes, a real gloo group over a TCPStore, the last rank never enters
the all_reduce the others wait in and shuts its group connections down
(migrate/connections.py). Without it (the planted bug: nothing closed, i.e. what
``ProcessGroup.shutdown`` does) the peers wait out the group's timeout; the store's own
connection, a spare port, stays up."""
from __future__ import annotations

import multiprocessing as mp
import socket
import time

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

GROUP_TIMEOUT_S = 30
# the plant's group timeout: the fix is held to under half of its group's timeout, the plant
# waits its own out, at any length (a shorter one spares the suite 20 s)
PLANT_TIMEOUT_S = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, plant: bool, out) -> None:
    timeout_s = PLANT_TIMEOUT_S if plant else GROUP_TIMEOUT_S
    import datetime

    import torch
    import torch.distributed as dist

    from slurm_etc.migrate import connections

    base = connections.snapshot()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    group = dist.new_group(list(range(world)), backend="gloo")
    t = torch.ones(1 << 14)
    dist.all_reduce(t, group=group)
    dist.barrier()
    if rank == world - 1:  # failed elsewhere: leaves without entering the collective
        time.sleep(1.0)
        shut = 0 if plant else connections.close_group_connections(base, spare_ports={port})
        store.set(f"left-{rank}", "1")  # the store's connection still works
        out.put((rank, "left", shut))
        time.sleep(timeout_s + 5)
        return
    t0 = time.monotonic()
    try:
        dist.all_reduce(t, group=group)
        out.put((rank, "completed", time.monotonic() - t0))
    except RuntimeError:
        out.put((rank, "failed", time.monotonic() - t0))


def _run(world: int, plant: bool) -> dict[int, tuple[str, float]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, plant, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world):
            rank, what, value = out.get(timeout=GROUP_TIMEOUT_S + 60)
            got[rank] = (what, value)
    finally:
        for p in procs:
            p.kill()
            p.join(5)
    return got


@pytest.mark.parametrize("world", [2, 4])
def test_peers_blocked_on_a_leaving_rank_fail_at_once(world):
    got = _run(world, plant=False)
    what, shut = got.pop(world - 1)
    assert what == "left" and shut >= 2 * (world - 1), shut  # its pairs of both groups
    for rank, (what, seconds) in got.items():
        # blocked since ~1 s before the leave: they fail within seconds (loaded machines take
        # seconds), not the 30 s timeout
        assert what == "failed" and seconds < GROUP_TIMEOUT_S / 2, (rank, what, seconds)


def test_without_closing_the_peers_wait_out_the_timeout():
    got = _run(2, plant=True)
    what, seconds = got[0]
    assert what == "failed" and seconds >= PLANT_TIMEOUT_S - 1, (what, seconds)

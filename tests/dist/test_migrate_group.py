"""A migration group connected from a rendezvous store, as a resize connects one in production.

Device 0 holds old rank 0 and leaves, device 1 holds old rank 1 and stays, device 2 joins
empty. The old ranks are a running job: they share a default (training) process group, which
the migration group must neither need nor disturb; device 2 has no group at all. The test
process hosts the TCPStore (the coordinator's role); each worker calls
``connect_migration_group`` with its device id, runs the plan, checks its new shards; the old
ranks' training group still works afterwards; the departing one exits after the commit.
"""
from __future__ import annotations

import multiprocessing
import os
import socket
from datetime import timedelta

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def _plan():
    from slurm_etc.plan import Layout, ParallelConfig, Topology, plan_migration
    from slurm_etc.plan.model import PRESETS

    cfg = ParallelConfig(1, 1, 2, distributed_optimizer=True)
    return plan_migration(PRESETS["tiny-llama"], Layout(cfg, (0, 1)), cfg, (1, 2),
                          Topology(gpus_per_node=4))


def _worker(device: int, port: int, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from slurm_etc.migrate.executor import MigrationOptions, execute_migration
    from slurm_etc.migrate.group import connect_migration_group
    from slurm_etc.testing.fake_state import fake_shards, shard_mismatches

    torch.set_num_threads(1)
    try:
        plan = _plan()
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=60))
        if device in plan.old.devices:  # the running job's training group
            dist.init_process_group("gloo", store=dist.PrefixStore("train", store),
                                    rank=plan.old.devices.index(device),
                                    world_size=len(plan.old.devices))
        group = connect_migration_group(plan, device, dist.PrefixStore("migrate", store),
                                        timeout_s=60)
        old_rank = plan.old.devices.index(device) if device in plan.old.devices else None
        res = execute_migration(plan, group.transport(), device, fake_shards(plan, old_rank),
                                options=MigrationOptions(timeout_s=30, measure_memory=False))
        out.put((device, {"rank": group.rank, "old_rank": old_rank, "new_rank": res.new_rank,
                          "departing": res.departing, "shards": len(res.new_shards),
                          "received": res.stats.received_bytes,
                          "mismatches": shard_mismatches(plan, res.new_rank, res.new_shards),
                          "training_sum": _training_group_sum()}))
        group.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((device, {"error": repr(exc)}))


def _training_group_sum():
    """all_reduce over the old ranks' training group, if this process has one."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_store_rendezvous_grow_and_leave():
    import torch.distributed as dist


    plan = _plan()
    assert plan.old.devices == (0, 1) and sorted(plan.new.devices) == [1, 2]
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(d, port, out)) for d in (0, 1, 2)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=150) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        del store
    for device, r in results.items():
        assert "error" not in r, (device, r["error"])
        assert r["rank"] == device  # union (0, 1, 2): rank = position of the device
        assert r["mismatches"] == []
    assert [results[d]["training_sum"] for d in (0, 1, 2)] == [2.0, 2.0, None]
    assert results[0]["departing"] and results[0]["shards"] == 0
    # device 2 held nothing: it receives all of its new state, every message addressed to it
    m = plan.messages
    assert results[2]["old_rank"] is None
    assert results[2]["received"] == int(m.nbytes[m.dst == 2].sum()) > 0
    assert not results[1]["departing"] and not results[2]["departing"]

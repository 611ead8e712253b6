"""Worker-side functions of the executor's multi-process tests (pickled by reference).

Every function runs on every rank of a pool from :func:`tests.dist.harness.pool_fixture`;
the device id of a worker is its pool rank. Plans are computed on each worker from a
:class:`Case` (every rank computes the same plan, as in production). Migration groups are
created with ``new_group`` over the pool's default group and cached per set of devices; all
ranks call the same functions in the same order, so the caches stay in step.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import lru_cache

import torch

from slurm_etc.migrate.executor import MigrationAborted, MigrationOptions, execute_migration
from slurm_etc.migrate.faults import FaultInjector
from slurm_etc.migrate.group import MigrationGroup, new_migration_group
from slurm_etc.migrate.program import group_devices
from slurm_etc.plan import Layout, ParallelConfig, Topology, default_pool, plan_migration
from slurm_etc.plan.model import PRESETS, ModelDesc
from slurm_etc.testing.fake_state import DTYPES, fake_shards, filled_shards, shard_mismatches


@dataclass(frozen=True)
class Case:
    """A transition: model preset (and dtype), old and new (dp, tp, pp), dist-opt."""

    model: str
    old: tuple[int, int, int]
    new: tuple[int, int, int]
    dist: bool = False
    dtype: str = "fp32"
    gpn: int = 4
    pool: tuple[int, ...] | None = None  # devices the new layout may use (default_pool if None)

    def __str__(self) -> str:
        o, n = self.old, self.new
        return (f"{self.model}-{self.dtype}{'-distopt' if self.dist else ''}-"
                f"dp{o[0]}tp{o[1]}pp{o[2]}-to-dp{n[0]}tp{n[1]}pp{n[2]}")

    def model_desc(self) -> ModelDesc:
        return dataclasses.replace(PRESETS[self.model], param_dtype=self.dtype)


@lru_cache(maxsize=64)
def make_plan(case: Case, model: ModelDesc | None = None):
    model = model or case.model_desc()
    oc = ParallelConfig(*case.old, distributed_optimizer=case.dist)
    nc = ParallelConfig(*case.new, distributed_optimizer=case.dist)
    layout = Layout(oc, tuple(range(oc.world)))
    topo = Topology(gpus_per_node=case.gpn)
    pool = case.pool if case.pool is not None else default_pool(layout, nc, topo)
    return plan_migration(model, layout, nc, pool, topo)


_GROUPS: dict[tuple[int, ...], MigrationGroup | None] = {}


def migration_group(plan, rank: int, fresh: bool = False) -> MigrationGroup | None:
    """The (cached) migration group of ``plan``; collective over the whole pool."""
    key = group_devices(plan)
    if fresh:
        return new_migration_group(plan, rank)
    if key not in _GROUPS:
        _GROUPS[key] = new_migration_group(plan, rank)
    return _GROUPS[key]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(DTYPES[t.element_size()][1])


def run_case(rank: int, world: int, case: Case, *, staging_bytes: int | None = None,
             overlap: bool = True, faults: FaultInjector | None = None,
             p2p_timeout_s: float = 60.0, vote_timeout_s: float | None = None,
             fresh_group: bool = False, seed: int = 0,
             direct_min_bytes: int | None = None) -> dict | None:
    """Migrate fake state under ``case`` and check it on this rank; None if not taking part."""
    plan = make_plan(case)
    group = migration_group(plan, rank, fresh_group)
    if group is None:
        return None
    old_rank = plan.old.devices.index(rank) if rank in plan.old.devices else None
    old = fake_shards(plan, old_rank, seed=seed)
    before = [_bits(sh.tensor).clone() for sh in old]
    options = MigrationOptions(timeout_s=p2p_timeout_s, vote_timeout_s=vote_timeout_s,
                               overlap=overlap, measure_memory=False,
                               **({"staging_bytes": staging_bytes} if staging_bytes else {}),
                               **({"direct_min_bytes": direct_min_bytes}
                                  if direct_min_bytes else {}))
    out: dict = {"rank": rank, "old_rank": old_rank, "old_shards": len(old)}
    t0 = time.perf_counter()
    try:
        res = execute_migration(plan, group.transport(), rank, old, options=options,
                                faults=faults)
    except MigrationAborted as exc:
        out.update(aborted=True, message=str(exc), vote=exc.vote,
                   transport_failed=exc.transport_failed,
                   failures=[dataclasses.asdict(f) for f in exc.failures])
    else:
        out.update(aborted=False, new_rank=res.new_rank, departing=res.departing,
                   new_shards=len(res.new_shards), stats=res.stats.as_dict(),
                   mismatches=shard_mismatches(plan, res.new_rank, res.new_shards, seed=seed))
    out["seconds"] = time.perf_counter() - t0
    out["old_unchanged"] = all(torch.equal(a, _bits(sh.tensor)) for a, sh in zip(before, old))
    out["old_mismatches"] = shard_mismatches(plan, old_rank, old, seed=seed, new=False)
    return out


# -- memory and throughput ------------------------------------------------------------------

def measure_case(rank: int, world: int, case: Case, model: ModelDesc, *,
                 staging_bytes: int, overlap: bool = True, verify: bool = False,
                 direct_min_bytes: int | None = None, repeats: int = 1) -> dict | None:
    """Migrate a larger model ``repeats`` times with memory measurement on; report this rank's
    statistics of every run (the first run in fresh processes is the honest memory figure:
    later runs may reuse heap pages the previous run freed)."""
    plan = make_plan(case, model)
    group = migration_group(plan, rank)
    if group is None:
        return None
    old_rank = plan.old.devices.index(rank) if rank in plan.old.devices else None
    old = fake_shards(plan, old_rank) if verify else filled_shards(plan, old_rank)
    options = MigrationOptions(staging_bytes=staging_bytes, overlap=overlap, timeout_s=120,
                               **({"direct_min_bytes": direct_min_bytes}
                                  if direct_min_bytes else {}))
    out: dict = {"rank": rank, "runs": [], "moved_bytes": plan.moved_bytes}
    for _ in range(repeats):
        res = execute_migration(plan, group.transport(), rank, old, options=options)
        out["runs"].append(res.stats.as_dict())
        if verify:
            out["mismatches"] = shard_mismatches(plan, res.new_rank, res.new_shards)
        del res
    return out


def raw_p2p(rank: int, world: int, nbytes: int, src: int = 0, dst: int = 1,
            repeats: int = 5, fresh: bool = False) -> dict | None:
    """Raw gloo ``batch_isend_irecv`` of one contiguous tensor from ``src`` to ``dst``: seconds
    of every repeat. ``fresh``: receive into newly allocated memory each time (as a migration
    does), else into one reused buffer."""
    import torch.distributed as dist

    if rank not in (src, dst):
        return None
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(7)
    seconds = []
    for i in range(repeats):
        if fresh and rank == dst:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        op = dist.isend if rank == src else dist.irecv
        for w in dist.batch_isend_irecv([dist.P2POp(op, buf, dst if rank == src else src,
                                                    tag=100 + i)]):
            w.wait()
        seconds.append(time.perf_counter() - t0)
    return {"rank": rank, "seconds": seconds}

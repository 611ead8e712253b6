"""Planted bugs: ``verify`` must catch a faulty migration, wherever the fault is.

Each case plants one bug into the worker processes (never into the parent, which only
compares), runs the real ``verify_transition`` on real megatron-core state, takes the bug out
again, and asserts that verify reports it: ``verified`` false, the check that saw it, and the
CLI's exit 1 with the tensor (or the step, or the RNG) named on stderr. The bugs sit in each
part of the in-place path:

* the adapter (``state.py``, as the resize calls it): ``local_shards`` reads ``exp_avg``
  where ``exp_avg_sq`` is asked for; ``resume_state`` reports the step before the last one;
* the planner's box math (``plan/boxes.box_offset`` as the program compiler calls it):
  every piece not at the start of its shard is one element off;
* the executor's packing (``migrate/program.compile_program``): a receiving rank unpacks
  the tensor-parallel half it receives where its own half goes, and its own half there;
* the prepared new state (``state.receive_into``, the executor's destinations inside the
  new layout's model and optimizer, built before the pause): exp_avg is received into
  exp_avg_sq and the other way round;
* the install at the switch (``state.finish_install``): the distributed optimizer's moments
  land on the next data-parallel rank (rotated in megatron's bucket space); the CPU
  generator is not installed, so the rank keeps its own stale one.

A last case runs the same pool without a bug: verified, so the plants were taken out.

One pool of 4 worker processes (``LocalWorkers``) serves every case. Planting happens inside
the workers through :func:`plant` / :func:`unplant`, phases defined here (the workers import
this module by name): nothing in slurm-etc's own code knows about them.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from slurm_etc.cli.main import cli
from slurm_etc.harness import verify
from slurm_etc.harness.phases import PRELOAD, Transition
from slurm_etc.plan import PRESETS, ParallelConfig
from slurm_etc.pool.local import LocalWorkers

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

TINY = PRESETS["tiny"]


def P(dp, tp=1, pp=1, dist=False):  # noqa: N802 - reads like the CLI's dp=..,tp=..,pp=..
    return ParallelConfig(dp, tp, pp, distributed_optimizer=dist)


# -- the bugs (each: module, attribute, wrapper of the real function) ------------------------

def _swapped_moment(real: Callable) -> Callable:
    """Adapter: ``local_shards`` hands out exp_avg where exp_avg_sq is asked for."""
    def local_shards(state, catalog, **kwargs):
        shards = real(state, catalog, **kwargs)
        by_key = {sh.key: sh for sh in shards}
        for sh in shards:
            if sh.state_key.startswith("optimizer.state.exp_avg_sq."):
                twin = ("optimizer.state.exp_avg." + sh.state_key.split(".", 3)[3],
                        *sh.key[1:])
                sh.tensor = by_key[twin].tensor
        return shards
    return local_shards


def _stale_step(real: Callable) -> Callable:
    """Adapter: ``resume_state`` reports the step before the last one."""
    def resume_state(state):
        resume = real(state)
        return dataclasses.replace(resume, step=resume.step - 1)
    return resume_state


def _off_by_one(real: Callable) -> Callable:
    """Planner's box math: a piece's position inside its shard is one element early."""
    def box_offset(lo, hi, point):
        pos = real(lo, hi, point)
        return pos - 1 if pos > 0 else pos
    return box_offset


def _swapped_tp_halves(real: Callable) -> Callable:
    """Executor packing: where a new shard is filled partly by a local copy (this rank's old
    tensor-parallel half) and partly by a received message (the other half), each half is
    unpacked at the other one's place."""
    def compile_program(plan, device, *args, **kwargs):
        program = real(plan, device, *args, **kwargs)
        dst = program.local_dst
        local_offsets = dst.offset.copy()
        used: set[int] = set()
        recvs = {}
        for k, side in program.recvs.items():
            segs = side.segs
            offsets = segs.offset.copy()
            for i in range(len(segs)):
                twins = np.flatnonzero((dst.shard == segs.shard[i])
                                       & (dst.sizes == segs.sizes[i]).all(axis=1)
                                       & (dst.strides == segs.strides[i]).all(axis=1)
                                       & (dst.offset != segs.offset[i]))
                twins = [j for j in twins.tolist() if j not in used]
                if twins:
                    j = twins[0]
                    used.add(j)
                    offsets[i], local_offsets[j] = dst.offset[j], segs.offset[i]
            recvs[k] = dataclasses.replace(side, segs=dataclasses.replace(segs, offset=offsets))
        return dataclasses.replace(program, recvs=recvs,
                                   local_dst=dataclasses.replace(dst, offset=local_offsets))
    return compile_program


def _wrong_dp_shard(real: Callable) -> Callable:
    """Install: the distributed optimizer's moments of dp rank d land on dp rank d + 1."""
    def finish_install(state, dest, shards, resume, **kwargs):
        out = real(state, dest, shards, resume, **kwargs)
        _rotate_moments_over_dp(state)
        return out
    return finish_install


def _swapped_destinations(real: Callable) -> Callable:
    """Receive: the executor writes exp_avg shards into the exp_avg_sq tensors of the
    prepared new state and the other way round."""
    def receive_into(state, catalog, specs, kept=(), **kwargs):
        dest = real(state, catalog, specs, kept, **kwargs)
        index = {sp.key: j for j, sp in enumerate(specs)}
        for j, sp in enumerate(specs):
            if sp.state_key.startswith("optimizer.state.exp_avg."):
                twin = ("optimizer.state.exp_avg_sq." + sp.state_key.split(".", 3)[3],
                        *sp.key[1:])
                k = index[twin]
                dest.tensors[j], dest.tensors[k] = dest.tensors[k], dest.tensors[j]
        return dest
    return receive_into


def _rotate_moments_over_dp(state: Any) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for sub in getattr(state.optimizer, "chained_optimizers", None) or [state.optimizer]:
        if not isinstance(sub, DistributedOptimizer):
            continue
        group = sub.data_parallel_group
        size, rank = group.size(), group.rank()
        ranks = dist.get_process_group_ranks(group)
        for gbuf_idx, per_dtype in enumerate(sub.gbuf_ranges):
            for buckets in per_dtype.values():
                for b, ranges in enumerate(buckets):
                    n = sub.buffers[gbuf_idx].buckets[b].grad_data.numel() // size
                    for key in ("exp_avg", "exp_avg_sq"):
                        mine, theirs = torch.zeros(n), torch.empty(n)
                        for param, r in ranges["param_map"].items():
                            tensors = sub._get_main_param_and_optimizer_states(param)
                            mine[r["gbuf_local"].start:r["gbuf_local"].end] = tensors[key]
                        ops = [dist.P2POp(dist.isend, mine, ranks[(rank + 1) % size], group),
                               dist.P2POp(dist.irecv, theirs, ranks[(rank - 1) % size], group)]
                        for work in dist.batch_isend_irecv(ops):
                            work.wait()
                        for param, r in ranges["param_map"].items():
                            tensors = sub._get_main_param_and_optimizer_states(param)
                            tensors[key].copy_(theirs[r["gbuf_local"].start:r["gbuf_local"].end])


def _stale_rng(real: Callable) -> Callable:
    """Install: the new rank keeps the CPU generator it had, not its source rank's."""
    def finish_install(state, dest, shards, resume, **kwargs):
        import torch

        if resume is not None:
            resume = dataclasses.replace(resume, rng=torch.get_rng_state().numpy().tobytes())
        return real(state, dest, shards, resume, **kwargs)
    return finish_install


RESIZE = "slurm_etc.megatron.resize"
PLANTS: dict[str, tuple[str, str, Callable]] = {
    "swapped-moment": (RESIZE, "local_shards", _swapped_moment),
    "stale-step": (RESIZE, "resume_state", _stale_step),
    "off-by-one-region": ("slurm_etc.migrate.program", "box_offset", _off_by_one),
    "swapped-tp-halves": ("slurm_etc.migrate.program", "compile_program", _swapped_tp_halves),
    "wrong-dp-shard": (RESIZE, "finish_install", _wrong_dp_shard),
    "stale-rng": (RESIZE, "finish_install", _stale_rng),
    "swapped-destinations": (RESIZE, "receive_into", _swapped_destinations),
}

_PLANTED: list[tuple[Any, str, Any]] = []  # in a worker: what to restore


def plant(ctx, bug: str) -> str:
    """Worker phase: replace one function, by module and name, with its buggy wrapper."""
    module_name, attr, make = PLANTS[bug]
    module = importlib.import_module(module_name)
    real = getattr(module, attr)
    _PLANTED.append((module, attr, real))
    setattr(module, attr, make(real))
    return f"{module_name}.{attr}"


def unplant(ctx) -> int:
    """Worker phase: put every replaced function back."""
    n = len(_PLANTED)
    while _PLANTED:
        module, attr, real = _PLANTED.pop()
        setattr(module, attr, real)
    return n


# -- the cases --------------------------------------------------------------------------------

RESHAPE = (TINY, P(1, 2, 2), P(2, 1, 2))  # the reviewer's transition: tp 2 -> 1, dp 1 -> 2
TENSOR = "tensor"
# bug: (transition, what verify must report: a tensor matching the pattern, or "step"/"rng")
CASES = {
    "swapped-moment": (RESHAPE, (TENSOR, r"^optimizer\.state\.exp_avg_sq\.")),
    "stale-step": (RESHAPE, ("step", None)),
    "off-by-one-region": (RESHAPE, (TENSOR, r".")),
    "swapped-tp-halves": (RESHAPE, (TENSOR, r".")),
    "wrong-dp-shard": ((TINY, P(4, 1, 1, True), P(2, 1, 1, True)),
                       (TENSOR, r"^optimizer\.state\.exp_avg(_sq)?\.")),
    "stale-rng": (RESHAPE, ("rng", None)),
    "swapped-destinations": (RESHAPE, (TENSOR, r"^optimizer\.state\.exp_avg(_sq)?\.")),
}


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(4, preload=PRELOAD, timeout_s=240) as pool:
        yield pool


def _cli_on(report: dict, monkeypatch) -> Any:
    """The real ``slurm-etc verify`` command, its experiment answering with ``report``."""
    monkeypatch.setattr(verify, "verify_transition", lambda tr, **kw: report)
    return CliRunner().invoke(cli, ["verify", "--model", "tiny", "--from", "dp=1,tp=2,pp=2",
                                    "--to", "dp=2,tp=1,pp=2", "--json"])


@pytest.mark.parametrize("bug", CASES)
def test_planted_bug_is_caught(workers, bug, monkeypatch):
    (model, old, new), (kind, pattern) = CASES[bug]
    planted = workers.run(plant, bug)
    assert len(set(planted)) == 1
    try:
        report = verify.verify_transition(Transition(model, old, new), workers=workers)
    finally:
        assert all(n == 1 for n in workers.run(unplant))
    summary = (report["first_mismatch"], report["step"], report["rng"], report["loss_after"])
    assert report["verified"] is False, summary
    first = report["first_mismatch"]
    if kind == TENSOR:
        assert first is not None and re.search(pattern, first["state_key"]), summary
        assert first["oracle"] == verify.ORACLE_GATHER
        assert report["mismatches"] >= 1
        named = first["state_key"]
    elif kind == "step":
        assert first is None and not report["step"]["ok"], summary
        assert report["step"]["migrated"] == [report["step"]["expected"] - 1]
        named = "Adam step"
    else:
        assert first is None and report["step"]["ok"] and not report["rng"]["ok"], summary
        assert report["rng"]["wrong_ranks"]
        named = "RNG"
    # the CLI: exit 1, the tensor (or step, RNG) named on stderr's last line
    r = _cli_on(report, monkeypatch)
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["verified"] is False
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("slurm-etc: verify: MISMATCH: ") and named in last, last


def test_no_bug_planted_verifies(workers):
    """Control, after the planted cases in the same processes: verified."""
    model, old, new = RESHAPE
    report = verify.verify_transition(Transition(model, old, new), workers=workers)
    assert report["verified"], (report["first_mismatch"], report["step"], report["rng"])

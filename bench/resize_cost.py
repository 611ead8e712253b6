"""The coordinator's own work in one resize, per phase, at 1,024 to 16,384 ranks, in-process.

``slurm-etc bench control`` runs the whole control path with a thread per simulated rank,
which 2 cores cannot hold at 16,384 ranks. This runs, on one thread, the functions the
coordinator's loop calls for the grow, the preemption shrink and the node loss of that
bench's scenario (N/8 nodes of 8 devices, an eighth more granted, ``small`` model,
data-parallel layouts, the same global batch and policy), on a real SQLite record, and
times each phase:

- ``event``: the holdings after the backend's event, and the event recorded
  (``devices.grant/notice/loss``, ``record_observed``);
- ``decide``: the job's snapshot and ``policy.decide`` (the chooser, the vrank allocator and
  the chooser's migration costs);
- ``plan``: ``reconcile.order_resize`` (vranks reserved, the migration planned, the order);
- ``record``: the migration's start, the joiners' launch rows, the events marked handled;
- ``order``: the order sealed to every rank of the old layout (``Sealer.seal``, as
  ``CoordinatorChannel.broadcast`` does; the socket's send is not counted);
- ``commit``: ``reconcile.commit`` and its records (migration finish, old generation closed,
  new one opened with a vrank row per rank), devices released.

What it leaves out: the messages of each rank (Hello, Ready, Resized, Resumed, Exited, the
store's requests), which ``bench control`` measures, and the workers. A garbage collection
that falls inside a phase is counted there (and its seconds printed apart: ``gc``).

Printed per N and resize: each phase's seconds (process CPU; ``--wall`` for the clock),
the total, and the total per rank in microseconds. ``--code DIR`` runs the same scenario on
the slurm_etc of another checkout too (``DIR`` on ``PYTHONPATH``, one process per run,
alternating with this one at each N), so a before/after comparison shares the machine's
load; each resize's decisions (configuration, placement digest, joiners) are printed as a
digest and must be equal on both.

    PYTHONPATH=$PWD .venv/bin/python bench/resize_cost.py [--sizes 1024,4096,16384]
        [--code /work/main] [--repeat 1] [--profile] [--json]
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

SIZES = (1024, 4096, 16384)
PHASES = ("event", "decide", "plan", "record", "order", "commit")
GPUS_PER_NODE = 8
JOB = "bench-resize"


class Clock:
    """Seconds per phase (process CPU and wall), and the collector's time inside them."""

    def __init__(self, profile: Any = None) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.gc_s = 0.0
        self._gc_at = 0.0
        self.profile = profile
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_at = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_at

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        c, w = time.process_time(), time.perf_counter()
        if self.profile is not None:
            self.profile.enable()
        try:
            yield
        finally:
            if self.profile is not None:
                self.profile.disable()
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w

    def close(self) -> None:
        gc.callbacks.remove(self._gc)


def global_batch(ranks: int) -> int:
    """``ControlBench.batch``: every dp the grow, the shrink and the loss give divides it."""
    from slurm_etc import bounds

    grown = ranks + GPUS_PER_NODE * max(1, ranks // GPUS_PER_NODE // 8)
    every = math.lcm(ranks, grown, ranks - GPUS_PER_NODE)
    every = every if every <= bounds.BATCH.high else math.lcm(ranks, grown)
    return every * max(1, -(-64 * ranks // every))


def seal_all(sealer: Any, generation: int, order: Any, vranks: list[int]) -> list[Any]:
    """The order sealed to each rank as ``CoordinatorChannel.broadcast`` does: its body
    encoded once where the checkout's ``Sealer.seal`` takes it (``body=``), else for each."""
    import inspect

    from slurm_etc.protocol.messages import ENCODER

    if "body" not in inspect.signature(sealer.seal).parameters:
        return [sealer.seal(v, generation, order) for v in vranks]
    body = ENCODER.encode(order)
    return [sealer.seal(v, generation, order, body=body) for v in vranks]


def scenario(ranks: int, tmp: Path, clock: Clock) -> dict[str, Any]:
    """The grow, shrink and loss of ``bench control`` at ``ranks``; their phases' seconds and
    a digest of what each decided."""
    from slurm_etc.alloc.chooser import Hardware, TrainingJob
    from slurm_etc.alloc.topology import ClusterTopology, Device
    from slurm_etc.alloc.vranks import identity_layout
    from slurm_etc.coordinator import devices, reconcile
    from slurm_etc.coordinator.reconcile import Commit, Holdings, InflightResize
    from slurm_etc.lifecycle import ResizeOutcome
    from slurm_etc.plan import Topology, load_model
    from slurm_etc.policy.decide import JobView, Notice, ResizeDecision, decide
    from slurm_etc.policy.rules import EffectivePolicy
    from slurm_etc.protocol.channel import Sealer
    from slurm_etc.store import jobs as record

    G = GPUS_PER_NODE
    nodes = ranks // G
    grow_nodes = max(1, nodes // 8)
    model = load_model("small")
    job = TrainingJob(model, global_batch(ranks), 1, False)
    hw = Hardware(gpus_per_node=G)
    policy = EffectivePolicy(grow=False, allowed_tp=(1,), allowed_pp=(1,))
    topo = ClusterTopology(G, tuple(f"n{i}" for i in range(nodes + grow_nodes)))
    on = {n: tuple(Device(n, k) for k in range(G)) for n in topo.nodes}
    pinned = frozenset(on["n0"])
    grown = [d for n in topo.nodes[nodes:] for d in on[n]]
    store = record.open_job_store(JOB, db=tmp / "job.db", state_dir=tmp / "state")
    record.create_job(store, JOB, name="bench", owner_uid=os.getuid(), owner_name="bench",
                      backend="local", model=model.name)
    sealer = Sealer(JOB, os.urandom(32), "coordinator")
    now = time.time()

    def view(h: Holdings) -> JobView:
        layout_vranks = {v: h.vranks[v] for v in h.layout.devices} if h.layout else {}
        by_deadline: dict[tuple[float, str], set[Device]] = {}
        for d, key in h.notices.items():
            if d in h.held:
                by_deadline.setdefault(key, set()).add(d)
        return JobView(now=now, job=job, hardware=hw, topology=topo,
                       held=frozenset(h.held), layout=h.layout, vranks=layout_vranks,
                       notices=tuple(Notice(frozenset(ds), deadline, cause) for
                                     (deadline, cause), ds in sorted(by_deadline.items())),
                       pinned=pinned, partition_nodes=nodes + grow_nodes)

    def observed(kind: str, alloc: str, devs: list[Device], state: str) -> Any:
        names = tuple(dict.fromkeys(d.node for d in devs))
        return record.Observed(kind, f"{kind}:{alloc}:{len(devs)}",
                               {"summary": f"{len(devs)} devices", "allocation": alloc,
                                "devices": [str(d) for d in devs]},
                               None, alloc, state, "member", names)

    # the first layout, not timed
    h = Holdings.nothing()
    h = devices.grant(h, on["n0"], "a0")
    h = devices.grant(h, [d for n in topo.nodes[1:nodes] for d in on[n]], "a1")
    record.record_observed(store, JOB, [observed("grant", "a0", list(on["n0"]), "granted"),
                                        observed("grant", "a1", [d for n in topo.nodes[1:nodes]
                                                                 for d in on[n]], "granted")])
    start = next(a for a in decide(view(h), policy).actions if isinstance(a, ResizeDecision))
    layout = identity_layout(start.config, start.allocation.pool)
    h = replace(h, layout=layout, generation=1, vranks=dict(start.allocation.vranks), step=10)
    record.open_generation(store, JOB, 1, str(layout.config), layout.devices, h.vranks,
                           first_step=1)

    steps: list[tuple[str, Callable[[Holdings], Holdings], Any]] = [
        ("grow", lambda h: devices.grant(h, grown, "a2"),
         observed("grant", "a2", grown, "granted")),
        ("shrink", lambda h: devices.notice(h, grown, now + 600.0),
         observed("preempt-notice", "a2", grown, "preempting")),
        ("loss", lambda h: devices.loss(h, list(on[topo.nodes[nodes - 1]]), "a1", "failure",
                                        now),
         observed("loss", "a1", list(on[topo.nodes[nodes - 1]]), "lost")),
    ]
    out: dict[str, Any] = {}
    for name, event, seen in steps:
        clock.cpu, clock.wall, clock.gc_s = {}, {}, 0.0
        gen = h.generation + 1
        with clock.phase("event"):
            h = event(h)
            ids = record.record_observed(store, JOB, [seen])
        with clock.phase("decide"):
            decision = decide(view(h), policy)
        action = next(a for a in decision.actions if isinstance(a, ResizeDecision))
        with clock.phase("plan"):
            got = reconcile.order_resize(
                h, job_id=JOB, generation=gen, config=action.config,
                pool=action.allocation.vranks, deadline=action.deadline,
                reason=action.reason, now=now, model=model,
                topology=Topology(G, hw.intra_node_gbps, hw.inter_node_gbps),
                gpus_per_node=G, can_rebuild=False, prepare_while_training=False,
                longest_aside_s=None, first_aside_grace_s=0.0, step_s=None)
        plan, old = got.plan, h.layout
        assert old is not None
        with clock.phase("record"):
            mid = record.record_migration_start(
                store, JOB, from_generation=h.generation, to_generation=gen,
                plan_digest=got.order.plan_digest, moved_bytes=plan.moved_bytes,
                kept_bytes=plan.kept_bytes, lower_bound_bytes=plan.lower_bound_moved_bytes,
                messages=len(plan.messages), rounds=plan.rounds,
                estimated_seconds=plan.est_seconds)
            joiners = sorted(got.joiners)
            if joiners:
                launch = record.record_observed(store, JOB, [
                    record.Observed("launch", f"launch:g{gen}:v{v}:{1000 + v}:{now}",
                                    {"summary": f"vrank {v} on {got.vranks[v]}: pid {1000 + v}",
                                     "vrank": v, "generation": gen,
                                     "device": str(got.vranks[v]), "pid": 1000 + v,
                                     "start": now})
                    for v in joiners], source="coordinator")
                record.mark_events_handled(store, launch, "launched")
            record.mark_events_handled(store, ids, decision.reason[:200])
        fl = InflightResize(got.order, plan, mid, got.participants, got.joiners, got.vranks,
                            frozenset(), time.monotonic(),
                            stayers=frozenset(set(old.devices) - set(got.order.lost)),
                            rebuild=got.rebuild, decided_at=now, step_at_launch=h.step)
        with clock.phase("order"):
            sealed = seal_all(sealer, gen, got.order, sorted(fl.stayers))
        with clock.phase("commit"):
            after, effects = reconcile.commit(h, fl, Commit(0.5, 0.2, None, None), 1.0)
            for effect in effects:
                match effect:
                    case reconcile.RecordFinish():
                        record.record_migration_finish(
                            store, effect.migration_id, outcome=ResizeOutcome.COMMITTED,
                            measured_seconds=effect.measured_seconds,
                            pause_seconds=effect.pause_seconds)
                    case reconcile.CloseGeneration():
                        record.close_generation(store, JOB, effect.generation,
                                                reason=effect.reason,
                                                last_step=effect.last_step)
                    case reconcile.OpenGeneration():
                        record.open_generation(store, JOB, effect.generation,
                                               str(effect.layout.config),
                                               effect.layout.devices, effect.vranks,
                                               first_step=effect.first_step)
            free = devices.to_release(after, set(), pinned)
            if free:
                record.set_device_state(store, JOB, sorted(free), "released")
                after = devices.released(after, free)
        h = after
        what = (str(action.config), plan.assignment, tuple(joiners), got.order.plan_digest,
                tuple(sorted((v, str(d)) for v, d in got.vranks.items())), plan.moved_bytes,
                plan.lower_bound_moved_bytes, len(sealed), decision.reason)
        out[name] = {"cpu": dict(clock.cpu), "wall": dict(clock.wall), "gc_s": clock.gc_s,
                     "config": str(action.config), "joiners": len(joiners),
                     "stayers": len(fl.stayers), "sketch": plan.stats.get("sketch"),
                     "digest": hashlib.sha256(repr(what).encode()).hexdigest()[:16]}
    store.close()
    return out


def run_here(ranks: int, repeat: int, profile: bool) -> dict[str, Any]:
    """The scenario ``repeat`` times in this process (the best of each phase kept), each on a
    fresh record."""
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
    best: dict[str, Any] = {}
    for _ in range(repeat):
        clock = Clock(prof)
        with tempfile.TemporaryDirectory(prefix="etc-resize-cost-") as tmp:
            got = scenario(ranks, Path(tmp), clock)
        clock.close()
        for name, r in got.items():
            b = best.setdefault(name, r)
            if b is not r:
                if b["digest"] != r["digest"]:
                    raise SystemExit(f"{ranks} ranks, {name}: two runs decided differently")
                for k in ("cpu", "wall"):
                    b[k] = {p: min(b[k][p], r[k][p]) for p in b[k]}
    if prof is not None:
        import pstats
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
    import slurm_etc
    return {"ranks": ranks, "code": str(Path(slurm_etc.__file__).parent.parent),
            "resizes": best}


def run_there(code: str, ranks: int, repeat: int) -> dict[str, Any]:
    """:func:`run_here` in a child process with ``code`` first on ``PYTHONPATH``."""
    env = {**os.environ, "PYTHONPATH": code}
    got = subprocess.run([sys.executable, __file__, "--child", str(ranks), "--repeat",
                          str(repeat)], env=env, capture_output=True, text=True)
    if got.returncode:
        raise SystemExit(f"{code} at {ranks} ranks failed:\n{got.stderr[-3000:]}")
    return json.loads(got.stdout)


def show(row: dict[str, Any], clock: str, label: str) -> None:
    for name, r in row["resizes"].items():
        t = r[clock]
        total = sum(t.values())
        print(f"{row['ranks']:>7,} {label:>8} {name:>7}  " +
              "  ".join(f"{t.get(p, 0.0):>7.3f}" for p in PHASES) +
              f"  {total:>7.3f}  {1e6 * total / row['ranks']:>8.1f}  {r['gc_s']:>6.3f}  "
              f"{r['digest']}  {r['config']} ({r['sketch']})", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)),
                   help="comma-separated rank counts, multiples of 8 (default %(default)s)")
    p.add_argument("--code", action="append", default=[],
                   help="another checkout's root to run the same scenario on (repeatable)")
    p.add_argument("--repeat", type=int, default=1, help="runs per size (best phase kept)")
    p.add_argument("--wall", action="store_true", help="print wall seconds, not CPU")
    p.add_argument("--profile", action="store_true", help="cProfile of the phases, on stderr")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_here(args.child, args.repeat, False)))
        return 0
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        print(f"--sizes: comma-separated integers, not {args.sizes!r}", file=sys.stderr)
        return 2
    if any(n < 16 or n % GPUS_PER_NODE for n in sizes):
        print(f"--sizes: multiples of {GPUS_PER_NODE} of at least 16", file=sys.stderr)
        return 2
    here = str(Path(__file__).resolve().parent.parent)
    clock = "wall" if args.wall else "cpu"
    rows = []
    if not args.json:
        print(f"{'ranks':>7} {'code':>8} {'resize':>7}  " +
              "  ".join(f"{p:>7}" for p in PHASES) +
              f"  {'total s':>7}  {'us/rank':>8}  {'gc s':>6}  digest            config"
              f"   ({clock} seconds)")
    for n in sizes:
        for i, code in enumerate([*args.code, here]):
            if not args.code:  # else each checkout in a process of its own, alike
                row = run_here(n, args.repeat, args.profile)
            else:
                row = run_there(code, n, args.repeat)
            row["label"] = "this" if code == here else f"code{i}"
            rows.append(row)
            if not args.json:
                show(row, clock, row["label"])
        if args.code and not args.json:
            mine = rows[-1]["resizes"]
            for other in rows[-1 - len(args.code):-1]:
                for name, r in other["resizes"].items():
                    if r["digest"] != mine[name]["digest"]:
                        print(f"  DIFFERENT DECISION at {n} ranks, {name}: {other['code']} "
                              f"{r['digest']} vs {mine[name]['digest']}", flush=True)
    if args.json:
        print(json.dumps({"clock": "process CPU seconds per phase (wall in 'wall')",
                          "phases": PHASES, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

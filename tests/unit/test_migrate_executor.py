"""The executor in one process: every device a thread on ThreadTransport (no torch.distributed).

Fast checks of the protocol over many plans and of everything that is not about processes:
input validation, the vote record, disagreeing ranks, fault points, statistics.
"""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from slurm_etc.migrate.executor import (
    VOTE_BYTES,
    MigrationAborted,
    MigrationOptions,
    _decode_vote,
    _encode_vote,
    agree,
    execute_migration,
)
from slurm_etc.migrate.faults import FAULT_POINTS, FaultInjector
from slurm_etc.migrate.program import compile_program, group_devices
from slurm_etc.migrate.shards import LocalShard, shard_specs
from slurm_etc.migrate.threads import run_threads
from slurm_etc.migrate.transport import ThreadHub
from slurm_etc.plan import PRESETS
from slurm_etc.testing.fake_state import fake_shards, global_tensor, shard_mismatches, spec_values
from tests.unit.plan_helpers import cut, make_plan

TINY_BF16 = dataclasses.replace(PRESETS["tiny"], param_dtype="bf16")
LLAMA_BF16 = dataclasses.replace(PRESETS["tiny-llama"], param_dtype="bf16")
OPTS = MigrationOptions(measure_memory=False, timeout_s=20)


def _old_state(plan, seed=0):
    return {d: fake_shards(plan, r, seed=seed) for r, d in enumerate(plan.old.devices)}


def _bits(t):
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()]).clone()


def _snapshot(old):
    return {d: [_bits(sh.tensor) for sh in shards] for d, shards in old.items()}


def _unchanged(old, snap):
    return all(torch.equal(_bits(sh.tensor), b)
               for d, shards in old.items() for sh, b in zip(shards, snap[d]))


def _committed(plan, results):
    for d, res in results.items():
        assert not isinstance(res, BaseException), f"device {d}: {res}"
        assert shard_mismatches(plan, res.new_rank, res.new_shards) == [], d
        assert res.departing == (d not in plan.new.devices)


@pytest.mark.parametrize("model", [PRESETS["tiny"], TINY_BF16, LLAMA_BF16],
                         ids=["tiny", "tiny-bf16", "llama-bf16"])
@pytest.mark.parametrize("dist", [False, True], ids=["", "distopt"])
@pytest.mark.parametrize("old,new", [((1, 2, 2), (2, 2, 2)), ((2, 2, 2), (2, 1, 2)),
                                     ((4, 1, 1), (1, 4, 1)), ((1, 1, 4), (2, 2, 1))])
@pytest.mark.parametrize("direct_min", [256 << 10, 512], ids=["staged", "direct"])
def test_threads_deliver_every_new_shard(model, dist, old, new, direct_min):
    plan = make_plan(model, old, new, dist=dist)
    state = _old_state(plan)
    snap = _snapshot(state)
    results = run_threads(plan, state,
                          options=dataclasses.replace(OPTS, direct_min_bytes=direct_min))
    _committed(plan, results)
    assert _unchanged(state, snap)
    stats = [r.stats for r in results.values()]
    assert sum(s.sent_bytes for s in stats) == sum(s.received_bytes for s in stats) \
        == plan.moved_bytes
    assert sum(s.local_bytes for s in stats) == plan.kept_bytes


def test_old_and_new_devices_may_be_disjoint():
    """Every old process departs, every new one joins empty: all state moves."""
    plan = make_plan(LLAMA_BF16, (2, 2, 1), (1, 2, 2), dist=True, gpn=4, add=1, drop=(0,))
    assert set(plan.old.devices).isdisjoint(plan.new.devices)
    results = run_threads(plan, _old_state(plan), options=OPTS)
    _committed(plan, results)
    assert plan.moved_bytes == plan.needed_bytes
    assert all(r.departing for d, r in results.items() if d in plan.old.devices)


def test_fake_values_are_the_global_tensor_slices():
    """The fake state generator agrees with cutting the materialised global tensor."""
    plan = make_plan(LLAMA_BF16, (2, 1, 2), (2, 1, 2), dist=True)
    for sp in shard_specs(plan.catalog, plan.old_regions, 3)[::7]:
        full = global_tensor(plan.catalog, sp.group, sp.state_key)
        want = cut(full.numpy() if full.dtype != torch.bfloat16 else full.view(torch.int16).numpy(),
                   sp.lo, sp.hi, sp.s, sp.e)
        got = spec_values(plan.catalog, sp)
        got = got.view(torch.int16) if got.dtype == torch.bfloat16 else got
        assert (got.numpy() == want).all()
        assert got.dtype in (torch.float32, torch.int16)


def test_chunked_and_not_overlapped_give_the_same_state():
    plan = make_plan(TINY_BF16, (2, 2, 2), (2, 1, 2), dist=True)
    state = _old_state(plan)
    for opts in (dataclasses.replace(OPTS, staging_bytes=4 * 8191),
                 dataclasses.replace(OPTS, staging_bytes=4 * 8191, overlap=False),
                 dataclasses.replace(OPTS, staging_bytes=4 * 8191, direct_min_bytes=1000),
                 dataclasses.replace(OPTS, staging_bytes=4 * 8191, direct_min_bytes=1000,
                                     overlap=False)):
        results = run_threads(plan, state, options=opts)
        _committed(plan, results)
        direct = sum(r.stats.direct_bytes for r in results.values())
        assert (direct > 0) == (opts.direct_min_bytes == 1000)
        steps = {r.stats.steps for r in results.values()}
        assert len(steps) == 1 and steps.pop() > plan.rounds
        assert all(r.stats.staging_bytes <= opts.staging_bytes for r in results.values())


def test_vote_record_round_trips():
    v = _encode_vote(2, 17, 4099, 2**62 + 5, "rank 3 (device 3) failed: ü" + "x" * 1000)
    assert v.dtype == torch.uint8 and v.numel() == VOTE_BYTES
    status, step, chunk, digest, text = _decode_vote(v)
    assert (status, step, chunk, digest) == (2, 17, 4099, 2**62 + 5)
    assert text.startswith("rank 3 (device 3) failed: ü") and len(text.encode()) <= VOTE_BYTES


@pytest.mark.parametrize("agreed", [False, True], ids=["gated", "agreed"])
@pytest.mark.parametrize("at", FAULT_POINTS)
def test_every_fault_point_aborts_every_rank(at, agreed):
    plan = make_plan(TINY_BF16, (2, 2, 2), (2, 1, 2), dist=True)
    state = _old_state(plan)
    snap = _snapshot(state)
    rnd = 1 if at in ("before", "pack") else 0
    # 'unpack' needs a rank that receives in round 0: device 2 (new rank 2) does
    rank = 2 if at == "unpack" else 4
    assert at != "unpack" or any(int(plan.messages.dst[k]) == 2 and int(plan.messages.round[k]) == 0
                                 for k in range(len(plan.messages)))
    results = run_threads(plan, state, options=OPTS, faults=FaultInjector().fail(rank, at, rnd),
                          agreed=agreed)
    votes = set()
    for d, res in results.items():
        assert isinstance(res, MigrationAborted), f"device {d} committed"
        assert [f.rank for f in res.failures] == [rank]
        new_rank = plan.new.devices.index(rank) if rank in plan.new.devices else None
        assert f"rank {rank} (device {rank}, old rank {rank}, new rank {new_rank})" in str(res)
        # without the gate a rank that could not start posts nothing: it votes a transport
        # failure so that no peer waits on its operations
        assert res.transport_failed == (agreed and at == "start")
        votes.add(res.vote)
    assert len(votes) == 1
    assert _unchanged(state, snap)


@pytest.mark.parametrize("agreed", [False, True], ids=["gated", "agreed"])
@pytest.mark.parametrize("at", ["pack", "before", "local", "unpack", "after"])
def test_a_failed_rank_keeps_posting_so_an_abort_leaves_no_message_behind(at, agreed):
    """Votes travel with the data: the rank that failed still posts its operations (not
    packed, not unpacked) until the vote carrying its failure, so every message any rank
    sent was received when all have aborted, and all stopped at the same vote."""
    plan = make_plan(TINY_BF16, (2, 2, 2), (2, 1, 2), dist=True)
    opts = dataclasses.replace(OPTS, staging_bytes=4 * 8191)
    # device 2 receives in rounds 0 and 1 (from 5 and 6): the failure is voted while a peer
    # still sends to it (pack/before of round 1 at round 1's first vote, the others within
    # or right after round 0)
    rank, rnd = 2, (1 if at in ("pack", "before") else 0)
    state = _old_state(plan)
    faults = FaultInjector().fail(rank, at, rnd)
    out, hub = _on_threads(plan, lambda device, transport: execute_migration(
        plan, transport, device, state.get(device, ()), options=opts, faults=faults,
        agreed=agreed))
    assert all(isinstance(res, MigrationAborted) for res in out.values()), out
    assert len({res.vote for res in out.values()}) == 1
    assert min(res.vote for res in out.values()) < max(r.stats.steps for r in out.values())
    left = {key: box.qsize() for key, box in hub._boxes.items() if box.qsize()}
    assert left == {}, f"messages sent and never received (src, dst, step): {left}"


def test_stalled_sender_times_out_with_the_message_named():
    plan = make_plan(TINY_BF16, (2, 2, 2), (2, 1, 2), dist=True)
    m = plan.messages
    k = int(m.round.argmin())
    src, dst = int(m.src[k]), int(m.dst[k])
    results = run_threads(plan, _old_state(plan),
                          options=dataclasses.replace(OPTS, timeout_s=0.3, vote_timeout_s=10),
                          faults=FaultInjector().stall(src, int(m.round[k])))
    for res in results.values():
        assert isinstance(res, MigrationAborted) and res.transport_failed
        assert f"timed out receiving message {k} (device {src} -> device {dst}" in str(res)


def _on_threads(plan, run):
    """``run(device, transport)`` on one thread per rank of the plan's migration group (a
    ThreadHub's transports); per device its result or the exception it raised, and the hub."""
    devices = group_devices(plan)
    hub = ThreadHub(len(devices))
    transports = hub.transports()
    out = {}

    def work(rank, device):
        try:
            out[device] = run(device, transports[rank])
        except BaseException as exc:  # noqa: BLE001
            out[device] = exc

    threads = [threading.Thread(target=work, args=(r, d)) for r, d in enumerate(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(out) == set(devices), out  # every rank ended (no thread hung)
    return out, hub


def _run_manual(plan, states, options_of, faults=None):
    """Like run_threads, with per-device options."""
    return _on_threads(plan, lambda device, transport: execute_migration(
        plan, transport, device, states.get(device, ()), options=options_of(device),
        faults=faults))[0]


def test_ranks_with_different_staging_budgets_abort_at_the_first_vote():
    plan = make_plan(TINY_BF16, (1, 2, 2), (2, 2, 2), dist=True)
    out = _run_manual(plan, _old_state(plan), lambda d: dataclasses.replace(
        OPTS, staging_bytes=4 * 4096 if d == 2 else 4 * 8192))
    for res in out.values():
        assert isinstance(res, MigrationAborted) and res.vote == 0
        assert "disagree on the chunk size" in str(res)


def test_agree_names_ranks_with_different_programs_before_the_pause():
    """``agree`` (run by prepare_resize while the job trains) refuses what vote 0 would
    abort; ranks that agreed run the data phase without the gate and commit."""
    plan = make_plan(TINY_BF16, (1, 2, 2), (2, 2, 2), dist=True)
    for budgets, ok in (({}, True), ({2: 4 * 4096}, False)):

        def run(device, transport, budgets=budgets):
            opts = dataclasses.replace(OPTS, staging_bytes=budgets.get(device, 4 * 8192))
            prog = compile_program(plan, device, opts.staging_bytes, opts.direct_min_bytes)
            agree(transport, prog, 10)
            return execute_migration(plan, transport, device, _old_state(plan).get(device, ()),
                                     options=opts, program=prog, agreed=True)

        out, _ = _on_threads(plan, run)
        if ok:
            _committed(plan, out)
        else:
            for res in out.values():
                assert isinstance(res, ValueError), res
                assert "compiled different programs" in str(res) and "chunk 4096" in str(res)


def _broken_state(plan, device, edit):
    state = _old_state(plan)
    state[device] = edit(state[device])
    return state


@pytest.mark.parametrize("edit,match", [
    (lambda shards: shards[1:], "was not given it"),
    (lambda shards: [dataclasses.replace(shards[0], tensor=shards[0].tensor[:-1])] + shards[1:],
     "elements of 4 bytes, the plan says"),
    (lambda shards: [dataclasses.replace(shards[0], tensor=shards[0].tensor.double())] + shards[1:],
     "elements of 8 bytes"),
    (lambda shards: [dataclasses.replace(
        shards[0], tensor=torch.stack([shards[0].tensor, shards[0].tensor], 1)[:, 0])] + shards[1:],
     "not contiguous"),
    (lambda shards: shards + [dataclasses.replace(shards[0], s=shards[0].s + 1)],
     "does not place on it"),
    (lambda shards: shards + [shards[0]], "given twice"),
], ids=["missing", "short", "wrong-dtype", "strided", "extra", "twice"])
@pytest.mark.parametrize("agreed", [False, True], ids=["gated", "agreed"])
def test_bad_old_state_aborts_everywhere_before_anything_moves(edit, match, agreed):
    plan = make_plan(PRESETS["tiny"], (2, 1, 2), (1, 2, 2))
    results = run_threads(plan, _broken_state(plan, 1, edit), options=OPTS, agreed=agreed)
    for res in results.values():
        assert isinstance(res, MigrationAborted) and res.vote == 0, res
        assert "rank 1 (device 1, old rank 1, new rank" in str(res)
        assert "could not start" in str(res) and match in str(res)


def test_unknown_state_keys_are_ignored():
    plan = make_plan(PRESETS["tiny"], (2, 1, 2), (1, 2, 2))
    state = _old_state(plan)
    state[0] = state[0] + [LocalShard("rng_state", (0, 0, 0), (1, 1, 1), 0, torch.zeros(1))]
    _committed(plan, run_threads(plan, state, options=OPTS))


def test_new_shards_take_requested_dtypes():
    plan = make_plan(PRESETS["tiny"], (2, 1, 2), (1, 2, 2))
    key = "decoder.final_layernorm.weight"  # int32 has 4 bytes too: the bytes arrive as int32
    results = run_threads(plan, _old_state(plan),
                          options=dataclasses.replace(OPTS, dtypes={key: torch.int32}))
    for res in results.values():
        for sh in res.new_shards:
            assert sh.tensor.dtype == (torch.int32 if sh.state_key == key else torch.float32)
    bad = run_threads(plan, _old_state(plan),
                      options=dataclasses.replace(OPTS, dtypes={key: torch.float64}))
    assert all(isinstance(r, MigrationAborted) and "8 bytes per element" in str(r)
               for r in bad.values())


def _vm_hwm_bytes():
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def test_memory_and_throughput_are_reported():
    plan = make_plan(PRESETS["tiny"], (1, 2, 2), (2, 2, 2))
    # Raise the process's RSS high-water mark far above what this tiny migration needs, then
    # free the memory: a peak measured from a reset high-water mark stays below that mark;
    # one that could not be reset cannot.
    ballast = torch.ones(64 * 2**20 // 4)
    inflated = _vm_hwm_bytes()
    del ballast
    options = dataclasses.replace(OPTS, measure_memory=True)
    results = run_threads(plan, _old_state(plan), options=options)
    for res in results.values():
        s = res.stats
        assert s.memory_reset == (s.memory_peak < inflated), (s.memory_peak, inflated)
        assert s.memory_peak_delta == s.memory_peak - s.memory_base
        new_bytes = sum(sh.tensor.numel() * sh.tensor.element_size() for sh in res.new_shards)
        assert s.new_state_bytes == new_bytes > 0
        assert s.staging_budget == options.staging_bytes
        assert s.memory_bound == new_bytes + options.staging_bytes
        assert s.peak_over_bound == s.memory_peak_delta / s.memory_bound
        assert s.data_seconds > 0 and s.total_seconds >= s.data_seconds
        m = plan.messages
        assert s.sent_bytes == int(m.nbytes[m.src == res.device].sum())
        assert s.received_bytes == int(m.nbytes[m.dst == res.device].sum())
        moved = s.sent_bytes + s.received_bytes
        assert moved > 0
        assert s.throughput_gibps == pytest.approx(moved / s.data_seconds / 2**30)
        d = s.as_dict()
        assert (d["memory_bound"], d["peak_over_bound"], d["throughput_gibps"]) == (
            s.memory_bound, s.peak_over_bound, s.throughput_gibps)


def _prepared(plan, options=OPTS):
    from slurm_etc.migrate.executor import allocate_destinations
    from slurm_etc.migrate.program import compile_program

    return {d: allocate_destinations(compile_program(plan, d, options.staging_bytes,
                                                     options.direct_min_bytes), options)
            for d in group_devices(plan)}


@pytest.mark.parametrize("dist", [False, True], ids=["", "distopt"])
def test_prepared_destinations_receive_the_new_shards_in_place(dist):
    """Tensors allocated (and touched) before the pause become the new shards: no copy."""
    plan = make_plan(PRESETS["tiny"], (1, 2, 2), (2, 1, 2), dist=dist)
    dests = _prepared(plan)
    assert all(bool((t.view(torch.uint8) == 0).all())
               for ts in dests.values() for t in ts if t is not None)
    results = run_threads(plan, _old_state(plan), options=OPTS, destinations=dests)
    _committed(plan, results)
    for d, res in results.items():
        assert [sh.tensor.data_ptr() for sh, t in zip(res.new_shards, dests[d])
                if t is not None] == [t.data_ptr() for t in dests[d] if t is not None]


@pytest.mark.parametrize("prepared", [False, True], ids=["fresh", "prepared"])
def test_replicas_that_stay_are_kept_whole_not_copied(prepared):
    """dp 2 -> 4: the two staying devices' new shards are their old ones (no copy, no
    destination); the joining devices receive everything. A tp change keeps nothing whole."""
    from slurm_etc.migrate.program import compile_program

    plan = make_plan(PRESETS["tiny"], (2, 1, 1), (4, 1, 1))
    state = _old_state(plan)
    progs = {d: compile_program(plan, d) for d in group_devices(plan)}
    staying = set(plan.old.devices) & set(plan.new.devices)
    assert staying
    for d, prog in progs.items():
        assert len(prog.kept) == (len(prog.new_specs) if d in staying else 0)
    results = run_threads(plan, state, options=OPTS,
                          destinations=_prepared(plan) if prepared else None)
    _committed(plan, results)
    for d in staying:
        res = results[d]
        old_ptrs = {sh.key: sh.tensor.data_ptr() for sh in state[d]}
        assert all(sh.tensor.data_ptr() == old_ptrs[sh.key] for sh in res.new_shards)
        assert res.stats.kept_whole_bytes == res.stats.new_state_bytes > 0
    # tp 2 -> 1: a kept half is part of a new full tensor, copied (only what tp replicates,
    # such as norms, stays whole)
    tp = make_plan(PRESETS["tiny"], (1, 2, 2), (2, 1, 2))
    stats = [compile_program(tp, d).stats for d in group_devices(tp)]
    assert sum(s["kept_whole_bytes"] for s in stats) < sum(s["local_bytes"] for s in stats)


@pytest.mark.parametrize("bad", [None, "short", "missing"])
def test_prepared_staging_is_used_or_refused_everywhere(bad):
    """Staging buffers allocated (and touched) before the pause are the ones packed and
    received into; buffers that do not fit abort the migration on every rank, naming them."""
    from slurm_etc.migrate.executor import allocate_staging
    from slurm_etc.migrate.program import compile_program

    # a small staging budget: several chunks, every buffer used
    opts = dataclasses.replace(OPTS, staging_bytes=1 << 16, direct_min_bytes=1 << 30)
    plan = make_plan(TINY_BF16, (1, 2, 2), (2, 1, 2))
    progs = {d: compile_program(plan, d, opts.staging_bytes, opts.direct_min_bytes)
             for d in group_devices(plan)}
    hub = ThreadHub(len(progs))
    staging = {d: allocate_staging(p, opts, hub.transports()[0]) for d, p in progs.items()}
    victim = plan.new.devices[0]
    if bad == "short":
        staging[victim][1][0] = staging[victim][1][0][:-1]
    elif bad == "missing":
        staging[victim] = (staging[victim][0][:1], staging[victim][1])
    state = _old_state(plan)
    out, _ = _on_threads(plan, lambda device, transport: execute_migration(
        plan, transport, device, state.get(device, []), options=opts,
        program=progs[device], staging=staging[device]))
    if bad is None:
        _committed(plan, out)
        assert all(res.stats.steps > 2 for res in out.values())
        used = [bool(b.any()) for s, r in staging.values() for b in s + r]
        assert used and all(used)  # every prepared buffer carried data
        return
    assert all(isinstance(r, MigrationAborted) for r in out.values()), out
    assert "could not start" in str(out[plan.old.devices[0]])
    assert "staging buffers" in str(out[plan.old.devices[0]])


@pytest.mark.parametrize("bad", ["short", "strided", "count"])
def test_unfit_destinations_abort_everywhere_naming_the_shard(bad):
    plan = make_plan(PRESETS["tiny"], (1, 2, 2), (2, 1, 2))
    dests = _prepared(plan)
    victim = plan.new.devices[1]
    if bad == "short":
        dests[victim][0] = dests[victim][0][:-1]
    elif bad == "strided":
        t = dests[victim][0]
        dests[victim][0] = torch.empty(2 * t.numel(), dtype=t.dtype)[::2]
    else:
        dests[victim] = dests[victim][:-1]
    state = _old_state(plan)
    snap = _snapshot(state)
    results = run_threads(plan, state, options=OPTS, destinations=dests)
    assert all(isinstance(r, MigrationAborted) for r in results.values()), results
    text = str(results[plan.old.devices[0]])
    assert "could not start" in text
    assert ("destination tensors for" if bad == "count" else "destination of") in text
    assert _unchanged(state, snap)

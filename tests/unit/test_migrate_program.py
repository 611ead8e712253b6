"""Pure tests of the executor's packing and chunking math (numpy only, no torch).

The simulator here plays a whole migration with numpy byte arrays and
``numpy.lib.stride_tricks.as_strided`` views, from the same compiled programs the executor
runs, so the packing format, the chunking and the per-layer shard split are checked without
torch or processes.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

from slurm_etc.migrate.program import (
    STAGING_BUFFERS,
    Segments,
    chunk_bytes_for,
    chunk_range,
    compile_program,
    group_devices,
    num_chunks,
)
from slurm_etc.migrate.shards import rank_rows, shard_specs, state_bytes
from slurm_etc.plan import PRESETS
from slurm_etc.plan.boxes import box_strides
from tests.unit.plan_helpers import make_plan

TINY_BF16 = dataclasses.replace(PRESETS["tiny"], param_dtype="bf16")
LLAMA_BF16 = dataclasses.replace(PRESETS["tiny-llama"], param_dtype="bf16")


# -- chunk math ------------------------------------------------------------------------------

def test_chunk_math():
    assert chunk_bytes_for(256 << 20) == (256 << 20) // STAGING_BUFFERS
    assert chunk_bytes_for(4) == 1
    with pytest.raises(ValueError, match="at least 4 bytes"):
        chunk_bytes_for(3)
    assert num_chunks(10, 4) == 3 and num_chunks(8, 4) == 2 and num_chunks(1, 4) == 1
    assert [chunk_range(10, 4, j) for j in range(3)] == [(0, 4), (4, 8), (8, 10)]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_pieces_cover_a_chunk_exactly_in_stream_order(data):
    """Any chunk [c0, c1) of a stream of strided segments maps to views that, concatenated,
    are exactly those bytes of the stream (cuts inside rows and inside elements included)."""
    n_seg = data.draw(st.integers(1, 4))
    buf = np.arange(4096, dtype=np.int64).astype(np.uint8) ^ 0x5A
    rows, stream, pos = [], [], 0
    for _ in range(n_seg):
        ext = [data.draw(st.integers(1, 4)) for _ in range(3)]
        pad = [data.draw(st.integers(0, 3)) for _ in range(3)]
        full = [e + p for e, p in zip(ext, pad)]
        strides = box_strides((0, 0, 0), full)
        offset = data.draw(st.integers(0, 64))
        view = as_strided(buf[offset:], shape=ext, strides=strides)
        rows.append((0, offset, *ext, *strides, pos, int(np.prod(ext))))
        stream.append(view.reshape(-1).copy())
        pos += int(np.prod(ext))
    a = np.array(rows, np.int64)
    segs = Segments(a[:, 0], a[:, 1], a[:, 2:5], a[:, 5:8], a[:, 8], a[:, 9])
    stream = np.concatenate(stream)
    c0 = data.draw(st.integers(0, pos - 1))
    c1 = data.draw(st.integers(c0 + 1, pos))
    out = np.full(c1 - c0, -1, np.int64)
    for _shard, off, sizes, strides, p in segs.pieces(c0, c1):
        n = int(np.prod(sizes))
        assert (out[p:p + n] == -1).all(), "pieces overlap"
        out[p:p + n] = as_strided(buf[off:], shape=sizes, strides=strides).reshape(-1)
    assert (out == stream[c0:c1]).all()


# -- shard specs -----------------------------------------------------------------------------

def test_shard_specs_split_stacked_rows_per_layer():
    plan = make_plan(TINY_BF16, (1, 2, 2), (2, 2, 2))
    specs = shard_specs(plan.catalog, plan.old_regions, 0)
    assert specs == sorted(specs, key=lambda s: (s.state_key, s.lo, s.s))
    for sp in specs:
        g = plan.catalog.groups[sp.group]
        if g.stacked:
            assert sp.hi[0] == sp.lo[0] + 1
            assert sp.lo[0] in (0, 1)  # stage 0 of pp=2 holds layers 0 and 1
        assert sp.itemsize == next(s.itemsize for s in g.states if s.key == sp.state_key)
    layers = {sp.lo[0] for sp in specs if sp.state_key.endswith("linear_qkv.weight")}
    assert layers == {0, 1}
    assert shard_specs(plan.catalog, plan.old_regions, None) == []
    # bytes add up to the rank's rows times bytes per element
    tab = plan.old_regions
    rows = rank_rows(tab, 0)
    bpe = np.array([g.bytes_per_element for g in plan.catalog.groups])
    assert state_bytes(specs) == int((tab.count[rows] * bpe[tab.group[rows]]).sum())


def test_distributed_optimizer_specs_are_per_layer_intervals():
    plan = make_plan(PRESETS["tiny"], (2, 1, 2), (2, 1, 2), dist=True)
    specs = shard_specs(plan.catalog, plan.old_regions, 1)
    dist = [sp for sp in specs if sp.state_key.startswith("optimizer.")]
    assert dist and all(plan.catalog.groups[sp.group].dist for sp in dist)
    assert any(sp.s > 0 or sp.e < np.prod(np.subtract(sp.hi, sp.lo)) for sp in dist)


# -- whole migrations in numpy -------------------------------------------------------------

def _global_bytes(plan, seed):
    """A random byte array per state: shape (*shape3, itemsize)."""
    rng = np.random.default_rng(seed)
    out = {}
    for g in plan.catalog.groups:
        shape3 = tuple(g.shape) + (1,) * (3 - len(g.shape))
        for s in g.states:
            out[s.key] = rng.integers(0, 256, size=(*shape3, s.itemsize), dtype=np.uint8)
    return out


def _cut(glob, lo, hi, s, e):
    box = glob[tuple(slice(a, b) for a, b in zip(lo, hi))]
    return box.reshape(-1, glob.shape[-1])[s:e].reshape(-1).copy()


def _view(buf, off, sizes, strides):
    return as_strided(buf[off:], shape=sizes, strides=strides)


def simulate(plan, staging, seed=0):
    """Run every device's program with numpy; returns (new shard bytes per device, programs)."""
    glob = _global_bytes(plan, seed)
    progs = {d: compile_program(plan, d, staging) for d in group_devices(plan)}
    old = {d: [_cut(glob[sp.state_key], sp.lo, sp.hi, sp.s, sp.e) for sp in p.old_specs]
           for d, p in progs.items()}
    new = {d: [np.zeros(sp.nbytes, np.uint8) for sp in p.new_specs] for d, p in progs.items()}
    streams = {}
    for d, p in progs.items():
        for i in range(len(p.local_src)):
            src = _view(old[d][p.local_src.shard[i]], p.local_src.offset[i],
                        tuple(p.local_src.sizes[i]), tuple(p.local_src.strides[i]))
            _view(new[d][p.local_dst.shard[i]], p.local_dst.offset[i],
                  tuple(p.local_dst.sizes[i]), tuple(p.local_dst.strides[i]))[...] = src
    n_steps = {len(p.steps) for p in progs.values()}
    assert len(n_steps) == 1, "ranks disagree on the number of steps"
    for i in range(n_steps.pop()):
        wire = {}
        for d, p in progs.items():
            step = p.steps[i]
            if step.send is not None:
                side = p.sends[step.send]
                c0, c1 = p.chunk(side, step)
                buf = np.full(c1 - c0, 0, np.uint8)
                for sh, off, sizes, strides, pos in side.segs.pieces(c0, c1):
                    n = int(np.prod(sizes))
                    buf[pos:pos + n] = _view(old[d][sh], off, sizes, strides).reshape(-1)
                assert step.send not in wire
                wire[step.send] = buf
                streams.setdefault(step.send, []).append(buf)
        for d, p in progs.items():
            step = p.steps[i]
            if step.recv is not None:
                side = p.recvs[step.recv]
                c0, c1 = p.chunk(side, step)
                buf = wire.pop(step.recv)
                assert len(buf) == c1 - c0
                for sh, off, sizes, strides, pos in side.segs.pieces(c0, c1):
                    n = int(np.prod(sizes))
                    _view(new[d][sh], off, sizes, strides)[...] = buf[pos:pos + n].reshape(sizes)
        assert not wire, "a chunk was sent and not received"
    for d, p in progs.items():
        for sp, got in zip(p.new_specs, new[d]):
            want = _cut(glob[sp.state_key], sp.lo, sp.hi, sp.s, sp.e)
            assert np.array_equal(got, want), f"device {d} shard {sp.key}"
    return glob, progs, {k: np.concatenate(v) for k, v in streams.items()}


TRANSITIONS = [((1, 2, 2), (2, 2, 2)), ((2, 2, 2), (2, 1, 2)), ((2, 2, 1), (1, 2, 2)),
               ((4, 1, 1), (1, 4, 1)), ((2, 2, 2), (1, 4, 2)), ((1, 1, 4), (2, 2, 1))]


@pytest.mark.parametrize("model", [PRESETS["tiny"], TINY_BF16, PRESETS["tiny-llama"], LLAMA_BF16],
                         ids=["tiny", "tiny-bf16", "llama", "llama-bf16"])
@pytest.mark.parametrize("dist", [False, True], ids=["", "distopt"])
@pytest.mark.parametrize("old,new", TRANSITIONS, ids=[f"{o}-{n}" for o, n in TRANSITIONS])
def test_simulated_migration_delivers_every_byte(model, dist, old, new):
    simulate(make_plan(model, old, new, dist=dist), staging=256 << 20)


@pytest.mark.parametrize("staging", [4 * 1, 4 * 333 + 1, 4 * 4096])
def test_chunked_simulation_matches(staging):
    plan = make_plan(TINY_BF16, (2, 2, 2), (2, 1, 2), dist=True)
    if staging == 4:  # one-byte chunks: keep it small
        plan = make_plan(dataclasses.replace(TINY_BF16, num_layers=2, hidden=16, ffn_hidden=32,
                                             vocab_size=64, seq_length=8),
                         (2, 1, 1), (1, 2, 1), dist=True)
    simulate(plan, staging)


def test_packing_format_is_the_documented_one():
    """Message bytes = per transfer (plan order), per state (catalog order), the fragment's
    elements in row-major order of its box interval, raw bytes of the state's dtype."""
    plan = make_plan(TINY_BF16, (2, 2, 2), (2, 1, 2), dist=True)
    glob, progs, streams = simulate(plan, staging=4 * 999)
    t, m, frag = plan.transfers, plan.messages, plan.fragments
    assert set(streams) == set(range(len(m)))
    for k in range(len(m)):
        parts = []
        for tr in range(int(m.start[k]), int(m.end[k])):
            f = int(t.frag[tr])
            g = plan.catalog.groups[int(plan.old_regions.group[frag.old_row[f]])]
            assert int(t.offset[tr]) == sum(len(p) for p in parts)
            for state in g.states:
                parts.append(_cut(glob[state.key], frag.lo[f], frag.hi[f], int(frag.u[f]),
                                  int(frag.v[f])))
        assert np.array_equal(streams[k], np.concatenate(parts))


def test_steps_pair_up_across_ranks():
    plan = make_plan(LLAMA_BF16, (1, 2, 2), (2, 2, 2), dist=True)
    staging = 4 * 5000
    progs = {d: compile_program(plan, d, staging) for d in group_devices(plan)}
    chunk = staging // 4
    n = len(next(iter(progs.values())).steps)
    seen = {}
    for i in range(n):
        senders = {p.steps[i].send: d for d, p in progs.items() if p.steps[i].send is not None}
        receivers = {p.steps[i].recv: d for d, p in progs.items() if p.steps[i].recv is not None}
        assert senders.keys() == receivers.keys()
        for msg, d in senders.items():
            assert int(plan.messages.src[msg]) == d
            assert int(plan.messages.dst[msg]) == receivers[msg]
            seen[msg] = seen.get(msg, 0) + 1
    for msg, count in seen.items():
        assert count == num_chunks(int(plan.messages.nbytes[msg]), chunk)
        # both ends cut every chunk into the same operations
        send = progs[int(plan.messages.src[msg])].sends[msg].segs
        recv = progs[int(plan.messages.dst[msg])].recvs[msg].segs
        assert np.array_equal(send.start, recv.start) and np.array_equal(send.nbytes, recv.nbytes)
        for j in range(count):
            c0, c1 = chunk_range(int(plan.messages.nbytes[msg]), chunk, j)
            ops = send.ops(c0, c1, direct_min=700)
            assert ops == recv.ops(c0, c1, direct_min=700)
            assert ops[0][0] == c0 and ops[-1][1] == c1
            assert all(a < b and b == ops[k + 1][0] for k, (a, b, _) in enumerate(ops[:-1]))
    assert len(seen) == len(plan.messages)
    # a rank's staging needs never exceed the budget
    for p in progs.values():
        send, recv = p.staging_sizes
        assert 2 * send + 2 * recv <= staging


def test_programs_and_digests_are_deterministic():
    a = make_plan(TINY_BF16, (1, 2, 2), (2, 2, 2), dist=True)
    b = make_plan(TINY_BF16, (1, 2, 2), (2, 2, 2), dist=True)
    pa, pb = compile_program(a, 5), compile_program(b, 5)
    assert pa.digest == pb.digest and pa.steps == pb.steps and pa.new_specs == pb.new_specs
    assert compile_program(a, 5, 4 * 1000).digest != pa.digest  # chunking is part of it
    with pytest.raises(ValueError, match="takes no part"):
        compile_program(a, 99)


@pytest.mark.parametrize("staging", [1 << 14, 1 << 30])
def test_warm_program_answers_as_computed_on_demand(staging):
    """What warm() works out before the pause is what the data phase would compute itself:
    every step's operations, the pieces of every operation, the local copies."""
    plan = make_plan(dataclasses.replace(PRESETS["tiny"], param_dtype="bf16"), (1, 2, 2),
                     (2, 1, 2))
    for d in plan.participants:
        warm = compile_program(plan, d, staging)
        warm.warm()
        cold = compile_program(plan, d, staging)
        assert warm._memo and not cold._memo
        for stp in cold.steps:
            for side in (cold.sends.get(stp.send), cold.recvs.get(stp.recv)):
                if side is None:
                    continue
                c0, c1 = cold.chunk(side, stp)
                ops = side.segs.ops(c0, c1, cold.direct_min)
                assert warm.ops(side, stp) == ops
                for a, b, _ in ops:
                    assert warm.pieces(side, a, b) == list(side.segs.pieces(a, b))
        src, dst = cold.local_src, cold.local_dst
        assert [p[:2] for p in warm.local_pieces()] == [
            (int(src.shard[i]), int(dst.shard[i])) for i in range(len(src))]
        assert sum(int(np.prod(p[2])) for p in warm.local_pieces()) == src.total

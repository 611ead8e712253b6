"""The fingerprint of peer copies (worker/redundancy.py): exact per state tensor whatever
the cut into shards, replicas counted once, and any changed byte seen."""
from __future__ import annotations

import pytest
import torch

from slurm_etc.migrate.shards import LocalShard
from slurm_etc.worker.redundancy import (
    PeerCopies,
    fingerprint_mismatch,
    fingerprint_totals,
    shard_fingerprint,
    shards_fingerprint,
)

pytestmark = pytest.mark.unit


def _cut(key: str, t: torch.Tensor, rows: list[tuple[int, int]]) -> list[LocalShard]:
    """Row blocks of a 2-D tensor as shards of box [r0, r1) x [0, cols)."""
    return [LocalShard(key, (a, 0, 0), (b, t.shape[1], 1), 0, t[a:b].reshape(-1).clone())
            for a, b in rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_totals_agree_over_any_cut_and_count_replicas_once(dtype):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(12, 5, generator=g).to(dtype)
    one = fingerprint_totals(shards_fingerprint(_cut("w", w, [(0, 12)])))
    halves = _cut("w", w, [(0, 6), (6, 12)])
    # tp=2 and a dp replica of each half: the same total
    two = fingerprint_totals(shards_fingerprint(halves) + shards_fingerprint(halves))
    three = fingerprint_totals(shards_fingerprint(_cut("w", w, [(0, 3), (3, 7), (7, 12)])))
    assert one == two == three and fingerprint_mismatch(one, three) is None


def test_a_changed_byte_a_nan_or_a_missing_tensor_is_named():
    w = torch.randn(8, 4)
    want = fingerprint_totals(shards_fingerprint(_cut("w", w, [(0, 8)]) +
                                                 _cut("b", w[:2], [(0, 2)])))
    bad = w.clone()
    bad.view(torch.int32)[3, 1] ^= 1  # one bit
    got = fingerprint_totals(shards_fingerprint(_cut("w", bad, [(0, 4), (4, 8)]) +
                                                _cut("b", w[:2], [(0, 2)])))
    assert fingerprint_mismatch(want, got) == "1 of 2 state tensors differ (different bytes): w"
    nan = w.clone()
    nan[0, 0] = float("nan")
    assert shard_fingerprint(nan) != shard_fingerprint(w)
    only_w = fingerprint_totals(shards_fingerprint(_cut("w", w, [(0, 8)])))
    assert "(1 tensor(s) missing): b" in str(fingerprint_mismatch(want, only_w))


def test_a_snapshot_carries_its_fingerprint_and_the_plant_breaks_a_copy():
    """A snapshot's fingerprint is of what it holds when taken; the planted corruption
    (hooks: corrupt_peer_copies) changes a copy's bytes after it, as the check must see."""
    shards = _cut("w", torch.randn(6, 3), [(0, 3), (3, 6)])
    peers = PeerCopies(1, 0, 1, (1,))
    snap = peers._take(4, shards, {})
    assert snap.fingerprint() == shards_fingerprint(shards)
    snap.flat[0] += 1
    assert shards_fingerprint(snap.shards()) != snap.fingerprint()

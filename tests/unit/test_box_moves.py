"""The live reshard's move list (``shards.plan_box_moves``): pure box arithmetic."""
from __future__ import annotations

import random

import pytest

from slurm_etc.megatron.shards import MoveError, PieceMeta, plan_box_moves

KEY = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
SHAPE = (2, 4, 6, 3)  # layers, experts, rows, cols


def expert(layer: int, e: int, main: bool = True, rows: tuple[int, int] = (0, 6)) -> PieceMeta:
    return PieceMeta(KEY, f"x.{layer}.{e}.{rows[0]}", (layer, e, rows[0], 0),
                     (layer + 1, e + 1, rows[1], 3), main, SHAPE)


def ep_layout(ep: int, dp: int) -> list[list[PieceMeta]]:
    """Ranks ``e + ep * x``: ep rank e holds experts [e*4/ep, (e+1)*4/ep) of both layers; only
    expert-dp rank x = 0 holds the main copies."""
    per = 4 // ep
    return [[expert(layer, e, main=(r // ep == 0))
             for layer in range(2) for e in range((r % ep) * per, (r % ep + 1) * per)]
            for r in range(ep * dp)]


def test_each_new_expert_comes_from_its_old_ep_rank_main_copy():
    moves = plan_box_moves(ep_layout(2, 2), ep_layout(4, 1))
    assert len(moves) == 8  # every (layer, expert) of the new layout once
    for m in moves:
        expert_index = m.lo[1]
        assert m.src == expert_index // 2  # old ep rank of that expert, expert-dp rank 0
        assert m.dst == expert_index  # new ep rank = expert with 4 ranks
        assert m.numel == 6 * 3


def test_a_new_box_cut_from_two_old_boxes():
    old = [[expert(0, 0, rows=(0, 3))], [expert(0, 0, rows=(3, 6))]]
    new = [[PieceMeta(KEY, "p", (0, 0, 2, 0), (1, 1, 5, 3), True, SHAPE)]]
    moves = plan_box_moves(old, new)
    assert [(m.src, m.lo, m.hi) for m in moves] == [(0, (0, 0, 2, 0), (1, 1, 3, 3)),
                                                     (1, (0, 0, 3, 0), (1, 1, 5, 3))]


def test_the_same_moves_from_every_rank_and_input_order():
    old, new = ep_layout(2, 2), ep_layout(4, 1)
    want = plan_box_moves(old, new)
    shuffled = [random.Random(1).sample(r, len(r)) for r in old]
    # pieces renumbered by the shuffle: the same boxes from the same ranks
    got = plan_box_moves(shuffled, new)
    assert [(m.src, m.dst, m.lo) for m in got] == [(m.src, m.dst, m.lo) for m in want]


@pytest.mark.parametrize("old, says", [
    ([[expert(0, 0, main=False)]], "cover 0 of its 18"),  # only a replica holds it
    ([[expert(0, 0)], [expert(0, 0)]], "cover 36 of its 18"),  # two main copies
])
def test_a_box_covered_other_than_once_is_refused(old, says):
    with pytest.raises(MoveError, match=says):
        plan_box_moves(old, [[expert(0, 0)]])


def test_a_different_global_shape_is_refused():
    other = PieceMeta(KEY, "p", (0, 0, 0, 0), (1, 1, 6, 3), True, (2, 8, 6, 3))
    with pytest.raises(MoveError, match="global shape"):
        plan_box_moves([[other]], [[expert(0, 0)]])


def test_metadata_round_trips_through_json():
    m = expert(1, 3, main=False)
    assert PieceMeta.from_json(m.to_json()) == m

"""Planted bugs in the in-place resize of experts and virtual pipeline chunks, for
``verify_transition(relabel=...)`` (tests/dist/test_verify_moe.py).

Each is a :data:`slurm_etc.megatron.state.Relabel`: it rewrites the pieces an old rank's
live state is read as (``state.param_pieces``: which box of which global tensor each piece
of a parameter is) before the resize cuts its shards from them, in the placement before the
pause and in the pause alike. A piece keeps its memory and takes another piece's box, so the
rank still holds exactly the shards the plan expects (the executor's own checks pass) and
the wrong bits move silently; the parameter's Adam moments (and fp32 main copy) follow it,
as the optimizer's shards are cut from the same pieces. Only verify's references, which
read megatron-core and never the pieces, can tell.

Nothing in the runtime imports this module.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from slurm_etc.plan.catalog import EXPERT_PREFIX

DECODER_LAYERS = "decoder.layers."


def _swap_boxes(pieces: list[Any], pairs: list[tuple[int, int]]) -> list[Any]:
    out = list(pieces)
    for i, j in pairs:
        a, b = pieces[i], pieces[j]
        if (a.key, a.numel) != (b.key, b.numel):
            raise ValueError(f"plant: cannot swap {a.key} {a.lo} with {b.key} {b.lo}")
        out[i] = dataclasses.replace(a, lo=b.lo, hi=b.hi)
        out[j] = dataclasses.replace(b, lo=a.lo, hi=a.hi)
    return out


def expert_on_wrong_ep_rank(state: Any, pieces: list[Any]) -> list[Any]:
    """Each old rank reads every local expert as the next one of its layer (its last as its
    first): with ep = 2 -> 4 each expert's weights and moments land on the other new ep
    rank of the pair, in the slot of the expert that belongs there."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i, pc in enumerate(pieces):
        if pc.key.startswith(EXPERT_PREFIX):
            experts = state.model_desc.num_experts
            groups.setdefault((pc.key, pc.lo[0] // experts), []).append(i)
    out = list(pieces)
    for members in groups.values():
        members.sort(key=lambda i: pieces[i].lo)
        for i, j in zip(members, members[1:] + members[:1]):
            out[i] = dataclasses.replace(pieces[i], lo=pieces[j].lo, hi=pieces[j].hi)
    return out


def vpp_chunks_swapped(state: Any, pieces: list[Any]) -> list[Any]:
    """Each old rank reads virtual pipeline chunk 0's layers as chunk 1's and chunk 1's as
    chunk 0's (pieces paired in order: the chunks of one rank hold as many layers each)."""
    chunk_of = {id(p): v for v, gpt in enumerate(state.gpts) for p in gpt.parameters()}
    per_chunk: dict[int, list[int]] = {}
    for i, pc in enumerate(pieces):
        if pc.key.startswith(DECODER_LAYERS):
            per_chunk.setdefault(chunk_of[id(pc.param)], []).append(i)
    if len(per_chunk) < 2:
        return pieces
    return _swap_boxes(pieces, list(zip(per_chunk[0], per_chunk[1], strict=True)))

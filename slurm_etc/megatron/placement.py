"""The old state that stays on a process, moved into the new layout's memory before the pause.

A process that is both an old and a new rank keeps part of its state (a tensor-parallel
rank that becomes a whole layer keeps its half; a data-parallel rank keeps its replica; a
pipeline stage keeps the layers of its new stage). The executor copies that part locally in
the data phase, where the copies compete with the wire for the same cores and memory.

:func:`place_staying_state` does the copy before the pause instead, once, while the old
layout may still train, and makes the old tensor *live* there: an old parameter, fp32 main
parameter or Adam moment whose every byte stays on this process, contiguous, in one new
tensor (e.g. a column-parallel half into the rows of the whole new weight), takes that
region of the new tensor as its memory (``_Target.adopt``: the parameter object, the
optimizer's references and DDP's hooks stay the same). From then on the old layout trains
in the new layout's memory; in the pause the executor finds each such local copy in place
(source and destination are the same bytes) and skips it, and the prepared world's switch
finds a kept shard already where it goes.

Only tensors that own their memory move (not a view into DDP's contiguous parameter buffer
of the DistributedOptimizer); everything else is copied in the pause as before.

:func:`give_back` undoes it when the resize aborts: each placed tensor gets memory of its
own again (a copy, outside the pause), and the dropped new layout's memory goes with it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from slurm_etc.plan.catalog import Catalog

from .build import TrainingState
from .state import Relabel, _slots, _Target


@dataclass
class Placed:
    """What :func:`place_staying_state` moved: the targets now living in the new layout's
    memory and their bytes."""

    targets: list[_Target] = field(default_factory=list)
    bytes: int = 0


def _dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a byte box (sizes, byte strides) is one contiguous run."""
    expect = 1
    for n, s in zip(reversed(sizes), reversed(strides)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _region(target: _Target, slots: list[Any], old_index: dict, kept_of: dict[int, int],
            pieces: dict[int, list[tuple]], views: Sequence[torch.Tensor | None]
            ) -> torch.Tensor | None:
    """The region of one new tensor that ``target`` (every byte of it) is copied to in the
    migration, as a view of ``target``'s dtype; None when it is not one contiguous region."""
    esize = target.dtype.itemsize
    total = target.numel * esize
    base, host = 0, None  # the region's first byte's address, a new tensor it lies in
    covered = 0
    for sl in slots:
        i = old_index.get(sl.key)
        if i is None:
            return None
        start = sl.a * esize
        if i in kept_of:  # the whole shard becomes a new one
            view = views[kept_of[i]]
            if view is None:
                return None
            runs = [(view, 0, (sl.b - sl.a) * esize, 0)]
        else:
            runs = []
            for _, new, sizes, old_strides, old_off, new_strides, new_off in pieces.get(i, []):
                view = views[new]
                if view is None:
                    continue  # a copy elsewhere (a second name): not the region
                if not (_dense(sizes, old_strides) and _dense(sizes, new_strides)):
                    return None
                runs.append((view, old_off, math.prod(sizes), new_off))
        for view, old_off, n, new_off in runs:
            b = view.data_ptr() + new_off - (start + old_off)
            if host is None:
                base, host = b, view
            elif b != base or (view.untyped_storage().data_ptr()
                               != host.untyped_storage().data_ptr()):
                return None
            covered += n
    if host is None or covered != total:
        return None
    storage = host.untyped_storage()
    offset = base - storage.data_ptr()
    if offset < 0 or offset + total > storage.nbytes() or offset % esize:
        return None
    flat = host.detach().view(-1).view(torch.uint8)
    return flat.as_strided((total,), (1,), offset).view(target.dtype)


def place_staying_state(state: TrainingState, catalog: Catalog, program: Any,
                        views: Sequence[torch.Tensor | None], *,
                        relabel: Relabel | None = None) -> Placed:
    """Move this process's old tensors that stay here, whole, into the new layout's memory
    (see module docstring): copy each one's current value into its region of the new
    tensors and make that region its memory.

    Args:
        state: the live old TrainingState (the program's old rank).
        catalog: the plan's catalog.
        program: this process's compiled program (``program.old_specs``, ``local_pieces``,
            ``kept``).
        views: one per ``program.new_specs`` entry: the contiguous tensor the new shard
            ends up in (the executor's destination; for a kept shard the view it is copied
            into at install), or None where the old memory must not go (none, a throwaway
            second name, a shard adopted whole).
        relabel: the rewrite of the state's pieces the resize reads its shards through
            (:func:`.state.local_shards`; a planted bug, None in real runs).
    """
    old_index = {sp.key: i for i, sp in enumerate(program.old_specs)}
    kept_of = {i: j for j, i in program.kept.items()}
    pieces: dict[int, list[tuple]] = {}
    for pc in program.local_pieces():
        pieces.setdefault(pc[0], []).append(pc)
    per_target: dict[int, list[Any]] = {}
    for sl in _slots(state, catalog, relabel=relabel):
        if not sl.alias:
            per_target.setdefault(id(sl.target), []).append(sl)
    placed = Placed()
    try:
        with torch.no_grad():
            for slots in per_target.values():
                target = slots[0].target
                if target.base() is None or not target.can_adopt():
                    continue
                region = _region(target, slots, old_index, kept_of, pieces, views)
                if region is None:
                    continue
                region.copy_(target.flat(slots[0].key))
                target.adopt(region)
                placed.targets.append(target)
                placed.bytes += region.numel() * region.element_size()
    except BaseException:
        give_back(placed)
        raise
    return placed


def give_back(placed: Placed) -> None:
    """Memory of its own again for every placed tensor (an aborted resize: the new layout's
    memory is dropped)."""
    with torch.no_grad():
        for target in placed.targets:
            base = target.base()
            if base is not None:
                target.adopt(base.detach().clone())
    placed.targets, placed.bytes = [], 0

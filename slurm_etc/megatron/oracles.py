"""Oracles for ``slurm-etc verify``: independent references for a migrated state.

:func:`assemble_globals` puts the old layout's shards together into full global tensors
(checking that replicas agree and every element is held), :func:`expected_shards` cuts a
layout's regions out of them, :func:`compare_shards` compares bit for bit; :func:`shard_bits`
takes a state's shards as raw bits.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from slurm_etc.migrate.shards import LocalShard, shard_specs
from slurm_etc.plan.catalog import Catalog
from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.regions import region_table

from .state import _bits

_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

def shard_bits(shards: Iterable[LocalShard]) -> dict[tuple, np.ndarray]:
    """Shard key -> its raw bits as a numpy integer array (bf16 as int16), a copy."""
    return {sh.key: _bits(sh.tensor).numpy().copy() for sh in shards}


@dataclass
class Globals:
    """Full global tensors assembled from a layout's shards (raw bits, three axes)."""

    tensors: dict[str, np.ndarray]
    problems: list[str]


def _padded_shape(catalog: Catalog, key: str) -> tuple[tuple[int, int, int], int]:
    for g in catalog.groups:
        for st in g.states:
            if st.key == key:
                shape = tuple(g.shape) + (1,) * (3 - len(g.shape))
                return shape, st.itemsize  # type: ignore[return-value]
    raise KeyError(key)


def _box_view(arr: np.ndarray, lo, hi) -> np.ndarray:
    return arr[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]


def assemble_globals(catalog: Catalog, per_rank: Iterable[Mapping[tuple, np.ndarray]]
                     ) -> Globals:
    """Put every rank's shards (``shard_bits``) together into global tensors.

    Independent of the executor: only boxes and intervals. Checks that every copy of an
    element (dp and tp replicas, tied copies) has the same bits and that every element of
    every tensor is held by some rank.
    """
    tensors: dict[str, np.ndarray] = {}
    filled: dict[str, np.ndarray] = {}
    problems: list[str] = []
    for rank, shards in enumerate(per_rank):
        for (key, lo, hi, s), bits in shards.items():
            if key not in tensors:
                shape, itemsize = _padded_shape(catalog, key)
                tensors[key] = np.zeros(shape, _NP_INT[itemsize])
                filled[key] = np.zeros(shape, bool)
            idx = _box_indices(tensors[key].shape, lo, hi)[s:s + len(bits)]
            _merge(tensors[key].reshape(-1), filled[key].reshape(-1), idx, bits, key, rank,
                   problems)
    for key, f in filled.items():
        if not f.all():
            problems.append(f"{key}: {int((~f).sum())} of {f.size} elements held by no rank")
    return Globals(tensors, problems)


def _box_indices(shape, lo, hi) -> np.ndarray:
    grids = np.ix_(*[np.arange(a, b) for a, b in zip(lo, hi)])
    return np.ravel_multi_index(grids, shape).reshape(-1)


def _merge(dst: np.ndarray, have: np.ndarray, idx: np.ndarray, bits: np.ndarray, key: str,
           rank: int, problems: list[str]) -> None:
    seen = have[idx]
    differ = seen & (dst[idx] != bits)
    if differ.any() and len(problems) < 20:
        problems.append(f"{key}: rank {rank} holds {int(differ.sum())} elements whose bits "
                        "differ from another rank's copy")
    dst[idx] = bits
    have[idx] = True


def expected_shards(catalog: Catalog, config: ParallelConfig, rank: int,
                    globals_: Globals) -> dict[tuple, np.ndarray]:
    """The shards rank ``rank`` of ``config`` must hold, cut out of the global tensors."""
    out = {}
    for sp in shard_specs(catalog, region_table(catalog, config), rank):
        arr = globals_.tensors[sp.state_key]
        box = np.ascontiguousarray(_box_view(arr, sp.lo, sp.hi)).reshape(-1)
        out[sp.key] = box[sp.s:sp.e]
    return out


def compare_shards(got: Mapping[tuple, np.ndarray], want: Mapping[tuple, np.ndarray],
                   limit: int = 10) -> list[dict]:
    """Shards whose bits differ (or that are missing on either side), first element named."""
    out = []
    for key in sorted(set(got) | set(want)):
        a, b = got.get(key), want.get(key)
        if a is None or b is None:
            out.append({"state_key": key[0], "lo": list(key[1]), "hi": list(key[2]),
                        "s": key[3], "problem": "missing" if a is None else "unexpected"})
        elif a.shape != b.shape or a.dtype != b.dtype:
            out.append({"state_key": key[0], "lo": list(key[1]), "hi": list(key[2]),
                        "s": key[3], "problem": f"{a.size} x {a.dtype} vs {b.size} x {b.dtype}"})
        else:
            bad = np.flatnonzero(a != b)
            if len(bad):
                i = int(bad[0])
                out.append({"state_key": key[0], "lo": list(key[1]), "hi": list(key[2]),
                            "s": key[3], "differing": int(len(bad)), "of": int(a.size),
                            "first": i, "got": int(a[i]), "expected": int(b[i])})
        if len(out) >= limit:
            break
    return out

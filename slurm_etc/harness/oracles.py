"""Shard-level helpers over the adapter's view of a state (``state.local_shards``).

:func:`shard_bits` takes a state's shards as raw bits (digests of a state, the bench's
same-state check); :func:`compare_shards` compares two such sets bit for bit (the install
round trip of ``w_resize(keep_bits=True)``).

These read through the adapter they would have to check, so ``slurm-etc verify`` does not
use them as oracles: its references (:mod:`.reference`) read state through megatron-core
and torch alone.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from slurm_etc.megatron.state import _bits
from slurm_etc.migrate.shards import LocalShard


def shard_bits(shards: Iterable[LocalShard]) -> dict[tuple, np.ndarray]:
    """Shard key -> its raw bits as a numpy integer array (bf16 as int16), a copy."""
    return {sh.key: _bits(sh.tensor).numpy().copy() for sh in shards}


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

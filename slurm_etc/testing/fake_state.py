"""Fake training state with known values, for tests (the executor's, unit and multi-process).

Every element of every state tensor gets a value that is a seeded hash of (state key, global
index), so any process can produce any shard of the "global tensors" without materialising
them, and a misplaced or missing element shows up. Values differ between state keys (the
hash is salted with the key) and, for 32-bit states, between almost all positions. They are
finite floats of the state's itemsize (4 -> float32, 2 -> bfloat16), compared bit for bit.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from slurm_etc.migrate.dtypes import DTYPES, dtype_for
from slurm_etc.migrate.shards import Box3, LocalShard, ShardSpec, shard_specs
from slurm_etc.plan.catalog import Catalog

if TYPE_CHECKING:
    from slurm_etc.plan.plan import MigrationPlan

_EXP = {2: (0x7F80, 0x4000), 4: (0x7F800000, 0x40000000),
        8: (0x7FF0000000000000, 0x4000000000000000)}


def padded_shape(catalog: Catalog, group: int) -> tuple[int, int, int]:
    shape = tuple(catalog.groups[group].shape)
    return shape + (1,) * (3 - len(shape))  # type: ignore[return-value]


_M32 = (1 << 32) - 1


def _salt(state_key: str, seed: int) -> int:
    h = hashlib.blake2b(f"{seed}:{state_key}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little")


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser: a bijection of 32-bit values (held in int64) that mixes well."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _global_index(lo: Sequence[int], hi: Sequence[int], s: int, e: int,
                  shape3: Sequence[int]) -> torch.Tensor:
    """Global flat index (int64) of elements [s, e) of box [lo, hi) in row-major order."""
    e1, e2 = int(hi[1]) - int(lo[1]), int(hi[2]) - int(lo[2])
    p = torch.arange(s, e, dtype=torch.int64)
    i0 = p // (e1 * e2) + int(lo[0])
    i1 = (p // e2) % e1 + int(lo[1])
    i2 = p % e2 + int(lo[2])
    return (i0 * int(shape3[1]) + i1) * int(shape3[2]) + i2


def _to_signed(bits: torch.Tensor, width: int) -> torch.Tensor:
    half = 1 << (width - 1)
    return torch.where(bits >= half, bits - (1 << width), bits)


def fake_values(state_key: str, lo: Sequence[int], hi: Sequence[int], s: int, e: int,
                shape3: Sequence[int], itemsize: int, seed: int = 0) -> torch.Tensor:
    """Elements ``[s, e)`` of box ``[lo, hi)`` of the fake global tensor of ``state_key``.

    The hash (murmur3's 32-bit finaliser of the salted index) is a bijection, so 32-bit
    values of two positions differ except where a NaN/Inf bit pattern was made finite (about
    1 in 256); 16-bit values keep the hash's high half.
    """
    if itemsize not in DTYPES:
        raise ValueError(f"no dtype for itemsize {itemsize}; known: {sorted(DTYPES)}")
    idx = _global_index(lo, hi, s, e, shape3)
    salt = _salt(state_key, seed)
    h = _fmix32(((idx & _M32) + salt) & _M32)
    if itemsize == 8:
        low = _fmix32(((idx >> 32) + (salt ^ 0x5BD1E995) + h) & _M32)
        bits = (_to_signed(h, 32) << 32) | low
    elif itemsize == 4:
        bits = h
    else:
        bits = h >> (32 - 8 * itemsize)
    if itemsize in _EXP:
        mask, flip = _EXP[itemsize]
        bits = torch.where((bits & mask) == mask, bits ^ flip, bits)
    value_dtype, int_dtype = DTYPES[itemsize]
    if itemsize == 1:
        return bits.to(torch.uint8)
    if itemsize < 8:
        bits = _to_signed(bits, 8 * itemsize)
    return bits.to(int_dtype).view(value_dtype)


def spec_values(catalog: Catalog, spec: ShardSpec, seed: int = 0) -> torch.Tensor:
    return fake_values(spec.state_key, spec.lo, spec.hi, spec.s, spec.e,
                       padded_shape(catalog, spec.group), spec.itemsize, seed)


def fake_shards(plan: MigrationPlan, rank: int | None, *, seed: int = 0, new: bool = False,
                device: torch.device | str = "cpu") -> list[LocalShard]:
    """The shards ``rank`` of the old layout (``new=True``: of the new layout) holds,
    filled with the fake global values."""
    table = plan.new_regions if new else plan.old_regions
    return [LocalShard(sp.state_key, sp.lo, sp.hi, sp.s,
                       spec_values(plan.catalog, sp, seed).to(device))
            for sp in shard_specs(plan.catalog, table, rank)]


def filled_shards(plan: MigrationPlan, rank: int | None, *, new: bool = False,
                  device: torch.device | str = "cpu") -> list[LocalShard]:
    """Shards of ``rank`` filled with one byte value per tensor group: cheap, for benchmarks
    at sizes where hashing every element would dominate (not verifiable element-wise)."""
    table = plan.new_regions if new else plan.old_regions
    out = []
    for sp in shard_specs(plan.catalog, table, rank):
        t = torch.empty(sp.numel, dtype=dtype_for(sp.itemsize), device=device)
        t.view(torch.uint8).fill_(sp.group % 251 + 1)  # touches every page
        out.append(LocalShard(sp.state_key, sp.lo, sp.hi, sp.s, t))
    return out


def global_tensor(catalog: Catalog, group: int, state_key: str, seed: int = 0) -> torch.Tensor:
    """The whole fake global tensor of one state (3 axes); for small models and tests."""
    g = catalog.groups[group]
    itemsize = next(st.itemsize for st in g.states if st.key == state_key)
    shape3 = padded_shape(catalog, group)
    n = shape3[0] * shape3[1] * shape3[2]
    flat = fake_values(state_key, (0, 0, 0), shape3, 0, n, shape3, itemsize, seed)
    return flat.view(shape3)


def shard_mismatches(plan: MigrationPlan, rank: int | None, shards: Iterable[LocalShard], *,
                     seed: int = 0, new: bool = True, limit: int = 10) -> list[str]:
    """Differences between ``shards`` and what ``rank`` should hold (empty list: all equal).

    Compares bit for bit: missing, unexpected, misshapen or wrong-valued shards are reported
    with the first differing element.
    """
    table = plan.new_regions if new else plan.old_regions
    expect = {sp.key: sp for sp in shard_specs(plan.catalog, table, rank)}
    got: Mapping[tuple[str, Box3, Box3, int], LocalShard] = {sh.key: sh for sh in shards}
    out: list[str] = []
    for key in sorted(set(expect) - set(got)):
        out.append(f"missing shard {key}")
    for key in sorted(set(got) - set(expect)):
        out.append(f"unexpected shard {key}")
    for key in sorted(set(expect) & set(got)):
        sp, t = expect[key], got[key].tensor
        want = spec_values(plan.catalog, sp, seed)
        if t.numel() != want.numel() or t.element_size() != sp.itemsize:
            out.append(f"shard {key}: {t.numel()} elements of {t.element_size()} bytes, "
                       f"expected {want.numel()} of {sp.itemsize}")
            continue
        int_dtype = DTYPES[sp.itemsize][1]
        a = t.detach().reshape(-1).cpu().view(int_dtype)
        b = want.view(int_dtype)
        bad = torch.nonzero(a != b).reshape(-1)
        if len(bad):
            i = int(bad[0])
            out.append(f"shard {key}: {len(bad)} of {len(b)} elements differ, first at "
                       f"{i}: got {int(a[i])}, expected {int(b[i])}")
        if len(out) >= limit:
            break
    return out[:limit]

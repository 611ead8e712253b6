"""Row-major intervals of a box as a few sub-boxes (what an executor turns into views)."""
from __future__ import annotations

from typing import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]


def interval_boxes(lo: Sequence[int], hi: Sequence[int], u: int, v: int) -> list[Box]:
    """Sub-boxes, in row-major order, covering exactly elements [u, v) of box [lo, hi).

    At most 2 * ndim - 1 boxes; each is a strided view of any buffer holding a super-box.
    """
    lo, hi = tuple(int(x) for x in lo), tuple(int(x) for x in hi)
    if u >= v:
        return []
    if len(lo) == 1:
        return [((lo[0] + u,), (lo[0] + v,))]
    inner = 1
    for a, b in zip(lo[1:], hi[1:]):
        inner *= b - a
    a0, ar = divmod(u, inner)
    b0, br = divmod(v, inner)

    def rows(first: int, last: int, sub: list[Box]) -> list[Box]:
        return [((lo[0] + first, *s_lo), (lo[0] + last, *s_hi)) for s_lo, s_hi in sub]

    if a0 == b0:
        return rows(a0, a0 + 1, interval_boxes(lo[1:], hi[1:], ar, br))
    out: list[Box] = []
    if ar:
        out += rows(a0, a0 + 1, interval_boxes(lo[1:], hi[1:], ar, inner))
        a0 += 1
    if b0 > a0:
        out.append(((lo[0] + a0, *lo[1:]), (lo[0] + b0, *hi[1:])))
    if br:
        out += rows(b0, b0 + 1, interval_boxes(lo[1:], hi[1:], 0, br))
    return out


def box_offset(lo: Sequence[int], hi: Sequence[int], point: Sequence[int]) -> int:
    """Row-major position of ``point`` inside box [lo, hi)."""
    pos = 0
    for a, b, x in zip(lo, hi, point):
        pos = pos * (b - a) + (x - a)
    return pos


def box_strides(lo: Sequence[int], hi: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of a box."""
    strides = [1] * len(lo)
    for k in range(len(lo) - 2, -1, -1):
        strides[k] = strides[k + 1] * (hi[k + 1] - lo[k + 1])
    return tuple(strides)

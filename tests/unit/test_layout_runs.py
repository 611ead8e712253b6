"""An order's layouts travel as runs of consecutive vranks: a few bytes whatever the job's
size, the same vranks in the same order after a round trip, and a malformed or oversized
list refused by the decoder (never expanded)."""
from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_etc.plan.config import Layout, ParallelConfig
from slurm_etc.plan.errors import ConfigError
from slurm_etc.protocol.messages import (
    ENCODER,
    MAX_VRANKS,
    ORDER_DECODER,
    LayoutSpec,
    Resize,
    format_layout,
    pack_runs,
    parse_layout,
    unpack_runs,
)


def _expand(runs):
    # the oracle: written out by hand, not through unpack_runs
    out = []
    for first, count in runs:
        out.extend(range(first, first + count))
    return out


@given(st.lists(st.integers(0, 200), max_size=60))
def test_runs_keep_every_vrank_in_order(vranks):
    runs = pack_runs(vranks)
    assert _expand(runs) == vranks
    assert list(unpack_runs(runs)) == vranks
    # a run is as long as it can be: no two neighbouring runs continue each other
    assert all(a + n != b for (a, n), (b, _) in zip(runs, runs[1:], strict=False))


def test_an_order_of_16k_ranks_is_a_few_bytes():
    old = Layout(ParallelConfig(dp=2048, tp=8, pp=1), tuple(range(16_384)))
    lost = set(range(8 * 700, 8 * 701))
    kept = tuple(v for v in range(16_384 + 2_048) if v not in lost)
    new = Layout(ParallelConfig(dp=2303, tp=8, pp=1), kept[:2303 * 8])
    order = Resize("j", 3, LayoutSpec.of(old), LayoutSpec.of(new),
                   pool_runs=pack_runs(kept), lost=tuple(sorted(lost)))
    wire = ENCODER.encode(order)
    assert len(wire) < 400, len(wire)
    back = ORDER_DECODER.decode(wire)
    assert back.old.devices == old.devices and back.new.devices == new.devices
    assert back.pool == kept and back.new.layout() == new


def test_a_shuffled_layout_still_round_trips():
    devices = list(range(64))
    random.Random(7).shuffle(devices)
    layout = Layout(ParallelConfig(dp=16, tp=4, pp=1), tuple(devices))
    spec = ORDER_DECODER.decode(ENCODER.encode(
        Resize("j", 1, LayoutSpec.of(layout), LayoutSpec.of(layout)))).new
    assert spec.layout() == layout


@pytest.mark.parametrize("runs", [[[-1, 2]], [[0, 0]], [[0, MAX_VRANKS + 1]], [[0]],
                                  [[0, 1, 2]], [["0", 1]]])
def test_malformed_runs_are_refused_by_the_decoder(runs):
    wire = msgspec.json.encode({"config": "dp=1,tp=1,pp=1", "runs": runs})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(wire, type=LayoutSpec)


def test_runs_past_the_bound_are_refused_before_they_are_expanded():
    with pytest.raises(ConfigError, match="more than"):
        unpack_runs(((0, MAX_VRANKS), (MAX_VRANKS, 1)))


def test_the_environment_layout_is_ranges_and_parses_back():
    layout = Layout(ParallelConfig(dp=2048, tp=8, pp=1), tuple(range(16_384)))
    text = format_layout(layout)
    assert text == "dp=2048,tp=8,pp=1@0-16383"
    assert parse_layout(text) == layout
    odd = Layout(ParallelConfig(dp=4, tp=1, pp=1), (3, 0, 1, 7))
    assert format_layout(odd) == "dp=4,tp=1,pp=1@3,0-1,7"
    assert parse_layout(format_layout(odd)) == odd


@pytest.mark.parametrize("text", ["dp=2,tp=1,pp=1@0,x", "dp=2,tp=1,pp=1@3-1",
                                  "dp=2,tp=1,pp=1@-1,0", f"dp=2,tp=1,pp=1@0-{MAX_VRANKS}"])
def test_a_malformed_environment_layout_is_one_clear_error(text):
    with pytest.raises(ConfigError, match="integers or ranges"):
        parse_layout(text)

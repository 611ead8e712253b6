"""Peer copies every "auto" steps: the interval's choice is a pure function of a copy's
time, a step's time, a copy's bytes and the host memory there is
(``protocol.recovery.peer_copy_interval``); its line says the figures once."""
from __future__ import annotations

import pytest

from slurm_etc.plan.errors import ConfigError
from slurm_etc.protocol.recovery import HELD_COPIES, peer_copy_interval

pytestmark = pytest.mark.unit

GIB = 2**30


@pytest.mark.parametrize("copy_s,step_s,every", [
    (0.040, 2.1, 1),      # 40 ms of 2.1 s: 1.9% each step
    (0.045, 2.1, 2),      # 2.1%: every second step
    (0.5, 1.0, 25),       # half a step: 25 steps apart (2.0%)
    (1.0, 0.1, 500),      # a copy of ten steps: 500 apart
    (0.0, 1.0, 1),        # free: every step
    (0.1, 0.0, 1),        # no step time measured: every step
])
def test_the_interval_keeps_the_copies_at_two_percent(copy_s, step_s, every):
    got = peer_copy_interval(copy_s, step_s, 100 * 2**20, 20 * GIB)
    assert got.every == every and got.fits
    if step_s:  # the budget holds at the interval chosen, and not one step sooner
        assert copy_s / (got.every * step_s) <= 0.02 + 1e-12
        assert got.every == 1 or copy_s / ((got.every - 1) * step_s) > 0.02


def test_the_line_says_the_figures():
    got = peer_copy_interval(0.040, 2.1, 300 * 2**20, 20 * GIB)
    assert got.line == ("peer copies every 1 step: a copy takes 40 ms, 1.9% of 2.10 s "
                        "steps; 1.2 GiB of 20.0 GiB host memory")
    assert got.held_bytes == HELD_COPIES * 300 * 2**20 and got.host_bytes == 20 * GIB
    twelve = peer_copy_interval(0.5, 2.1, 300 * 2**20, 20 * GIB)
    assert twelve.every == 12 and "every 12 steps" in twelve.line and "2.0% of" in twelve.line


def test_copies_that_do_not_fit_host_memory_are_not_taken():
    """A rank holds HELD_COPIES copies of its state at a refresh; they may use half its host
    memory. Past that: every 0 and one line saying so, however cheap the copy."""
    fits = peer_copy_interval(0.01, 1.0, 2 * GIB, 16 * GIB)   # 8 of 16 GiB
    assert fits.fits and fits.every == 1
    no = peer_copy_interval(0.01, 1.0, 2 * GIB + 1, 16 * GIB)
    assert not no.fits and no.every == 0
    assert no.line.startswith("peer copies do not fit host memory: 8.0 GiB of 16.0 GiB")
    assert peer_copy_interval(0.01, 1.0, 1, 0).every == 0   # host memory unknown: 0


def test_negative_figures_are_refused():
    with pytest.raises(ConfigError, match="none may be negative"):
        peer_copy_interval(-1.0, 1.0, 1, 1)

"""Tier markers: tests under tests/<tier>/ get that tier's marker automatically; and how
`make test` spreads the unit and Slurm tiers over two processes (pytest-xdist)."""
import os
import pathlib

import pytest

TIERS = ("unit", "dist", "slurm", "gpu")
SLURM_TIER = "tests/slurm/"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # an xdist worker is started with COLUMNS=80 and LINES=24; a plain run under `make test`
    # has neither (its output is a pipe): the CLI lays its tables out as users' logs get them
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = pathlib.Path(str(item.fspath)).parts
        for tier in TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))


def pytest_xdist_make_scheduler(config, log):
    """The Slurm tier is one unit of work, run in order in one process (one cluster, its
    session fixture holds it until that process ends); every other test is a unit of its
    own, sent to whichever process is free. (xdist's own ``--dist loadgroup`` marks groups
    on a node id that pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SLURM_TIER if nodeid.startswith(SLURM_TIER) else nodeid

    return TierScheduling(config, log)

"""Tier markers: tests under tests/<tier>/ get that tier's marker automatically."""
import pathlib

import pytest

TIERS = ("unit", "dist", "slurm", "gpu")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = pathlib.Path(str(item.fspath)).parts
        for tier in TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))

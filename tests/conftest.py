"""Tier markers: tests under tests/<tier>/ get that tier's marker automatically; and how
`make test` spreads the tiers over two processes (pytest-xdist).

`make test` runs first, alone, the multi-process modules that time something or act on a
running job from the test process (the measured pause, the zero-stall grow, the migration's
throughput, bounds on timeouts, a coordinator killed at a step: they own both cores); then
those in ``PAIRED``, two modules at a time; then the Slurm tier in one process, in order (one
cluster: its session fixture holds it until that process ends), beside the unit tier and the
modules in ``BESIDE_SLURM`` in the other.

``PAIRED``: multi-process modules that time nothing (deadlines of minutes at most; the
benchmarks among them check which figures exist and how they add up, not how large they are)
and whose faults come at scripted steps, not from the test process while a job runs (under
twice the load such jobs outran their tests). Their workers wait on one another and on
process starts (the tier alone keeps the two cores ~40% busy), so two at once take far less
than one after the other. ``BESIDE_SLURM``: modules that check state and losses bit for bit
and time nothing, light enough to share the cores with the Slurm tier's mostly waiting jobs.
A module in neither set owns the cores: a new module runs alone unless it is put in one.
"""
import os
import pathlib

import pytest

TIERS = ("unit", "dist", "slurm", "gpu")
SLURM_TIER = "tests/slurm/"
BESIDE_SLURM = frozenset(f"tests/dist/{name}.py" for name in (
    "test_elastic", "test_verify", "test_verify_cli", "test_verify_moe", "test_planted_bugs",
    "test_resize_lost", "test_prepared_world", "test_migrate_lost", "test_inject_vote",
    "test_migrate_group", "test_pool_local", "test_device_routing", "test_widest_resumed"))

PAIRED = frozenset(f"tests/dist/{name}.py" for name in (
    "test_inject", "test_inject_demo", "test_node_lost_coordinator", "test_coordinator_local",
    "test_example", "test_example_worker", "test_own_script", "test_megatron_build",
    "test_migrate", "test_soak", "test_bench", "test_migrate_scaling", "test_data_phase_bench",
    "test_bench_control", "test_node_lost"))

SLURM_TIMEOUT_S = 600  # a Slurm test's least timeout (pyproject.toml's: 300 s)

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
        module = item.nodeid.split("::")[0]
        if module in BESIDE_SLURM:
            item.add_marker(pytest.mark.beside_slurm)
        elif module in PAIRED:
            item.add_marker(pytest.mark.paired)
        if item.nodeid.startswith(SLURM_TIER):
            # the first one also brings the cluster up (on a fresh machine: installs the
            # Debian packages) while the other process runs multi-process tests: at least
            # SLURM_TIMEOUT_S (a module's own longer timeout stays)
            mark = item.get_closest_marker("timeout")
            if mark is None or not mark.args or mark.args[0] < SLURM_TIMEOUT_S:
                item.add_marker(pytest.mark.timeout(SLURM_TIMEOUT_S))


def pytest_xdist_make_scheduler(config, log):
    """The Slurm tier is one unit of work (the largest, so the first given out); a module of
    the multi-process tier is one (its worker processes are started once per module); every
    unit test is one of its own, sent to whichever process is free. (xdist's own ``--dist
    loadgroup`` marks groups on a node id that pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(SLURM_TIER):
                return SLURM_TIER
            if nodeid.startswith("tests/dist/"):
                return nodeid.split("::")[0]
            return nodeid

    return TierScheduling(config, log)

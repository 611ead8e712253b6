"""Regenerate tests/fixtures/megatron/*.json from real megatron-core builds on 4 gloo ranks.

Run from the repository root after a megatron-core upgrade (or a change of the records):

    .venv/bin/python -m tests.dist.make_megatron_fixtures

``test_megatron_build.py::test_fixture_is_current`` fails until the fixtures match again.
"""
from __future__ import annotations

import logging

from slurm_etc.pool.local import LocalWorkers
from tests.dist.harness import DEFAULT_TIMEOUT_S
from tests.dist.megatron_cases import describe_build, dumps_fixture, fixture_payload
from tests.dist.test_megatron_build import CASES, FIXTURE_CASES, FIXTURE_DIR

logger = logging.getLogger(__name__)


def main() -> None:
    """Build every fixture case once and write its JSON file."""
    FIXTURE_DIR.mkdir(parents=True, exist_ok=True)
    with LocalWorkers(4, preload=("megatron.core", "slurm_etc.megatron.build"),
                      timeout_s=DEFAULT_TIMEOUT_S, default_group=True) as pool:
        for name in FIXTURE_CASES:
            model, config = CASES[name]
            per_rank = pool.run(describe_build, model, config)
            path = FIXTURE_DIR / f"{name}.json"
            path.write_text(dumps_fixture(fixture_payload(model, config, per_rank)))
            logger.info("wrote %s", path)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()

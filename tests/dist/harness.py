"""Module-scoped pools of gloo worker processes that tests reuse: start once, run many functions.

The pool is :class:`slurm_etc.pool.local.LocalWorkers` with ``default_group=True``: each
worker has joined one gloo default group over the pool's world size before it runs anything
and keeps it between calls; a function gets ``rank`` and ``world`` first, then the arguments
given to ``run``. A test module starts one pool per world size and runs each case as a
function on every rank::

    from tests.dist.harness import pool_fixture

    pool4 = pool_fixture(4, preload=("megatron.core",))

    def _case(rank, world, cfg):          # module level, so it pickles by reference
        ...
        return {"loss": loss}

    def test_case(pool4):
        results = pool4.run(_case, cfg)   # [result of rank 0, result of rank 1, ...]

The workers import the function's module by name, with the parent's ``sys.path``: under
``python -m pytest`` from the repository root, ``tests.dist.<module>`` works. Failures
(``WorkerError``, ``WorkerTimeout``, ``WorkerDied``) and restarts are the pool's: see
:mod:`slurm_etc.pool.local`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from slurm_etc.pool.local import LocalWorkers

DEFAULT_TIMEOUT_S = 120.0


def pool_fixture(world: int, *, preload: Sequence[str] = (), timeout_s: float = DEFAULT_TIMEOUT_S,
                 name: str | None = None) -> Callable[..., Iterator[LocalWorkers]]:
    """A module-scoped pytest fixture yielding a started pool of ``world`` gloo ranks.

    Assign it at module level, e.g. ``pool4 = pool_fixture(4)``; the fixture's name is the
    variable's name unless ``name`` is given.
    """

    @pytest.fixture(scope="module", name=name)
    def _pool() -> Iterator[LocalWorkers]:
        with LocalWorkers(world, preload=preload, timeout_s=timeout_s,
                          default_group=True) as pool:
            yield pool

    return _pool

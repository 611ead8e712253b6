"""Shared pieces of the experiments that hold the in-place resize against megatron-core's
checkpoint path: :mod:`.verify` (``slurm-etc verify``) and :mod:`.bench`
(``slurm-etc bench migrate``). Both run on local processes
(:class:`~slurm_etc.pool.local.LocalWorkers`, joined by a ``TCPStore`` the parent hosts;
each phase starts the ``gloo`` groups it needs from it, as the job's coordinator would) through
the worker phases of :mod:`.phases`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

Progress = Callable[[str], None]


def no_progress(message: str) -> None:
    pass


def first(values: Sequence[Any]) -> Any:
    """The first value that is not None (a phase's result from the worker that has one)."""
    return next((v for v in values if v is not None), None)


def json_default(value: Any) -> Any:
    """For ``json.dumps``: tuples and sets as lists."""
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")

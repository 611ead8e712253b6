"""click parameter types that carry their bound (slurm_etc/bounds.py), so that every option
that sizes something is refused past its bound while the command line is parsed, before a
command does anything, and so that tests/unit/test_bounds_property.py can find each bound on
the option itself: an option of a numeric or free-text type that is not one of these fails
that test.
"""
from __future__ import annotations

import os
from typing import Any

import click

from .. import bounds
from ..plan.config import ParallelConfig
from ..plan.errors import ConfigError


class BoundedType(click.ParamType):
    """A parameter type with a declared bound; ``past_bound()`` gives values it refuses."""

    def past_bound(self) -> list[str]:
        """Command-line values past the bound (the property test gives each)."""
        raise NotImplementedError


class Number(BoundedType):
    """An integer or a float within a Bound (finite: ``nan`` and ``inf`` are refused).

    Args:
        bound: the quantity's bound (its ``high`` always applies).
        low: a larger lower limit than the bound's own, for this option.
    """

    def __init__(self, bound: bounds.Bound, low: float | None = None) -> None:
        self.bound = bound if low is None else bounds.Bound(
            bound.quantity, low, bound.high, bound.why, bound.integer)
        self.name = "integer" if bound.integer else "float"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if len(text) > 64:  # int() of a long digit string is slow work, then refused
                self.fail(f"{len(text):,} characters is not a number of "
                          f"{self.bound.quantity}", param, ctx)
            try:
                value = int(text, 10) if self.bound.integer else float(text)
            except ValueError:
                self.fail(f"{value!r} is not {'an integer' if self.bound.integer else 'a number'}",
                          param, ctx)
        elif not self.bound.integer and isinstance(value, int):
            value = float(value)
        problem = self.bound.problem(value)
        if problem is not None:
            self.fail(problem, param, ctx)
        return value

    def past_bound(self) -> list[str]:
        past = self.bound.past()
        return [str(past), "nan" if not self.bound.integer else str(10 ** 30)]

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return (f"{'INTEGER' if self.bound.integer else 'FLOAT'} "
                f"{bounds.figure(self.bound.low)}..{bounds.figure(self.bound.high)}")


class NumberOrWord(Number):
    """A Number within its bound, or one word standing for a value of its own (``auto``).

    Args:
        word: the word; ``means``: the value it converts to.
    """

    def __init__(self, bound: bounds.Bound, word: str, means: Any) -> None:
        super().__init__(bound)
        self.word, self.means = word, means

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if value == self.means or (isinstance(value, str) and value.strip() == self.word):
            return self.means
        return super().convert(value, param, ctx)

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return f"{self.word}|{super().get_metavar(param, ctx)}"


class Text(BoundedType):
    """Free text of at most ``max_chars`` characters without control characters (a job name,
    a partition, an account, a model preset or file)."""

    name = "text"

    def __init__(self, max_chars: int = bounds.NAME_CHARS) -> None:
        self.max_chars = max_chars

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        try:
            return bounds.check_text("the value", value, self.max_chars)
        except bounds.BoundError as exc:
            self.fail(str(exc).removeprefix("the value "), param, ctx)

    def past_bound(self) -> list[str]:
        return ["x" * (self.max_chars + 1), "bad\x1b[2Jname", "two\nlines"]


class Layout(Text):
    """A parallel layout ``dp=N,tp=N,pp=N[,ep=N,cp=N,vpp=N]`` whose devices
    (dp x tp x pp x cp) are within the devices bound; the command parses it again with its
    own options."""

    name = "layout"

    def __init__(self) -> None:
        super().__init__(bounds.NAME_CHARS)

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        text = super().convert(value, param, ctx)
        try:
            config = ParallelConfig.parse(text)
            bounds.check_product(text, {"dp": config.dp, "tp": config.tp, "pp": config.pp,
                                        "cp": config.cp}, bounds.DEVICES)
        except (ConfigError, bounds.BoundError) as exc:
            self.fail(str(exc), param, ctx)
        return text

    def past_bound(self) -> list[str]:
        return [f"dp={bounds.GPUS + 1}", "dp=512,tp=512,pp=512", f"dp=1{'0' * 40}",
                "dp=512,tp=8,pp=8,cp=8"]


class SafePath(click.Path):
    """click.Path whose text is bounded and free of control characters: paths are printed
    in errors and stored in records."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_chars = bounds.PATH_CHARS

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        text = os.fsdecode(value) if isinstance(value, (bytes, os.PathLike)) else value
        try:
            bounds.check_text("the path", text, self.max_chars)
        except bounds.BoundError as exc:
            self.fail(str(exc).removeprefix("the path "), param, ctx)
        return super().convert(value, param, ctx)

    def past_bound(self) -> list[str]:
        return ["x" * (self.max_chars + 1), "bad\x1b[2Jname", "two\nlines"]


class Unbounded(click.ParamType):
    """A parameter that is deliberately not bounded here, with the reason (the property test
    accepts it only with a reason)."""

    name = "text"

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        return value


def count(bound: bounds.Bound, low: float | None = None) -> Number:
    """A bounded number option type (``type=count(bounds.NODES)``)."""
    return Number(bound, low)


def check_product(what: str, factors: dict[str, int | float], bound: bounds.Bound) -> None:
    """A product of options past its bound as click's usage error (one line, exit 2)."""
    try:
        bounds.check_product(what, factors, bound)
    except bounds.BoundError as exc:
        raise click.UsageError(str(exc)) from None

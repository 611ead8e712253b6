"""One bounds layer: the largest value of every size a user can type, checked before anything
is allocated or written.

Every command-line option, events-script field, trace field, model description field and
policy value that sizes memory, work or time is checked against one :class:`Bound` of this
module, and so are the products of bounded values that size something together (nodes x
GPUs per node, layers x hidden, dp x tp x pp, hours x nodes). The bounds are generous for
real clusters (131,072 GPUs on 16,384 nodes, runs of millions of steps, models up to ~10 T
parameters) and small enough that a value inside them cannot exhaust a login node's memory.
A refusal is a :class:`BoundError` with one line naming the value, the bound and why.

User-supplied free text (job names, partitions, accounts, paths that get printed) is bounded
in length and refused when it holds control characters (terminal escapes, newlines, bidi
overrides), so what is stored and printed later is what the user saw.

Pure: no I/O at import; ``read_capped`` reads a file only when called (plan/ and policy/ use
the checks, the readers of user files use ``read_capped``).
"""
from __future__ import annotations

import math
import os
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InputError


class BoundError(InputError, ValueError):
    """A value past its bound, or text with control characters: one line, exit 2."""


@dataclass(frozen=True)
class Bound:
    """The allowed range of one kind of quantity.

    Attributes:
        quantity: what it counts, as messages name it ("nodes", "seconds").
        low: the smallest allowed value.
        high: the largest allowed value.
        why: why the bound is where it is (shown in the README table, not in errors).
        integer: whether the value must be an integer.
    """

    quantity: str
    low: float
    high: float
    why: str
    integer: bool = True

    def check(self, what: str, value: object) -> None:
        """Raise BoundError unless ``value`` is a number (an integer where required, finite)
        within ``low..high``.

        Args:
            what: the option or field, as the user wrote it (``--nodes``, ``cluster.nodes``).
            value: the value to check.
        """
        problem = self.problem(value)
        if problem is not None:
            raise BoundError(f"{what}: {problem}")

    def problem(self, value: object) -> str | None:
        """What is wrong with ``value`` (``1e+08 exceeds the bound of 16,384 nodes``), or
        None when it is within the bound."""
        kind = "an integer" if self.integer else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be {kind}, got {shown(value)}"
        if self.integer and not isinstance(value, int):
            return f"must be an integer, got {shown(value)}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        if value < self.low:
            return f"must be at least {figure(self.low)}, got {shown(value)}"
        if value > self.high:
            return f"{shown(value)} exceeds the bound of {figure(self.high)} {self.quantity}"
        return None

    def past(self) -> int | float:
        """A value just past the bound (for tests and the property test)."""
        return int(self.high) + 1 if self.integer else self.high * 2 + 1


def figure(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def shown(value: object) -> str:
    """A value as messages show it: a huge integer by its digit count, not its digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 18:
        return f"a {len(str(abs(value)))}-digit number"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------- the bounds

GPUS = 131_072
NODES = Bound("nodes", 1, 16_384, "16,384 nodes x 8 GPUs is the devices bound")
GPUS_PER_NODE = Bound("devices per node", 1, 1_024,
                      "8 GPUs per node today (72 in an NVL72 domain); CPU worker slots")
DEVICES = Bound("devices", 1, GPUS, "above the largest training jobs reported (~100k GPUs)")
NODE_INDEX = Bound("node index", 0, NODES.high - 1, "an index into at most 16,384 nodes")
STEPS = Bound("steps", 0, 100_000_000, "1e6-step runs x 100")
BATCH = Bound("samples", 1, 1 << 24, "global batches of a few thousand samples today")
SECONDS = Bound("seconds", 0, 30 * 86_400, "30 days: beyond common Slurm time limits",
                integer=False)
WATCH_S = Bound("seconds", 0.2, 86_400, "one redraw a day at the least", integer=False)
HOURS = Bound("hours", 0.1, 24 * 366, "one simulated year", integer=False)
SIM_JOBS = Bound("elastic jobs", 1, 1_024, "more elastic jobs than one cluster runs")
SIM_SECONDS = Bound("seconds", 0, 366 * 86_400, "one simulated year", integer=False)
TRACE_EVENTS = Bound("events", 0, 1_000_000,
                     "about 2 years of the default 256-node synthetic cluster (1,384 events a "
                     "day); the simulator's time and memory grow with the events (35 s for "
                     "1,297 events measured here): a synthetic trace's expected count "
                     "(nodes x GPUs x hours x load, plus jobs x hours) is checked too")
TRACE_JOBS = Bound("elastic jobs", 0, 1_024, "as --jobs")
TRACE_POLICIES = Bound("policies", 0, 4_096, "a policy per partition and account")
SCRIPT_EVENTS = Bound("events", 0, 100_000, "a scripted local cluster, one event a step")
SOAK_EVENTS = Bound("events", 1, 10_000, "a soak's events run one after another, each "
                    "seconds to a minute: 10,000 is days")
LOAD = Bound("x the cluster", 0.0, 2.0, "offered load beyond twice the cluster is a queue",
             integer=False)
SEED = Bound("seed", 0, 2 ** 64 - 1, "a 64-bit seed")
PORT = Bound("port", 0, 65_535, "a TCP port (0: any free one)")
GBPS = Bound("GB/s", 0.001, 100_000.0, "100 TB/s per device: 100x NVLink 5", integer=False)
MEMORY_GIB = Bound("GiB", 0.001, 65_536.0, "64 TiB per device", integer=False)
TFLOPS = Bound("TFLOP/s", 0.001, 1_000_000.0, "1 EFLOP/s per device", integer=False)
MIB = Bound("MiB", 1, 1 << 20, "1 TiB of staging or probe memory per process")
REPEAT = Bound("repeats", 1, 1_000, "a benchmark repeated 1,000 times")
PROCESSES = Bound("local processes", 1, 1_024,
                  "processes on one machine (the local backend starts one per device it "
                  "holds, so its scripted cluster has at most this many devices)")
KEPT_CHECKPOINTS = Bound("checkpoints", 1, 1_000, "each is a full copy of the state")
REATTACH_WAIT_S = Bound("seconds", 5, 86_400, "a day without a coordinator", integer=False)
RESIZES_PER_HOUR = Bound("resizes per hour", 0, 3_600, "one a second")
DEGREE = Bound("degrees", 1, GPUS, "a parallel degree within the devices bound")
DEGREES = Bound("degrees in a list", 1, 64, "the distinct useful tp/pp degrees")

# Model descriptions (megatron-core GPTModel), with room above today's largest models.
LAYERS = Bound("layers", 1, 1_024, "126 in a 405 B model")
HIDDEN = Bound("hidden size", 1, 131_072, "16,384 in a 405 B model")
FFN = Bound("MLP size", 1, 1_048_576, "53,248 in a 405 B model")
HEADS = Bound("heads", 1, 4_096, "128 in a 405 B model")
VOCAB = Bound("tokens", 1, 1 << 24, "256k-token vocabularies today")
SEQ = Bound("tokens", 1, 1 << 23, "1M-token contexts today")
VOCAB_DIVISOR = Bound("(divisor)", 1, 1 << 16, "megatron's default is 128")
PARAMS = Bound("parameters", 1, 10 ** 13, "models up to ~2 T parameters, x 5")
EXPERTS = Bound("experts", 1, 4_096, "256 routed experts in DeepSeek-V3, x 16")
ROUTER_TOPK = Bound("experts per token", 1, 4_096, "8 in Qwen3-MoE and DeepSeek-V3; at most "
                    "the experts")

# Free text: a Slurm name, a job id, a path.
NAME_CHARS = 128
PATH_CHARS = 4_096
LINE_CHARS = 1_024   # an events script's reason, a layout sequence
FILE_BYTES = 64 << 20  # a model, hardware, trace or events file


def check_product(what: str, factors: Mapping[str, int | float], bound: Bound) -> None:
    """Raise BoundError when the product of ``factors`` (already bounded each) exceeds
    ``bound``, naming the factors: ``--nodes x --gpus-per-node = 100,000 x 1,024 = ...``."""
    product = math.prod(factors.values())
    if product > bound.high:
        parts = " x ".join(factors)
        values = " x ".join(figure(v) for v in factors.values())
        shown_as = f"{parts} = {values}" + (f" = {figure(product)}" if len(factors) > 1 else "")
        raise BoundError(f"{what}: {shown_as} exceeds the bound of {figure(bound.high)} "
                         f"{bound.quantity}")


# ---------------------------------------------------------------- text

# Bidirectional overrides and isolates reorder what a terminal shows (Trojan Source).
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def control_character(text: str) -> str | None:
    """The first control character of ``text`` as ``U+001B``, or None."""
    for ch in text:
        if unicodedata.category(ch) == "Cc" or ch in _BIDI:
            return f"U+{ord(ch):04X}"
    return None


def check_text(what: str, value: object, max_chars: int = NAME_CHARS) -> str:
    """``value`` if it is a string of at most ``max_chars`` without control characters.

    Raises:
        BoundError: naming the option or field, never echoing the characters themselves.
    """
    if not isinstance(value, str):
        raise BoundError(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise BoundError(f"{what} is {len(value):,} characters long; the bound is "
                         f"{max_chars:,}")
    bad = control_character(value)
    if bad is not None:
        raise BoundError(f"{what} holds the control character {bad}; control characters "
                         "(escapes, newlines, tabs, bidi overrides) are not allowed")
    return value


def read_capped(path: str | os.PathLike[str], limit: int = FILE_BYTES) -> bytes:
    """The bytes of a user's file, refusing one larger than ``limit`` before reading it all
    (``/dev/zero`` or a 10 GB file named by mistake).

    Raises:
        OSError: as ``open``/``read`` raise it (callers turn it into their one line).
        BoundError: the file is larger than ``limit``.
    """
    with Path(path).open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BoundError(f"larger than {limit >> 20} MiB; is it the right file?")
    return data


def json_int(digits: str) -> int:
    """``json.loads``'s ``parse_int``: an integer of more digits than any bound has is refused
    before Python converts it (beyond 4,300 digits ``int()`` raises a bare ValueError)."""
    if len(digits.lstrip("-")) > 40:
        raise BoundError(f"a {len(digits.lstrip('-')):,}-digit integer is past every bound")
    return int(digits)


def load_json(data: bytes) -> Any:
    """JSON from a user's file with bounded integers (``json_int``). Raises what
    ``json.loads`` raises (JSONDecodeError, UnicodeDecodeError, RecursionError) and
    BoundError."""
    import json

    return json.loads(data.decode(), parse_int=json_int)


def table() -> list[tuple[str, Bound]]:
    """Every named bound of this module, for the README table."""
    return [(name, b) for name, b in globals().items() if isinstance(b, Bound)]


def markdown_table() -> str:
    """The bounds as the Markdown table docs/bounds.md shows (a test keeps them equal)."""
    rows = ["| bound | range | of | why |", "|---|---|---|---|"]
    for name, b in table():
        rows.append(f"| `{name}` | {figure(b.low)} .. {figure(b.high)} | {b.quantity} | "
                    f"{b.why} |")
    rows.append(f"| text | at most {NAME_CHARS} characters (names, ids), {LINE_CHARS:,} "
                f"(a reason, a layout sequence, a node list), {PATH_CHARS:,} (paths, URLs) | "
                "characters | no control characters (C0, DEL, C1) nor bidi overrides |")
    rows.append(f"| files | at most {FILE_BYTES >> 20} MiB, JSON nested at most as deep as "
                "Python's recursion limit | bytes | a model, hardware, trace or events file |")
    return "\n".join(rows) + "\n"

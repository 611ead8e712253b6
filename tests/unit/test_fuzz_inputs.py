"""Property tests of every parser of user input: whatever the text or JSON, the parser returns
a value or raises its own error (the CLI turns it into one ``slurm-etc: error: ...`` line,
newlines in quoted input escaped), never another exception (which would be a traceback).

The control-message parsers are fuzzed in ``test_channel.py`` (``-k fuzz``).
"""
from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_etc import bounds
from slurm_etc.cli.cmd_plan import MAX_NODES, _node_list
from slurm_etc.local.script import ScriptError, parse_script
from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import MODEL_BOUNDS, ModelDesc
from slurm_etc.policy.rules import POLICY_BOUNDS, PolicyError, check_keys, parse_assignments
from slurm_etc.sim.trace import TraceError, parse_trace

pytestmark = pytest.mark.unit

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
    | st.text(max_size=12),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=25)


def keyed(names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with the parser's own field names (and a few others) and any values."""
    return st.dictionaries(st.sampled_from(names) | st.text(max_size=8), json_values,
                           max_size=len(names) + 1)


EVENT = keyed(["at_step", "grant", "preempt", "lose", "grace_s", "reason", "release"])
SCRIPT = st.fixed_dictionaries({}, optional={
    "nodes": json_values | st.integers(-3, 5), "gpus_per_node": json_values | st.integers(-1, 4),
    "initial_nodes": json_values | st.integers(-1, 4), "grace_s": json_values,
    "events": st.lists(EVENT, max_size=4) | json_values})


@FUZZ
@given(st.one_of(SCRIPT.map(json.dumps), json_values.map(json.dumps), st.text(max_size=200)))
def test_events_script_parser(text: str) -> None:
    try:
        parse_script(text, "fuzz.json")
    except ScriptError as exc:
        assert str(exc).startswith("fuzz.json")


MODEL_FIELDS = ["name", "num_layers", "hidden", "ffn_hidden", "num_heads", "vocab_size",
                "num_query_groups", "seq_length", "swiglu", "rmsnorm", "add_bias_linear",
                "learned_position_embeddings", "tied_embeddings", "param_dtype",
                "vocab_divisor"]
VALID_MODEL = {"num_layers": 2, "hidden": 64, "ffn_hidden": 256, "num_heads": 4,
               "vocab_size": 256}


@FUZZ
@given(keyed(MODEL_FIELDS) | json_values,
       st.dictionaries(st.sampled_from(MODEL_FIELDS), json_values, max_size=3))
def test_model_description_parser(data: Any, override: dict[str, Any]) -> None:
    for candidate in (data, {**VALID_MODEL, **override}):
        try:
            model = ModelDesc.from_json(candidate)
        except ConfigError:
            continue
        assert model.num_layers > 0 and model.hidden % model.num_heads == 0


@FUZZ
@given(st.text(max_size=40) | st.lists(st.sampled_from(["dp", "tp", "pp", "x", "=", ",", "1",
                                                       "-2", "0", "8", "1.5", " "]),
                                       max_size=12).map("".join))
def test_layout_parser(text: str) -> None:
    try:
        cfg = ParallelConfig.parse(text)
    except ConfigError:
        return
    assert cfg.dp >= 1 and cfg.tp >= 1 and cfg.pp >= 1


@FUZZ
@given(st.text(max_size=30) | st.lists(st.sampled_from(["0", "3", "-", ",", "7", "x", " ",
                                                       "-1", "99999999999999999999"]),
                                       max_size=10).map("".join))
def test_node_list_parser(text: str) -> None:
    from slurm_etc.cli.main import UserError

    try:
        nodes = _node_list(text)
    except (UserError, ConfigError):
        return
    assert all(isinstance(n, int) and n >= 0 for n in nodes) and len(nodes) <= MAX_NODES


POLICY_KEYS = ["min_nodes", "max_nodes", "allowed_tp", "allowed_pp", "grow",
               "grow_partition", "grow_qos", "preempt_grace_s", "max_resizes_per_hour",
               "request_patience_s"]


@FUZZ
@given(st.lists(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(POLICY_KEYS)
                          | st.text(max_size=6), st.text(max_size=12))
                | st.text(max_size=20), max_size=4))
def test_policy_assignment_parser(items: list[str]) -> None:
    try:
        parse_assignments(items)
    except PolicyError:
        pass
    try:
        check_keys([i.partition("=")[0] for i in items])
    except PolicyError:
        pass


TRACE = st.fixed_dictionaries({}, optional={
    "cluster": keyed(["nodes", "gpus_per_node", "partitions"]) | json_values,
    "jobs": st.lists(keyed(["id", "name", "model", "min_nodes", "max_nodes", "partition",
                            "account", "tp", "pp"]), max_size=3) | json_values,
    "events": st.lists(keyed(["t", "kind", "job", "nodes", "grace_s"]), max_size=3)
    | json_values,
    "policies": json_values})


@FUZZ
@given(TRACE | json_values)
def test_trace_parser(data: Any) -> None:
    try:
        parse_trace(data, "fuzz")  # type: ignore[arg-type]
    except TraceError:
        pass


# ---------------------------------------------------------------- sizes (slurm_etc/bounds.py)
# Whatever huge number a size field gets, the parser refuses it with its own error naming the
# field, and every model it accepts is within every bound (the parameter count too).

BIG = st.integers(1, 2**80) | st.floats(allow_nan=True, allow_infinity=True)
SIZES = settings(FUZZ, max_examples=100)


@SIZES
@given(st.dictionaries(st.sampled_from(sorted(MODEL_BOUNDS)), BIG, min_size=1, max_size=4))
def test_model_sizes_are_bounded(sizes: dict[str, Any]) -> None:
    try:
        model = ModelDesc.from_json({**VALID_MODEL, **sizes})
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    for f, bound in MODEL_BOUNDS.items():
        value = getattr(model, f)
        assert value is None or bound.low <= value <= bound.high
    assert model.parameter_estimate() <= bounds.PARAMS.high


@SIZES
@given(st.sampled_from(sorted(POLICY_BOUNDS)), st.integers(-(2**80), 2**80),
       st.sampled_from(["", "s", "m", "h"]))
def test_policy_values_are_bounded(key: str, value: int, unit: str) -> None:
    raw = f"{value}{unit if key in ('preempt_grace_s', 'request_patience_s') else ''}"
    try:
        parsed = parse_assignments([f"{key}={raw}"])[key]
    except PolicyError as exc:
        assert key in str(exc) or "integer" in str(exc)
        return
    bound = POLICY_BOUNDS[key]
    for v in parsed if isinstance(parsed, tuple) else (parsed,):
        assert isinstance(v, int) and v <= bound.high


@SIZES
@given(st.integers(1, 2**70), st.integers(1, 2**70))
def test_script_clusters_are_bounded(nodes: int, gpus_per_node: int) -> None:
    try:
        script = parse_script(json.dumps({"nodes": nodes, "gpus_per_node": gpus_per_node}),
                              "fuzz.json")
    except ScriptError as exc:
        assert str(exc).startswith("fuzz.json")
        return
    assert nodes * gpus_per_node <= bounds.PROCESSES.high
    assert len(script.topology.nodes) == nodes

"""Every size a user can type is bounded before anything is allocated or written.

The test FINDS what to try instead of listing it: it walks the click command tree
(``slurm_etc.cli.main.cli``) for every parameter of every command, and the schemas (the
model description, the trace's parts, the events script, the policy fields) for every numeric
field. A parameter whose type is not a bounded type of ``slurm_etc/cli/params.py`` (flags,
counts and fixed choices aside) fails it, and so does a numeric schema field without an entry
in its module's bounds table: a new option or field without a bound cannot land unseen.

Each bounded parameter and field is then given values past its bound (and text parameters
control characters) and must give: exit 2, exactly one line on stderr and no traceback, a
refusal within seconds, and no file created or changed anywhere (a fresh working directory,
HOME, XDG and state directories, compared before and after). Most runs are in process
(CliRunner); the cases the issue found run as the real ``slurm-etc`` executable under a 4 GB
address-space limit (RLIMIT_AS) and a 60 s timeout, which is what shows the memory claim.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from slurm_etc import bounds
from slurm_etc.cli import params
from slurm_etc.cli.main import cli
from slurm_etc.local.script import EVENT_BOUNDS, SCRIPT_BOUNDS, EventSpec, ScriptSpec
from slurm_etc.plan.model import MODEL_BOUNDS, ModelDesc
from slurm_etc.policy.admin import AdminVerdict
from slurm_etc.policy.rules import FIELDS, POLICY_BOUNDS
from slurm_etc.sim.trace import TRACE_BOUNDS

pytestmark = pytest.mark.unit

EXE = Path(sys.executable).with_name("slurm-etc")
ADMIN = {"admin_check": lambda: AdminVerdict(True, "Slurm Administrator", "admin")}
MEMORY_LIMIT = 4_000_000 * 1024  # `ulimit -v 4000000`, as the issue measured
REFUSAL_S = 5.0
MODEL = {"name": "m", "num_layers": 2, "hidden": 64, "ffn_hidden": 256, "num_heads": 4,
         "vocab_size": 256, "seq_length": 64, "param_dtype": "fp32"}
WORKER = ["--", sys.executable, "-c", "pass"]
RUN = ["run", "--model", "tiny", "--global-batch", "8"]
LAYOUTS = ["--from", "dp=1", "--to", "dp=2"]


# ---------------------------------------------------------------- the sandbox


@pytest.fixture()
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for sub in ("home", "state", "tmp", "cwd", "xdg-data", "xdg-config", "xdg-state"):
        (tmp_path / sub).mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    yield tmp_path


def _env(box: Path) -> dict[str, str]:
    return {"HOME": str(box / "home"), "XDG_DATA_HOME": str(box / "xdg-data"),
            "XDG_CONFIG_HOME": str(box / "xdg-config"), "XDG_STATE_HOME": str(box / "xdg-state"),
            "SLURM_ETC_STATE_DIR": str(box / "state"), "TMPDIR": str(box / "tmp"),
            "SLURM_ETC_DB": "", "SLURM_JOB_ID": "", "SLURM_TMPDIR": "", "COLUMNS": "200"}


def _tree(box: Path) -> dict[str, tuple[str, int]]:
    out = {}
    for path in sorted(box.rglob("*")):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        out[str(path.relative_to(box))] = (digest, st.st_mtime_ns)
    return out


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert lines[0].startswith("slurm-etc: error: "), lines[0]
    assert "Traceback" not in stderr
    assert "\x1b" not in stderr, "a control character was echoed"
    return lines[0]


def refuse(box: Path, args: list[str], words: str = "") -> str:
    """Run ``args`` in process; assert the refusal and return its line."""
    before = _tree(box)
    started = time.monotonic()
    r = CliRunner().invoke(cli, args, obj=dict(ADMIN), env=_env(box))
    took = time.monotonic() - started
    assert r.exception is None or isinstance(r.exception, SystemExit), (
        f"{type(r.exception).__name__} escaped for {args}: {r.exception}")
    assert r.exit_code == 2, (args, r.exit_code, r.stderr, r.stdout)
    line = _one_line(r.stderr)
    assert words in line, f"{words!r} not in {line!r}"
    assert r.stdout == ""
    assert _tree(box) == before, f"{args} created or changed files"
    assert took < REFUSAL_S, f"{args}: the refusal took {took:.1f} s"
    return line


# ---------------------------------------------------------------- finding the options


def _commands(group: click.Command, path: tuple[str, ...] = ()
              ) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    yield path, group
    if isinstance(group, click.Group):
        for name, sub in sorted(group.commands.items()):
            yield from _commands(sub, (*path, name))


def _exempt(p: click.Parameter) -> bool:
    """Flags, counts (bounded by the command line itself) and fixed choices."""
    if isinstance(p, click.Option) and (p.is_flag and not isinstance(p.type, params.Number)
                                        or p.count):
        return True
    return isinstance(p.type, click.Choice)


def sizing_params(root: click.Command = cli
                  ) -> Iterator[tuple[tuple[str, ...], click.Command, click.Parameter]]:
    for path, command in _commands(root):
        for p in command.params:
            if not _exempt(p):
                yield path, command, p


def _unbounded(root: click.Command = cli) -> list[str]:
    """Parameters with neither a bound nor a stated reason for having none."""
    out = []
    for path, _, p in sizing_params(root):
        if isinstance(p.type, (params.BoundedType, params.SafePath)):
            continue
        if isinstance(p.type, params.Unbounded) and p.type.reason.strip():
            continue
        out.append(f"{' '.join(path) or 'slurm-etc'} {p.opts[0] if p.opts else p.name} "
                   f"({p.type.name})")
    return out


def _argv(path: tuple[str, ...], command: click.Command, p: click.Parameter,
          value: str) -> list[str]:
    """A command line that gives ``value`` to ``p`` (first, so it is converted first)."""
    given = [p.opts[0], value] if isinstance(p, click.Option) else [value]
    if isinstance(command, click.Group):  # a group's option: any subcommand after it
        sub = sorted(command.commands)[0]
        return [*path, *given, sub]
    return [*path, *given]


def _past_values(p: click.Parameter) -> list[str]:
    t = p.type
    assert isinstance(t, (params.BoundedType, params.SafePath))
    return t.past_bound()


CASES = [(path, command, p, value) for path, command, p in sizing_params()
         if isinstance(p.type, (params.BoundedType, params.SafePath))
         for value in _past_values(p)]


def test_every_parameter_of_every_command_has_a_bound() -> None:
    assert _unbounded() == []
    # the walk sees the whole tree: every command, and the issue's options among them
    found = {(" ".join(path), p.opts[0] if p.opts else p.name)
             for path, _, p in sizing_params()}
    for expected in [("simulate", "--nodes"), ("simulate", "--hours"), ("plan", "--add-nodes"),
                     ("run", "--gpus-per-node"), ("run", "--name"), ("policy set", "assignments"),
                     ("bench migrate", "--p2p-mb"), ("status", "--watch"),
                     ("verify", "--steps"), ("demo", "--steps")]:
        assert expected in found, expected
    assert len(CASES) > 150


def test_a_new_option_without_a_bound_is_caught() -> None:
    """The planted missing bound: a copy of ``plan`` with one more numeric option, and one
    more text option, declared the way the code did before this layer."""
    from slurm_etc.cli.cmd_plan import plan

    planted = click.Command("plan", params=[*plan.params,
                                            click.Option(["--max-rounds"], type=int),
                                            click.Option(["--label"])])
    root = click.Group("slurm-etc", commands={"plan": planted})
    assert _unbounded(root) == ["plan --max-rounds (integer)", "plan --label (text)"]


@pytest.mark.parametrize(("path", "command", "param", "value"), CASES,
                         ids=[f"{' '.join(c[0])}-{c[2].name}-{i}" for i, c in enumerate(CASES)])
def test_past_its_bound_every_parameter_is_refused(box: Path, path: tuple[str, ...],
                                                   command: click.Command,
                                                   param: click.Parameter, value: str) -> None:
    refuse(box, _argv(path, command, param, value))


# ---------------------------------------------------------------- finding the schema fields


def _numeric_fields(cls: Any) -> list[str]:
    """Fields annotated int or float (optional too) of a dataclass or msgspec Struct."""
    if dataclasses.is_dataclass(cls):
        annotated = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    else:
        annotated = {name: str(cls.__annotations__[name]) for name in cls.__struct_fields__}
    words = ("int", "float", "_Count", "_Target")
    return [name for name, text in annotated.items()
            if any(w in text.replace("[", " ").replace("|", " ").replace(",", " ").split()
                   for w in words) or text.startswith(("Annotated[int", "Annotated[float"))]


@pytest.mark.parametrize(("cls", "table"), [
    (ModelDesc, MODEL_BOUNDS), *[(c, t) for c, t in TRACE_BOUNDS.items()],
    (ScriptSpec, SCRIPT_BOUNDS), (EventSpec, EVENT_BOUNDS)], ids=lambda x: getattr(
        x, "__name__", "bounds"))
def test_every_numeric_schema_field_has_a_bound(cls: Any, table: dict) -> None:
    numeric = _numeric_fields(cls)
    assert numeric, f"no numeric field found in {cls.__name__}: the walk is broken"
    assert sorted(set(numeric) - set(table)) == []


def test_every_numeric_policy_field_has_a_bound() -> None:
    from slurm_etc.policy.rules import ResizePolicy

    numeric = [f.name for f in dataclasses.fields(ResizePolicy)
               if "int" in str(f.type)]
    assert set(numeric) == set(POLICY_BOUNDS) and set(POLICY_BOUNDS) <= set(FIELDS)


def test_the_field_walk_finds_a_planted_field() -> None:
    @dataclasses.dataclass
    class Planted:
        name: str
        nodes: int
        ratio: float | None = None

    assert _numeric_fields(Planted) == ["nodes", "ratio"]


def _write(box: Path, name: str, data: object) -> str:
    path = box / "tmp" / name
    path.write_text(json.dumps(data))
    return str(path)


MODEL_FIELD_CASES = [(f, b.past()) for f, b in MODEL_BOUNDS.items()]


@pytest.mark.parametrize(("field", "value"), MODEL_FIELD_CASES, ids=[c[0] for c in
                                                                     MODEL_FIELD_CASES])
def test_model_fields_past_their_bound(box: Path, field: str, value: int) -> None:
    model = _write(box, "model.json", {**MODEL, field: value})
    refuse(box, ["plan", "--model", model, *LAYOUTS], field)


TRACE = {"cluster": {"nodes": 4, "gpus_per_node": 2},
         "jobs": [{"name": "e", "model": "tiny", "global_batch": 8, "nodes": 1}],
         "events": [{"t": 1, "kind": "fail", "node": 0}], "duration": 100}
_PART = {"ClusterSpec": "cluster", "ElasticJobSpec": "jobs", "Event": "events"}
TRACE_FIELD_CASES = [(cls.__name__, f, b.past()) for cls, table in TRACE_BOUNDS.items()
                     for f, b in table.items()]


@pytest.mark.parametrize(("part", "field", "value"), TRACE_FIELD_CASES,
                         ids=[f"{c[0]}.{c[1]}" for c in TRACE_FIELD_CASES])
def test_trace_fields_past_their_bound(box: Path, part: str, field: str, value: float) -> None:
    trace = json.loads(json.dumps(TRACE))
    key = _PART[part]
    if key == "cluster":
        trace[key][field] = value
    else:
        trace[key][0][field] = value
    refuse(box, ["simulate", "--trace", _write(box, "trace.json", trace)], field)


SCRIPT_FIELD_CASES = ([("script", f, b.past()) for f, b in SCRIPT_BOUNDS.items()]
                      + [("event", f, b.past()) for f, b in EVENT_BOUNDS.items()])


@pytest.mark.parametrize(("where", "field", "value"), SCRIPT_FIELD_CASES,
                         ids=[f"{c[0]}.{c[1]}" for c in SCRIPT_FIELD_CASES])
def test_events_script_fields_past_their_bound(box: Path, where: str, field: str,
                                               value: float) -> None:
    script: dict[str, Any] = {"nodes": 4, "gpus_per_node": 2, "events": [
        {"at_step": 1, "grant": 1}]}
    if where == "script":
        script[field] = value
    else:
        event = {"at_step": 1, field: value} if field not in ("at_step", "grace_s") else {
            "at_step": 1, "preempt": 1, field: value}
        script["events"] = [event]
    events = _write(box, "events.json", script)
    refuse(box, [*RUN, "--events", events, *WORKER], field)


POLICY_FIELD_CASES = [(f, str(b.past())) for f, b in POLICY_BOUNDS.items()]


@pytest.mark.parametrize(("field", "value"), POLICY_FIELD_CASES,
                         ids=[c[0] for c in POLICY_FIELD_CASES])
def test_policy_values_past_their_bound(box: Path, field: str, value: str) -> None:
    db = box / "tmp" / "policy.db"
    refuse(box, ["policy", "--db", str(db), "set", "--partition", "gpu", f"{field}={value}"],
           field)
    assert not db.exists()


# ---------------------------------------------------------------- products, and the issue's


# (id, arguments (files written first: name -> JSON), words in the one line)
PRODUCT_AND_FOUND: list[tuple[str, list[str], dict[str, object], str]] = [
    ("simulate-nodes-1e8", ["simulate", "--synthetic", "--nodes", "100000000"], {}, "--nodes"),
    ("simulate-jobs-1e8", ["simulate", "--synthetic", "--jobs", "100000000"], {}, "--jobs"),
    ("simulate-hours-1e9", ["simulate", "--synthetic", "--hours", "1e9"], {}, "--hours"),
    ("simulate-nodes-x-gpus", ["simulate", "--synthetic", "--nodes", "16384",
                               "--gpus-per-node", "1024"], {}, "gpus_per_node"),
    ("simulate-nodes-x-hours", ["simulate", "--synthetic", "--nodes", "16384", "--hours",
                                "8000"], {}, "events"),
    ("simulate-jobs-x-hours", ["simulate", "--synthetic", "--jobs", "1024", "--hours",
                               "8000", "--nodes", "2"], {}, "events"),
    ("trace-cluster-nodes-1e8", ["simulate", "--trace", "{t}"],
     {"t": {**TRACE, "cluster": {"nodes": 100_000_000, "gpus_per_node": 2}}}, "nodes"),
    ("trace-gpus-per-node-1e8", ["simulate", "--trace", "{t}"],
     {"t": {**TRACE, "cluster": {"nodes": 4, "gpus_per_node": 100_000_000}}},
     "gpus_per_node"),
    ("trace-nodes-x-gpus", ["simulate", "--trace", "{t}"],
     {"t": {**TRACE, "cluster": {"nodes": 16384, "gpus_per_node": 1024}}}, "devices"),
    ("trace-job-name-escape", ["simulate", "--trace", "{t}"],
     {"t": {**TRACE, "jobs": [{**TRACE["jobs"][0], "name": "e\x1b[2J"}]}},  # type: ignore
     "control character"),
    ("trace-deeply-nested", ["simulate", "--trace", "{t}"], {"t": "[" * 200_000},
     "nests too deeply"),
    ("run-nodes-100000-gpus-1024", ["run", "--nodes", "100000", "--gpus-per-node", "1024",
                                    "--model", "tiny", "--global-batch", "8", *WORKER], {},
     "--nodes"),
    ("run-nodes-x-gpus", ["run", "--nodes", "16384", "--gpus-per-node", "1024", "--model",
                          "tiny", "--global-batch", "8", *WORKER], {}, "1,024 local processes"),
    ("run-events-nodes-x-gpus", [*RUN, "--events", "{e}", *WORKER],
     {"e": {"nodes": 16384, "gpus_per_node": 1024}}, "1,024 local processes"),
    ("run-events-local-processes", [*RUN, "--events", "{e}", *WORKER],
     {"e": {"nodes": 513, "gpus_per_node": 2}}, "1,026"),
    ("run-events-reason-escape", [*RUN, "--events", "{e}", *WORKER],
     {"e": {"nodes": 2, "events": [{"at_step": 1, "grant": 1, "reason": "\x1b]0;x\x07"}]}},
     "control character"),
    ("run-events-too-many", [*RUN, "--events", "{e}", *WORKER],
     {"e": {"nodes": 2, "events": [{"at_step": 1, "grant": 1}] * 100_001}}, "events"),
    ("run-name-300", [*RUN, "--name", "n" * 300, *WORKER], {}, "--name"),
    ("run-name-escape", [*RUN, "--name", "job\x1b[31m", *WORKER], {}, "control character"),
    ("run-name-bidi", [*RUN, "--name", "job\u202egnp.exe", *WORKER], {}, "U+202E"),
    ("run-timeout-nan", [*RUN, "--timeout", "nan", *WORKER], {}, "--timeout"),
    ("run-timeout-inf", [*RUN, "--timeout", "inf", *WORKER], {}, "--timeout"),
    ("run-checkpoint-dir-not-made", [*RUN, "--checkpoint-every", "1", "--checkpoint-dir",
                                     "{box}/cwd/ck", "--events", "{e}", *WORKER],
     {"e": {"nodes": 16384, "gpus_per_node": 1024}}, "local processes"),
    ("plan-add-nodes-1e11", ["plan", "--model", "tiny", *LAYOUTS, "--add-nodes",
                             "100000000000"], {}, "--add-nodes"),
    ("plan-add-nodes-x-gpus", ["plan", "--model", "tiny", *LAYOUTS, "--add-nodes", "200",
                               "--gpus-per-node", "1024"], {}, "devices"),
    ("plan-add-nodes-past-nodes", ["plan", "--model", "tiny", *LAYOUTS, "--add-nodes",
                                   "16384"], {}, "16,384 nodes"),
    ("plan-layout-past-devices", ["plan", "--model", "tiny", "--from", "dp=1", "--to",
                                  "dp=64,tp=64,pp=64"], {}, "--to"),
    ("plan-bandwidth-nan", ["plan", "--model", "tiny", *LAYOUTS, "--intra-node-gbps", "nan"],
     {}, "--intra-node-gbps"),
    ("model-hidden-4.48e12", ["plan", "--model", "{m}", *LAYOUTS],
     {"m": {**MODEL, "hidden": 4_480_000_000_000}}, "hidden"),
    ("model-vocab-divisor-1e17", ["plan", "--model", "{m}", *LAYOUTS],
     {"m": {**MODEL, "vocab_divisor": 10 ** 17}}, "vocab_divisor"),
    ("model-layers-x-hidden", ["plan", "--model", "{m}", *LAYOUTS],
     {"m": {**MODEL, "num_layers": 1024, "hidden": 131072, "num_heads": 128,
            "ffn_hidden": 524288}}, "parameters"),
    ("model-name-escape", ["plan", "--model", "{m}", *LAYOUTS],
     {"m": {**MODEL, "name": "m\x1b[2J"}}, "control character"),
    ("model-5000-digits", ["plan", "--model", "{m}", *LAYOUTS],
     {"m": json.dumps(MODEL).replace('"hidden": 64', '"hidden": ' + "9" * 5000)}, "digit"),
    ("trace-5000-digits", ["simulate", "--trace", "{t}"],
     {"t": json.dumps(TRACE).replace('"nodes": 4', '"nodes": ' + "9" * 5000)}, "digit"),
    ("hardware-5000-digits", [*RUN, "--hardware", "{h}", *WORKER],
     {"h": '{"memory_gib": ' + "9" * 5000 + "}"}, "digit"),
    ("model-deeply-nested", ["plan", "--model", "{m}", *LAYOUTS], {"m": "[" * 200_000},
     "nests too deeply"),
    ("policy-max-nodes-1e20", ["policy", "--db", "{box}/tmp/p.db", "set", "--partition", "gpu",
                               "max_nodes=100000000000000000000"], {}, "max_nodes"),
    ("policy-grace-1e20-hours", ["policy", "--db", "{box}/tmp/p.db", "set", "--partition",
                                 "gpu", "preempt_grace_s=99999999999999999999h"], {},
     "preempt_grace_s"),
    ("policy-resizes-2-63", ["policy", "--db", "{box}/tmp/p.db", "set", "--partition", "gpu",
                             f"max_resizes_per_hour={2 ** 63}"], {}, "max_resizes_per_hour"),
    ("policy-negative-not-created", ["policy", "--db", "{box}/tmp/p.db", "set", "--partition",
                                     "gpu", "min_nodes=-2"], {}, "min_nodes"),
    ("policy-tp-list-too-long", ["policy", "--db", "{box}/tmp/p.db", "set", "--partition",
                                 "gpu", "allowed_tp=" + ",".join(map(str, range(1, 66)))], {},
     "allowed_tp"),
    ("policy-value-digits", ["policy", "--db", "{box}/tmp/p.db", "set", "--partition", "gpu",
                             "max_nodes=" + "9" * 1030], {}, "characters"),
    ("bench-p2p-mb-huge", ["bench", "migrate", "--model", "tiny", *LAYOUTS, "--p2p-mb",
                           str(10 ** 9)], {}, "--p2p-mb"),
    ("verify-steps-1e30", ["verify", "--model", "tiny", *LAYOUTS, "--steps", str(10 ** 30)],
     {}, "--steps"),
    ("demo-steps-1e12", ["demo", "--steps", str(10 ** 12)], {}, "--steps"),
    ("status-job-id-escape", ["status", "j\x1b[2J"], {}, "control character"),
    ("status-watch-inf", ["status", "--watch", "inf"], {}, "--watch"),
]


def _materialise(box: Path, args: list[str], files: dict[str, object]) -> list[str]:
    paths = {}
    for key, data in files.items():
        path = box / "tmp" / f"{key}.json"
        path.write_text(data if isinstance(data, str) else json.dumps(data))
        paths[key] = str(path)
    out = []
    for a in args:
        for key, path in paths.items():
            a = a.replace("{" + key + "}", path)
        out.append(a.replace("{box}", str(box)))
    return out


@pytest.mark.parametrize(("args", "files", "words"), [c[1:] for c in PRODUCT_AND_FOUND],
                         ids=[c[0] for c in PRODUCT_AND_FOUND])
def test_products_and_the_cases_found(box: Path, args: list[str], files: dict[str, object],
                                      words: str) -> None:
    refuse(box, _materialise(box, args, files), words)
    assert not (box / "tmp" / "p.db").exists()
    assert not (box / "cwd" / "ck").exists()


def test_sizes_inside_the_bounds_still_work(box: Path) -> None:
    """The bounds leave real sizes alone: a plan of a 2 T-parameter-class model on 16,384
    nodes is planned (not refused), and a 256-node day is simulated."""
    big = _write(box, "big.json", {"name": "big", "num_layers": 128, "hidden": 32768,
                                   "ffn_hidden": 131072, "num_heads": 256,
                                   "vocab_size": 256000, "seq_length": 8192,
                                   "tied_embeddings": False})
    r = CliRunner().invoke(cli, ["plan", "--model", big, "--from", "dp=1,tp=8,pp=16",
                                 "--to", "dp=2,tp=8,pp=16", "--json"], env=_env(box))
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["new_devices"] == 256
    assert ModelDesc.from_json(json.loads(Path(big).read_text())).parameter_estimate() > 1.5e12
    from slurm_etc.sim.synthetic import check_size

    check_size(16_384, 8, 1_024, 1.0, 0.85)  # the largest cluster for an hour: accepted


# The issue's cases through the real executable, under the memory limit it measured with.
EXE_CASES = ["simulate-hours-1e9", "trace-cluster-nodes-1e8", "run-nodes-100000-gpus-1024",
             "run-events-nodes-x-gpus", "plan-add-nodes-1e11", "model-hidden-4.48e12",
             "policy-max-nodes-1e20"]


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.parametrize("case", EXE_CASES)
def test_the_issue_cases_under_a_memory_limit(box: Path, case: str) -> None:
    args, files, words = next(c[1:] for c in PRODUCT_AND_FOUND if c[0] == case)
    argv = _materialise(box, args, files)  # type: ignore[arg-type]
    assert EXE.is_file(), f"{EXE} is missing: pip install -e . in the venv"
    before = _tree(box)
    proc = subprocess.run([str(EXE), *argv], capture_output=True, text=True,
                          env={**os.environ, **_env(box)}, cwd=box / "cwd", timeout=60,
                          preexec_fn=_limit_memory)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert words in _one_line(proc.stderr)
    assert proc.stdout == ""
    assert _tree(box) == before


def test_a_yaml_script_with_aliases_is_refused(box: Path) -> None:
    """A few lines of YAML aliases expand to billions of values when checked."""
    pytest.importorskip("yaml")
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n"
        for i in range(8))
    events = box / "tmp" / "events.yaml"
    events.write_text(f"{laughs}nodes: 2\nevents: [{{at_step: 1, grant: 1, reason: *i}}]\n")
    refuse(box, [*RUN, "--events", str(events), *WORKER], "aliases")


# ---------------------------------------------------------------- the documented table

DOC = Path(__file__).resolve().parents[2] / "docs" / "bounds.md"
DOC_HEAD = """# Bounds: every size a user can type

Generated from `slurm_etc/bounds.py`, the click definitions and the schemas' bounds tables by
`python -m tests.unit.test_bounds_property > docs/bounds.md`;
`tests/unit/test_bounds_property.py` fails when this file and the code differ, when an option
or a numeric field has no bound, and unless every bound below refuses a value past it with one
line, exit 2 and nothing written.

A value past its bound is refused while the command line or the file is parsed, before
anything is allocated, opened or written; products of bounded values are bounded too
(nodes x GPUs per node, dp x tp x pp x cp, a model's parameters, the old layout's nodes plus
`--add-nodes`, a synthetic trace's expected events).

"""


def _where() -> dict[tuple[str, float, float], list[str]]:
    """Each bound (by quantity and range) -> the options and fields it bounds."""
    out: dict[tuple[str, float, float], list[str]] = {}

    def add(b: bounds.Bound, where: str) -> None:
        out.setdefault((b.quantity, b.high, b.why), []).append(where)

    for path, _, p in sizing_params():
        if isinstance(p.type, params.Number):
            add(p.type.bound, f"`{' '.join(path)} {p.opts[0]}`")
        elif isinstance(p.type, params.Layout):
            add(bounds.DEVICES, f"`{' '.join(path)} {p.opts[0]}` (dp x tp x pp x cp)")
    for f, b in MODEL_BOUNDS.items():
        add(b, f"model `{f}`")
    for cls, table in TRACE_BOUNDS.items():
        for f, b in table.items():
            add(b, f"trace {_PART[cls.__name__]} `{f}`")
    for f, b in {**SCRIPT_BOUNDS}.items():
        add(b, f"events script `{f}`")
    for f, b in EVENT_BOUNDS.items():
        add(b, f"events script event `{f}`")
    for f, b in POLICY_BOUNDS.items():
        add(b, f"policy `{f}`")
    return out


# Bounds on counts and products, which no single option or field carries.
COUNTS = {
    "DEVICES": "nodes x GPUs per node of `simulate`, `plan` (with `--add-nodes`), a "
               "trace's cluster",
    "PROCESSES": "the local backend's cluster: `run --nodes` x `--gpus-per-node`, an events "
                 "script's `nodes` x `gpus_per_node`",
    "NODES": "`plan`: the old layout's nodes + `--add-nodes`",
    "TRACE_EVENTS": "events in a trace; a synthetic trace's expected events",
    "TRACE_JOBS": "elastic jobs in a trace", "TRACE_POLICIES": "policies in a trace",
    "SCRIPT_EVENTS": "events in an events script",
    "DEGREES": "policy `allowed_tp`/`allowed_pp`: degrees in the list",
    "PARAMS": "a model's parameters (layers x (attention + MLP or experts) + embeddings)",
}


def render_bounds_doc() -> str:
    where = _where()
    for name, b in bounds.table():
        if name in COUNTS:
            where.setdefault((b.quantity, b.high, b.why), []).append(COUNTS[name])
    rows = ["| bound | range | of | applies to | why |", "|---|---|---|---|---|"]
    for name, b in bounds.table():
        used = where.get((b.quantity, b.high, b.why), [])
        rows.append(f"| `{name}` | {bounds.figure(b.low)} .. {bounds.figure(b.high)} | "
                    f"{b.quantity} | {', '.join(used)} | {b.why} |")
    text = bounds.markdown_table().splitlines()[-2:]
    rows += [r.replace(" | characters | ", " | characters | every text option and field | ")
             .replace(" | bytes | ", " | bytes | `--model`, `--hardware`, `--trace`, "
                      "`--events` files | ") for r in text]
    return DOC_HEAD + "\n".join(rows) + "\n"


def test_the_documented_table_is_the_code() -> None:
    assert DOC.read_text() == render_bounds_doc(), (
        "docs/bounds.md differs from the code: regenerate it (see its first lines)")


if __name__ == "__main__":
    print(render_bounds_doc(), end="")

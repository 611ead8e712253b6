"""Every module of the package imports on its own, and every error it raises on purpose
has the one root (slurm_etc.errors) whose kind the CLI turns into an exit code."""
from __future__ import annotations

import ast
import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import slurm_etc
from slurm_etc.errors import EtcError, InputError, InternalError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

# Alembic's scripts: run by alembic with its context, loaded by path (not importable names)
NOT_MODULES = ("slurm_etc.store.migrations.",)


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(slurm_etc.__path__, "slurm_etc.")
                  if not m.name.startswith(NOT_MODULES))


# One interpreter imports the third-party libraries once; each module is then imported in a
# fork of it, with nothing of slurm_etc loaded before: an import cycle that only bites when
# its module comes first (``import slurm_etc.cli.cmd_policy`` did) fails there.
_ALONE = textwrap.dedent("""
    import json, os, sys, traceback
    import alembic.command, alembic.config, click, msgspec, rich.console, rich.table  # noqa
    import scipy.optimize, scipy.sparse.csgraph, sqlalchemy.orm, torch.distributed, zmq  # noqa
    import megatron.core.dist_checkpointing, megatron.core.distributed  # noqa
    import megatron.core.models.gpt, megatron.core.optimizer  # noqa
    assert not [m for m in sys.modules if m.startswith("slurm_etc")]
    failed = {}
    for name in json.loads(sys.argv[1]):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                __import__(name)
                os._exit(0)
            except BaseException:
                os.write(w, traceback.format_exc().strip().splitlines()[-1].encode()[:2000])
                os._exit(1)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            why = f.read().decode()
        _, status = os.waitpid(pid, 0)
        if status:
            failed[name] = why or f"exit status {status}"
    print(json.dumps(failed))
""")


def _import_alone(names: list[str]) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-c", _ALONE, json.dumps(names)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_module_imports_on_its_own() -> None:
    names = _modules()
    assert len(names) > 80, names  # the walk found the package
    assert _import_alone(names) == {}


def test_the_import_check_catches_a_cycle(tmp_path, monkeypatch) -> None:
    """A planted cycle (a module importing a name from one that imports it back, the way
    cmd_policy imported UserError from cli.main) fails the same check."""
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text("class UserError(Exception):\n    pass\n\n\n"
                                 "from . import cmd\nregistered = cmd.command\n")
    (pkg / "cmd.py").write_text("from .main import UserError\ncommand = UserError\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    failed = _import_alone(["cyclepkg.main", "cyclepkg.cmd"])
    assert set(failed) == {"cyclepkg.cmd"} and "command" in failed["cyclepkg.cmd"], failed


def _error_classes() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == name:
                found[f"{name}.{obj.__qualname__}"] = obj
    return list(found.values())


def test_every_error_of_the_package_has_the_root_and_one_kind() -> None:
    classes = _error_classes()
    assert len(classes) >= 25, classes
    # click's own exception type is how the CLI prints: the one class outside the root
    outside = [c for c in classes if not issubclass(c, EtcError)
               and not issubclass(c, click.ClickException)]
    assert outside == [], [f"{c.__module__}.{c.__qualname__}" for c in outside]
    kindless = [c for c in classes if issubclass(c, EtcError) and c is not EtcError
                and not issubclass(c, (InputError, InternalError))]
    assert kindless == [], kindless


@pytest.mark.parametrize("error, code", [
    ("slurm_etc.plan.errors:ConfigError", 2), ("slurm_etc.store.db:StoreError", 2),
    ("slurm_etc.protocol.channel:SecretError", 2),  # a ChannelError the user fixes
    ("slurm_etc.plan.errors:PlanError", 3), ("slurm_etc.slurm.model:SlurmError", 3),
    ("slurm_etc.protocol.channel:ChannelError", 3)])
def test_the_cli_maps_the_root_to_one_line_and_the_kinds_exit_code(error: str,
                                                                    code: int) -> None:
    from slurm_etc.cli.main import EtcGroup

    module, name = error.split(":")
    kind = getattr(importlib.import_module(module), name)

    @click.group(cls=EtcGroup)
    def group() -> None:
        pass

    @group.command()
    def fail() -> None:
        message = "what went wrong,\nand what would be right"
        if name == "SlurmError":  # its line is built from the command that failed
            raise kind(["squeue"], 1, "x", what=message)
        raise kind(message)

    res = CliRunner().invoke(group, ["fail"])
    assert res.exit_code == code, (res.output, res.exception)
    assert res.stderr.startswith("slurm-etc: error: ") and res.stderr.count("\n") == 1, \
        res.stderr
    assert "what went wrong,\\nand what would be right" in res.stderr, res.stderr
    assert "Traceback" not in res.output


def test_the_executor_does_not_import_the_fakes():
    """Test code stays out of the runtime: the executor's default dtype lives in
    migrate/dtypes.py, not in the fake state (testing/fake_state.py, once migrate/fake.py,
    which it imported)."""
    code = ("import sys, slurm_etc.migrate.executor, slurm_etc.worker.trainer; "
            "print(sorted(m for m in sys.modules if m == 'slurm_etc.testing.fake_state'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


SWITCHES = ("SLURM_ETC_INJECT", "SLURM_ETC_PLANT", "SLURM_ETC_COORDINATOR_INJECT")


def _switches_read(source: str) -> list[str]:
    """The injection/plant switch names a module's code holds as strings (docstrings
    aside): what it could read from the environment."""
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            and n.value.startswith(SWITCHES)]


def test_runtime_reads_no_injection_or_plant_switch():
    """Faults reach the runtime through hooks whose defaults do nothing; only
    slurm_etc/testing/ reads the switches from the environment (and the checker catches a
    module that reads one)."""
    assert _switches_read('import os\nx = os.environ.get("SLURM_ETC_PLANT_X")\n') == \
        ["SLURM_ETC_PLANT_X"]
    assert _switches_read('"""SLURM_ETC_INJECT in a docstring"""\n') == []
    root = Path(slurm_etc.__file__).parent
    found = {str(p.relative_to(root)): got for p in sorted(root.rglob("*.py"))
             if p.parent.name != "testing" and (got := _switches_read(p.read_text()))}
    assert found == {}, found
    assert _switches_read((root / "testing" / "hooks.py").read_text())  # they live here


# package -> packages of slurm_etc it must not import (module level or inside functions)
LAYERS = {
    "coordinator": {"worker", "megatron", "pool", "local", "slurm"},
    "local": {"worker", "megatron", "pool", "slurm"},
    "slurm": {"worker", "megatron", "pool", "local"},
    "worker": {"coordinator", "local", "slurm"},
    "protocol": {"coordinator", "worker", "megatron", "pool", "migrate", "cli"},
    "plan": {"coordinator", "worker", "protocol", "store", "megatron", "migrate", "slurm"},
}


def _module_level(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` that runs when the module is imported: function bodies aside
    (class bodies and ``if``/``try`` blocks run)."""
    out, todo = [], [tree]
    while todo:
        n = todo.pop()
        out.append(n)
        todo += [c for c in ast.iter_child_nodes(n)
                 if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    return out


def _imported_packages(source: str, package: str, module_level: bool = False) -> set[str]:
    """The slurm_etc subpackages a module of ``package`` imports, absolute or relative
    (``module_level``: only the imports that run when the module is imported)."""
    out: set[str] = set()
    tree = ast.parse(source)
    for n in (_module_level(tree) if module_level else ast.walk(tree)):
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            if n.level == 0:
                names = [n.module or ""]
            elif n.level == 1:
                names = [f"slurm_etc.{package}"]
            else:  # ``..x.y`` from slurm_etc/<package>/
                names = [f"slurm_etc.{n.module}" if n.module else "slurm_etc"]
                if not n.module:
                    names += [f"slurm_etc.{a.name}" for a in n.names]
        else:
            continue
        out |= {m.split(".")[1] for m in names if m.startswith("slurm_etc.")}
    return out


def test_the_layers_import_along_the_architecture():
    """The coordinator does not import the worker (nor megatron, nor the pool) nor a backend,
    the worker not the coordinator; both share slurm_etc/protocol, which imports neither; the
    local and Slurm backends import the coordinator's seam, not each other. Planted: a
    relative import of the worker from the coordinator is caught."""
    assert _imported_packages("from ..worker.trainer import x\n", "coordinator") == {"worker"}
    assert _imported_packages("from .loop import x\n", "coordinator") == {"coordinator"}
    root = Path(slurm_etc.__file__).parent
    crossed = {}
    for package, banned in LAYERS.items():
        for p in sorted((root / package).rglob("*.py")):
            bad = _imported_packages(p.read_text(), package) & banned
            if bad:
                crossed[str(p.relative_to(root))] = sorted(bad)
    assert crossed == {}, crossed


# Test code stays out of the runtime: these packages do not import the verify/bench harness
# (slurm_etc/harness/) or the fakes and fault hooks (slurm_etc/testing/) when they are
# imported. cli/ is not among them: it runs verify and bench.
RUNTIME = ("coordinator", "worker", "local", "slurm", "protocol", "store", "plan", "alloc",
           "policy", "migrate", "megatron")
TEST_CODE = {"harness", "testing"}
# module (from slurm_etc/) -> the test code it may import, and why
TEST_CODE_ALLOWED = {
    # `slurm-etc demo --inject` names the switch (INJECT_ENV) of the chaos worker it launches
    "local/demo.py": {"testing"},
}


def test_the_runtime_does_not_import_test_code():
    """No runtime module imports slurm_etc.harness or slurm_etc.testing at module level (an
    import inside a function is not counted: worker/sequence.py digests a state through the
    harness's oracles there). Planted: a module-level import of a fake is caught, one in a
    function body is not, one in a class body is."""
    assert _imported_packages("from slurm_etc.testing.fake_state import x\n", "migrate",
                              module_level=True) == {"testing"}
    assert _imported_packages("def f():\n    from ..harness import oracles\n", "worker",
                              module_level=True) == set()
    assert _imported_packages("class C:\n    from ..harness import oracles\n", "worker",
                              module_level=True) == {"harness"}
    root = Path(slurm_etc.__file__).parent
    crossed, allowed_used = {}, set()
    for package in RUNTIME:
        for p in sorted((root / package).rglob("*.py")):
            name = str(p.relative_to(root))
            bad = _imported_packages(p.read_text(), package, module_level=True) & TEST_CODE
            if bad and bad <= TEST_CODE_ALLOWED.get(name, set()):
                allowed_used.add(name)
            elif bad:
                crossed[name] = sorted(bad)
    assert crossed == {}, crossed
    # an exception no longer needed goes from the table
    assert allowed_used == set(TEST_CODE_ALLOWED), set(TEST_CODE_ALLOWED) - allowed_used


def _test_modules_imported(source: str, package: str) -> set[str]:
    """The ``test_*`` modules of tests/<package>/ that ``source`` imports, at any depth."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):  # the module, and each name as a submodule
            base = ".".join(filter(None, [f"tests.{package}" if node.level else "",
                                          node.module or ""]))
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n.startswith("tests.")
                and n.rsplit(".", 1)[-1].startswith("test_")}
    return out


# a file of tests/ -> the test modules it may import, and why
TEST_MODULE_IMPORTS_ALLOWED = {
    # the script that regenerates the megatron fixtures builds the cases the test checks
    "dist/make_megatron_fixtures.py": {"tests.dist.test_megatron_build"},
}


def test_test_modules_do_not_import_each_other():
    """What two test modules share lives in a helper module (coordinator_harness,
    grow_harness, plan_helpers, ...) or conftest.py: a test module imported by another runs
    its module-level code twice and ties the two files' edits together. Planted: a relative,
    an absolute and a function-level import of a test module are caught, a helper is not.
    tests/slurm is not checked yet (its modules import test_client's waits)."""
    assert _test_modules_imported("from .test_a import x\n", "unit") == {"tests.unit.test_a"}
    assert _test_modules_imported("def f():\n    from tests.unit.test_b import y\n",
                                  "dist") == {"tests.unit.test_b"}
    assert _test_modules_imported("from . import test_c\n", "unit") == {"tests.unit.test_c"}
    assert _test_modules_imported("from tests.dist import test_d\n", "unit") == {
        "tests.dist.test_d"}
    assert _test_modules_imported("from .plan_helpers import make_plan\n", "unit") == set()
    tests = Path(__file__).parents[1]
    found = {str(p.relative_to(tests)): got
             for package in ("unit", "dist", "gpu", "workers")
             for p in sorted((tests / package).rglob("*.py"))
             if (got := _test_modules_imported(p.read_text(), package))}
    assert {name: sorted(got) for name, got in found.items()
            if not got <= TEST_MODULE_IMPORTS_ALLOWED.get(name, set())} == {}
    assert set(found) == set(TEST_MODULE_IMPORTS_ALLOWED)  # an exception no longer needed goes

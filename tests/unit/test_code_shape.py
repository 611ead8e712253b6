"""The code's shape that issue #45 set as bounds, held: the coordinator's loop at most 300
lines and its ``Coordinator`` at most 10 attributes, the trainer's module at most 500 lines
and every module of ``worker/`` too, no function over 80 lines outside the Alembic
migrations. Read from the source with ``ast`` (nothing imported); the checker is shown to
catch a planted breach of each bound."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit]

PACKAGE = Path(__file__).resolve().parents[2] / "slurm_etc"
LOOP_LINES, COORDINATOR_ATTRIBUTES, WORKER_MODULE_LINES, FUNCTION_LINES = 300, 10, 500, 80
MIGRATIONS = "store/migrations/versions"


def long_functions(root: Path, skip: str | None = MIGRATIONS) -> list[str]:
    """``path:name (lines)`` of every function of ``root``'s modules longer than
    :data:`FUNCTION_LINES` (decorators not counted), outside ``skip`` (the Alembic
    migrations)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if skip is not None and rel.startswith(skip):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > FUNCTION_LINES:
                    found.append(f"{rel}:{node.name} ({lines})")
    return found


def attributes(source: str, cls: str) -> set[str]:
    """The instance attributes ``cls`` assigns (``self.x = ...``, ``self.x: T = ...``) in
    any of its methods."""
    (node,) = [n for n in ast.walk(ast.parse(source))
               if isinstance(n, ast.ClassDef) and n.name == cls]
    names = set()
    for sub in ast.walk(node):
        targets = (sub.targets if isinstance(sub, ast.Assign) else
                   [sub.target] if isinstance(sub, ast.AnnAssign | ast.AugAssign) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and \
                    t.value.id == "self":
                names.add(t.attr)
    return names


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_loop_and_the_coordinator_stay_small() -> None:
    loop = PACKAGE / "coordinator" / "loop.py"
    assert lines(loop) <= LOOP_LINES, lines(loop)
    got = attributes(loop.read_text(), "Coordinator")
    assert 5 <= len(got) <= COORDINATOR_ATTRIBUTES, sorted(got)


def test_the_worker_modules_stay_under_500_lines() -> None:
    big = {p.name: lines(p) for p in (PACKAGE / "worker").glob("*.py")
           if lines(p) > WORKER_MODULE_LINES}
    assert not big, big
    assert lines(PACKAGE / "worker" / "trainer.py") > 100  # the walk read the trainer


def test_no_function_over_80_lines_outside_the_migrations() -> None:
    assert long_functions(PACKAGE) == []
    # the long ones are a migration's (the walk reaches them: only the skip spares them)
    assert long_functions(PACKAGE, skip=None)
    assert all(f.startswith(MIGRATIONS) for f in long_functions(PACKAGE, skip=None))


def test_the_checks_catch_a_planted_breach(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (tmp_path / "long.py").write_text(f"def planted():\n{body}\n")
    (tmp_path / MIGRATIONS).mkdir(parents=True)
    (tmp_path / MIGRATIONS / "0001_x.py").write_text(f"def upgrade():\n{body}\n")
    assert long_functions(tmp_path) == ["long.py:planted (82)"]
    eleven = "\n".join(f"        self.a{i} = {i}" for i in range(11))
    planted = f"class Coordinator:\n    def __init__(self):\n{eleven}\n" \
              "    def more(self):\n        self.a0 += 1\n        self.b: int = 2\n"
    assert len(attributes(planted, "Coordinator")) == 12

"""The README and docs/ name only what exists: every relative link (and its #anchor), every
repository path, and the README stays an entry point of at most 300 lines.

Pure file reads: no import of the package, no subprocess.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300

# the top-level directories a path in the docs may start from (the repository's own)
TOP_DIRS = ("slurm_etc", "tests", "bench", "scripts", "docs", "examples", ".ci", "db")
# a repository path: a top-level directory, then path characters; not part of a longer
# word, URL or path (so `https://host/docs/x` and `$OUT/docs` are not taken for one)
_REPO_PATH = re.compile(
    r"(?<![\w./$<>~-])((?:" + "|".join(re.escape(d) for d in TOP_DIRS) + r")/[\w./-]*)")
# inside a code span: `coordinator/loop.py`, a module path given from the package's root
_PACKAGE_PATH = re.compile(r"(?<![\w./$<>~-])((?:[a-z_][a-z0-9_]*/)+[a-z0-9_]+\.py)\b")
# `python -m slurm_etc.worker.preset_worker`: a module of the repository run by name
_MODULE = re.compile(r"-m\s+((?:slurm_etc|tests|bench|scripts|examples)(?:\.\w+)+)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files() -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def split_fences(text: str) -> tuple[str, str]:
    """The text outside fenced code blocks and the text inside them, line numbers kept.

    Lines of the other kind are blanked, so that a line number found in either part is the
    line's number in the file.
    """
    prose, code = [], []
    in_fence = False
    for line in text.split("\n"):
        if _FENCE.match(line):
            in_fence = not in_fence
            prose.append("")
            code.append("")
            continue
        (code if in_fence else prose).append(line)
        (prose if in_fence else code).append("")
    return "\n".join(prose), "\n".join(code)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file (repeated headings get -1, -2, ...)."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for line in prose.split("\n"):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _clean(path: str) -> str:
    # a path ends a sentence or a clause: drop the punctuation that follows it
    return path.rstrip(".,;:")


def broken_references(md: Path, root: Path = ROOT) -> list[str]:
    """Every link, anchor or repository path in `md` that does not exist, as one line each."""
    text = md.read_text(encoding="utf-8")
    name = md.relative_to(root).as_posix()
    prose, code = split_fences(text)
    problems: list[str] = []

    # links (and images) in the prose, relative to the file's directory
    for m in _LINK.finditer(prose):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        dest = (md.parent / file_part).resolve() if file_part else md
        where = f"{name}:{_line_of(prose, m.start())}"
        if not dest.exists():
            problems.append(f"{where}: link to {target}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: link to {target}: no heading #{anchor} in "
                            f"{dest.relative_to(root).as_posix()}")

    # repository paths, anywhere (prose, code spans, code blocks), relative to the root
    for part in (prose, code):
        for m in _REPO_PATH.finditer(part):
            path = _clean(m.group(1))
            if not (root / path).exists():
                problems.append(f"{name}:{_line_of(part, m.start())}: {path} does not exist")

    # modules run by name (`python -m slurm_etc.worker.preset_worker`)
    for part in (prose, code):
        for m in _MODULE.finditer(part):
            base = root.joinpath(*m.group(1).split("."))
            if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
                problems.append(f"{name}:{_line_of(part, m.start())}: module {m.group(1)} "
                                "does not exist")

    # module paths named from the package's root inside code spans (`coordinator/loop.py`)
    for span in _CODE_SPAN.finditer(prose):
        for m in _PACKAGE_PATH.finditer(span.group(2)):
            path = m.group(1)
            if path.split("/", 1)[0] in TOP_DIRS:
                continue  # checked above from the root
            if not ((root / "slurm_etc" / path).exists() or (root / path).exists()):
                problems.append(f"{name}:{_line_of(prose, span.start())}: {path} is neither "
                                f"slurm_etc/{path} nor a path from the repository's root")
    return problems


@pytest.mark.parametrize("md", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_and_path_exists(md: Path) -> None:
    problems = broken_references(md)
    assert not problems, "\n".join(problems)


def test_readme_is_an_entry_point() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move detail into docs/")


def test_readme_keeps_the_two_commands() -> None:
    # .ci/run calls `make test`, and the Quick start promises `make demo` then `make test`
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = text.split("## Quick start", 1)[1]
    block = quick.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in block[:2]] == [["make", "demo"], ["make", "test"]]
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_the_checker_finds_what_is_planted(tmp_path: Path) -> None:
    """A broken link, a missing anchor and a missing path are each reported; good ones not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "slurm_etc" / "plan").mkdir(parents=True)
    (tmp_path / "slurm_etc" / "plan" / "model.py").write_text("")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A section\n")
    md = tmp_path / "README.md"
    md.write_text(
        "# Title\n\n"
        "[good](docs/other.md#a-section) and [good too](#title),\n"
        "`slurm_etc/plan/model.py`, `plan/model.py`.\n"
        "[broken](docs/missing.md) and [no anchor](docs/other.md#nowhere),\n"
        "`slurm_etc/plan/gone.py` and `coordinator/gone.py`.\n\n"
        "```bash\n.venv/bin/python bench/nothing.py\n# a comment, not a heading\n"
        "python -m slurm_etc.plan.model && python -m slurm_etc.plan.gone_too\n```\n")
    problems = broken_references(md, root=tmp_path)
    for good in ("#a-section", "#title", "plan/model.py", "slurm_etc.plan.model "):
        assert not any(good in p for p in problems), (good, problems)
    for planted in ("docs/missing.md", "#nowhere", "slurm_etc/plan/gone.py",
                    "coordinator/gone.py", "bench/nothing.py", "slurm_etc.plan.gone_too"):
        assert any(planted in p for p in problems), (planted, problems)


def missing_from_architecture(root: Path = ROOT) -> list[str]:
    """The package's modules without a row in docs/architecture.md's module map, and the
    Alembic migrations the architecture does not name."""
    text = (root / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    package = root / "slurm_etc"
    versions = package / "store" / "migrations" / "versions"
    modules = [p for p in sorted(package.rglob("*.py"))
               if p.name != "__init__.py" and "migrations" not in p.relative_to(package).parts]
    return ([f"{p.relative_to(root).as_posix()}: no row in the module map" for p in modules
             if f"| `{p.relative_to(root).as_posix()}` |" not in table]
            + [f"migration {p.stem}: not named" for p in sorted(versions.glob("0*.py"))
               if f"`{p.stem}`" not in text])


def test_the_module_map_names_every_module_and_migration(tmp_path: Path) -> None:
    assert missing_from_architecture() == []
    # planted: a module and a migration the architecture does not name are reported
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(
        "## Module map\n\n| `slurm_etc/a.py` | A |\n\n## Next\n\n`0001_one`\n")
    versions = tmp_path / "slurm_etc" / "store" / "migrations" / "versions"
    versions.mkdir(parents=True)
    for name in ("a.py", "b.py", "__init__.py"):
        (tmp_path / "slurm_etc" / name).write_text("")
    for name in ("0001_one.py", "0002_two.py"):
        (versions / name).write_text("")
    assert missing_from_architecture(tmp_path) == [
        "slurm_etc/b.py: no row in the module map", "migration 0002_two: not named"]

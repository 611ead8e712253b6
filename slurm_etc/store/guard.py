"""Reading a SQLite file someone else may have written, with bounds.

A job record in the state directory, or a file named with ``--db``, is data from whoever
wrote it. A SQLite file is more than data: its schema may hold views (a recursive one
expands without end the first time anything reads it), triggers, virtual tables or
generated columns, all evaluated by the reader. Before any query, :func:`check_schema`
accepts only the tables and columns of our own migrations (a subset: older records lack
later columns) and plain indexes on them; every read then runs under a deadline (SQLite's
progress handler interrupts it) and SQLite's own allocations under a heap limit.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .errors import StoreError, locked_hint
from .models import Base

# Every table our migrations create, with its columns; alembic's own table too.
_ALEMBIC = {"alembic_version": frozenset({"version_num"})}


@lru_cache(maxsize=1)
def expected_tables() -> dict[str, frozenset[str]]:
    """Table -> column names of the newest schema (what :func:`check_schema` allows)."""
    out = {name: frozenset(c.name for c in table.columns)
           for name, table in Base.metadata.tables.items()}
    return {**out, **_ALEMBIC}


@dataclass(frozen=True)
class ReadLimits:
    """Bounds of reading one untrusted file.

    Attributes:
        seconds: wall time of all queries on it (then interrupted: one line, skipped).
        heap_bytes: SQLite's memory (``hard_heap_limit``; process-wide while held).
        max_bytes: the file's size.
    """

    seconds: float = 5.0
    heap_bytes: int = 256 << 20
    max_bytes: int = 64 << 20


# SQLite's progress handler is called every this many virtual-machine instructions.
_PROGRESS_STEPS = 1_000


def check_schema(conn: sqlite3.Connection, where: str) -> None:
    """Refuse a database whose schema is not (a subset of) ours, before any other query.

    Only ``sqlite_master`` and ``PRAGMA table_xinfo`` of expected tables are read: neither
    runs a view, a trigger or a generated column.

    Raises:
        StoreError: a view, trigger, virtual table, unknown table or column, or a
            generated column (one line naming it).
    """
    allowed = expected_tables()
    try:
        entries = conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
        for kind, name, table, sql in entries:
            if kind == "table":
                if name not in allowed:
                    raise StoreError(f"{where} is not a slurm-etc database: unexpected table "
                                     f"{name!r}")
                if not str(sql or "").lstrip().upper().startswith("CREATE TABLE"):
                    raise StoreError(f"{where} is not a slurm-etc database: table {name!r} is "
                                     "not a plain table")
            elif kind == "index":
                if table not in allowed:
                    raise StoreError(f"{where} is not a slurm-etc database: index {name!r} on "
                                     f"unexpected table {table!r}")
            else:  # view, trigger: code the reader would run
                raise StoreError(f"{where} is not a slurm-etc database: it has a {kind} "
                                 f"{str(name)[:64]!r}")
        for kind, name, _table, _sql in entries:
            if kind != "table":
                continue
            columns = conn.execute(f'PRAGMA table_xinfo("{name}")').fetchall()
            for _cid, column, _type, _notnull, _default, _pk, hidden in columns:
                if column not in allowed[name]:
                    raise StoreError(f"{where} is not a slurm-etc database: unexpected column "
                                     f"{name}.{str(column)[:64]!r}")
                if hidden:
                    raise StoreError(f"{where} is not a slurm-etc database: {name}.{column} "
                                     "is a generated column")
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read {where}: {locked_hint(str(exc))}") from None


def bounded(conn: sqlite3.Connection, deadline: float) -> None:
    """Put a connection under bounds: interrupted past ``deadline`` (``time.monotonic()``),
    read-only, untrusted-schema rules, bounded string and SQL lengths."""
    conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0,
                              _PROGRESS_STEPS)
    conn.execute("PRAGMA query_only=1")
    conn.execute("PRAGMA trusted_schema=OFF")
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 16 << 20)
    conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 1 << 20)
    conn.setlimit(sqlite3.SQLITE_LIMIT_EXPR_DEPTH, 200)


@lru_cache(maxsize=1)
def _sqlite_library() -> Any:
    """The SQLite library Python's sqlite3 uses, for ``sqlite3_hard_heap_limit64`` (the
    pragma can only lower the limit, never lift it again); None when it cannot be found
    (a statically linked build)."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("sqlite3") or "libsqlite3.so.0")
        fn = lib.sqlite3_hard_heap_limit64
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_int64
    return fn


def _hard_heap_limit(limit: int) -> int:
    """Set SQLite's hard heap limit (0: none); returns the previous one."""
    fn = _sqlite_library()
    if fn is not None and fn(-1) == _pragma_limit():  # the very library sqlite3 uses
        return int(fn(limit))
    previous = _pragma_limit()
    if limit and (not previous or limit < previous):
        conn = sqlite3.connect(":memory:")
        try:
            conn.execute(f"PRAGMA hard_heap_limit={int(limit)}")
        finally:
            conn.close()
    return previous


def _pragma_limit() -> int:
    conn = sqlite3.connect(":memory:")
    try:
        return int(conn.execute("PRAGMA hard_heap_limit").fetchone()[0])
    finally:
        conn.close()


@contextmanager
def sqlite_heap_limit(limit: int) -> Iterator[None]:
    """SQLite's ``hard_heap_limit`` (process-wide) for the block, the previous one after:
    an allocation past it fails the query (``out of memory``), not the process. Where the
    library cannot be reached to lift it again, the limit stays (only lowered)."""
    previous = _hard_heap_limit(limit)
    try:
        yield
    finally:
        fn = _sqlite_library()
        if fn is not None:
            fn(previous)


def interrupted_reason(text: str, limits: ReadLimits) -> str:
    """A sqlite error text as one line; an interrupt says it was the deadline."""
    if "interrupted" in text:
        return f"reading it took longer than {limits.seconds:g} s (stopped)"
    if "out of memory" in text:
        return f"reading it needed more than {limits.heap_bytes / 2**20:g} MiB (stopped)"
    return text

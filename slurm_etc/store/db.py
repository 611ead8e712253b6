"""Opening the SQLite store: path, engine, schema migrations, short transactions.

Migrations live in ``slurm_etc/store/migrations`` (shipped with the package) and are
applied on open. A reader who cannot write never runs them: a database already at the
newest revision opens read-only just fine.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

ENV_DB = "SLURM_ETC_DB"
MIGRATIONS = Path(__file__).parent / "migrations"
BUSY_TIMEOUT_S = 10.0


class StoreError(RuntimeError):
    """The database cannot be opened or brought to the current schema (path and cause)."""


def default_db_path() -> Path:
    """``$SLURM_ETC_DB``, else ``$XDG_DATA_HOME/slurm-etc/etc.db`` (~/.local/share/...)."""
    if os.environ.get(ENV_DB):
        return Path(os.environ[ENV_DB]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "slurm-etc" / "etc.db"


def alembic_config(url: str) -> Config:
    """Alembic configuration for the package's own migration scripts."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


class Store:
    """An open SQLite database at the newest schema revision."""

    def __init__(self, engine: Engine, path: Path) -> None:
        self.engine = engine
        self.path = path
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A short transaction: committed on success, rolled back on any error."""
        with self._sessions.begin() as session:
            yield session

    def close(self) -> None:
        self.engine.dispose()


def open_store(path: str | os.PathLike | None = None) -> Store:
    """Open (creating it and its directory if needed) and migrate the database.

    Args:
        path: the SQLite file; default ``default_db_path()``.

    Raises:
        StoreError: the file cannot be created or opened, or needs a migration that this
            user cannot write.
    """
    db = Path(path).expanduser() if path else default_db_path()
    if not db.exists():
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the directory of {db}: {exc.strerror}") from None
    engine = _engine(db)
    try:
        _migrate(engine)
    except OperationalError as exc:
        engine.dispose()
        raise StoreError(f"cannot open {db}: {exc.orig}") from None
    return Store(engine, db)


def _engine(db: Path) -> Engine:
    engine = create_engine(f"sqlite:///{db}", connect_args={"timeout": BUSY_TIMEOUT_S})

    # pysqlite's own transaction handling defers BEGIN and skips it for DDL; take control
    # (SQLAlchemy's documented recipe) so migrations and writes are real transactions.
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None
        dbapi_conn.execute("PRAGMA foreign_keys=ON")

    @event.listens_for(engine, "begin")
    def _begin(conn) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.info.get("write_lock") else "BEGIN")

    return engine


def _migrate(engine: Engine) -> None:
    cfg = alembic_config(str(engine.url))
    head = ScriptDirectory.from_config(cfg).get_current_head()
    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
        conn.rollback()
        if current == head:
            return
        # One writer migrates; a concurrent opener waits on the lock, then finds head.
        conn.info["write_lock"] = True
        try:
            with conn.begin():
                if MigrationContext.configure(conn).get_current_revision() != head:
                    cfg.attributes["connection"] = conn
                    command.upgrade(cfg, "head")
        finally:
            conn.info.pop("write_lock", None)

"""Opening the store: a SQLite file or a SQLAlchemy URL, schema migrations, short transactions.

Migrations live in ``slurm_etc/store/migrations`` (shipped with the package) and are
applied on open. A reader never runs them (``open_store_readonly``). A database that is not
ours (not a SQLite file, or tables without our ``alembic_version``, or a revision we do not
know) is refused with one line before anything is written.

Targets: a path (SQLite), ``sqlite:///path``, or a server URL with the same migrations:
``mysql+pymysql://user@host/db`` (MariaDB, e.g. the one slurmdbd uses) or
``postgresql://user@host/db``.
"""
from __future__ import annotations

import logging
import os
import re
import sqlite3
import time
import urllib.parse
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache, wraps
from pathlib import Path
from typing import Any, Callable, Iterator, ParamSpec, TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, inspect
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from . import guard
from .errors import BUSY_TIMEOUT_S, StoreError, locked_hint
from .location import LocationError, check_writable_location, private_dir, private_file

log = logging.getLogger(__name__)

ENV_DB = "SLURM_ETC_DB"
MIGRATIONS = Path(__file__).parent / "migrations"
SQLITE_MAGIC = b"SQLite format 3\x00"

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Set while a write transaction begins: SQLite then takes the write lock at BEGIN.
_WRITE: ContextVar[bool] = ContextVar("slurm_etc_store_write", default=False)


P = ParamSpec("P")
R = TypeVar("R")


def guarded(what: str, then: str = "") -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator for functions taking a :class:`Store` first: a database failure (a full
    disk, a file this user may not write, a corrupt snapshot, a lost server) becomes one
    StoreError line naming the database (``what`` where the store has no URL), then
    ``then``."""
    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except SQLAlchemyError as exc:
                store = args[0] if args else None
                orig = getattr(exc, "orig", None)
                reason = str(orig if orig is not None else exc).splitlines()[0]
                raise StoreError(f"{getattr(store, 'url', what)}: {reason}{then}") from None
        return call
    return wrap


def default_db_path() -> Path:
    """``$SLURM_ETC_DB``, else ``$XDG_DATA_HOME/slurm-etc/etc.db`` (~/.local/share/...)."""
    if os.environ.get(ENV_DB):
        return Path(os.environ[ENV_DB]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "slurm-etc" / "etc.db"


def read_owner_only(path: str | os.PathLike[str], what: str) -> str:
    """The text of a small file only its owner (the caller) can read: a password or a URL
    with one. Checked on the descriptor read (``O_NOFOLLOW``, ``fstat``).

    Raises:
        StoreError: missing, a symlink, not the caller's, readable by group or others, or
            larger than 4 KiB (one line; the content is never quoted).
    """
    from .location import open_owned

    name = os.fspath(path)
    try:
        opened = open_owned(os.path.expanduser(name), allowed=lambda _uid: True,
                            max_bytes=4096)
    except (FileNotFoundError, PermissionError) as exc:
        raise StoreError(f"{what} {name}: {exc.strerror}") from None
    except LocationError as exc:
        raise StoreError(f"{what} {name}: {exc}") from None
    if opened is None:  # every owner is allowed above; the check is below, with the mode
        raise StoreError(f"{what} {name}: cannot be read")
    try:
        mode = os.fstat(opened.fd).st_mode
        if opened.owner != os.getuid() or mode & 0o077:
            raise StoreError(f"{what} {name} must be yours and owner-only (chmod 600 "
                             f"{name}); it is uid {opened.owner}'s, mode {mode & 0o777:04o}")
        data = os.read(opened.fd, 4097)
    finally:
        opened.close()
    try:
        return data.decode().strip()
    except UnicodeDecodeError:
        raise StoreError(f"{what} {name} is not text") from None


def resolve_target(target: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """``@FILE`` names a URL kept in an owner-only file (so no password is in argv or the
    environment); anything else is returned as it is."""
    text = os.fspath(target)
    if text.startswith("@"):
        return read_owner_only(text[1:], "database URL file")
    return target


def with_password_file(target: str, path: str | os.PathLike[str] | None) -> str:
    """A server URL with the password read from an owner-only file (``--db-password-file``).

    Raises:
        StoreError: ``target`` is not a server URL, or it has a password already.
    """
    if path is None:
        return target
    target = os.fspath(resolve_target(target))
    if not is_url(target) or sqlite_path(target) is not None:
        raise StoreError("--db-password-file needs a server URL in --db "
                         "(mysql+pymysql://user@host/db, postgresql://user@host/db)")
    url = make_url(target)
    if url.password:
        raise StoreError(f"{display(target)} has a password already; give it in one place "
                         "only (the password file)")
    password = read_owner_only(path, "password file")
    return url.set(password=password).render_as_string(hide_password=False)


def is_url(target: str | os.PathLike[str]) -> bool:
    """Whether ``target`` is a SQLAlchemy URL (``scheme://...``) rather than a path."""
    return bool(_URL.match(os.fspath(target)))


def sqlite_path(target: str | os.PathLike[str]) -> Path | None:
    """The file of a SQLite target (path or ``sqlite:///`` URL); None for a server URL."""
    text = os.fspath(resolve_target(target))
    if not is_url(text):
        return Path(text).expanduser()
    try:
        url = make_url(text)
    except (ArgumentError, ValueError):
        return None
    if url.get_backend_name() != "sqlite":
        return None
    if not url.database or url.database == ":memory:":
        raise StoreError(f"{text}: give a SQLite file, not an in-memory database")
    return Path(url.database).expanduser()


def redact(text: str, target: str | os.PathLike[str] | None) -> str:
    """``text`` with the password of ``target`` (a URL), raw or URL-quoted, replaced by
    ``***``: what a driver's or SQLAlchemy's message quotes must never show it."""
    if target is None:
        return text
    raw = os.fspath(target)
    password = None
    if is_url(raw):
        try:
            password = make_url(raw).password
        except (ArgumentError, ValueError):
            # unparsable: hide whatever sits between "user:" and "@"
            match = re.match(r"^[^:/]+://[^:/@]*:([^@]*)@", raw)
            password = match.group(1) if match else None
    if not password:
        return text
    for form in {str(password), urllib.parse.quote(str(password), safe=""),
                 urllib.parse.quote_plus(str(password))}:
        if form:
            text = text.replace(form, "***")
    return text


def display(target: str | os.PathLike[str]) -> str:
    """A target as it may be shown: a URL's password hidden."""
    text = os.fspath(target)
    if not is_url(text):
        return text
    try:
        return make_url(text).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return "<unparsable URL>"


def alembic_config(url: str) -> Config:
    """Alembic configuration for the package's own migration scripts."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


@lru_cache(maxsize=1)
def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config("sqlite://"))


def head_revision() -> str:
    """The newest schema revision this slurm-etc ships."""
    head = _scripts().get_current_head()
    if head is None:
        raise StoreError(f"no schema migrations found in {MIGRATIONS}: a broken install")
    return head


def known_revisions() -> list[str]:
    """Every revision this slurm-etc ships, oldest first."""
    return [s.revision for s in reversed(list(_scripts().walk_revisions()))]


class Store:
    """An open database (SQLite file or server) at a schema revision this code knows.

    Attributes:
        engine: the SQLAlchemy engine.
        path: the SQLite file, or None for a server URL.
        url: where it is, for messages (password hidden).
        readonly: opened for reading only (no migrations were run).
        after_commit: callables run after every committed write transaction (publishing a
            snapshot); their errors are logged, never raised: the write is done.
        on_flush: callables that wait for work the hooks started (``flush``).
        on_close: callables that stop it (``close``, after a flush).
        beat_at: when the job's heartbeat was last written (``jobs.heartbeat``).
    """

    def __init__(self, engine: Engine, path: Path | None, url: str = "",
                 readonly: bool = False) -> None:
        self.engine = engine
        self.path = path
        self.url = url or (str(path) if path else str(engine.url))
        self.readonly = readonly
        self.after_commit: list[Callable[[], None]] = []
        self.on_flush: list[Callable[[], object]] = []
        self.on_close: list[Callable[[], object]] = []
        self.beat_at: float | None = None  # monotonic time of the last heartbeat
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @contextmanager
    def transaction(self, write: bool = False) -> Iterator[Session]:
        """A short transaction: committed on success, rolled back on any error.

        Args:
            write: the transaction writes; SQLite takes the write lock at BEGIN (no
                deadlock between a reader turning writer and another writer), and the
                ``after_commit`` hooks run once it has committed.
        """
        if write and self.readonly:
            raise StoreError(f"{self.url} was opened for reading only")
        with self._sessions.begin() as session:
            token = _WRITE.set(write)
            try:
                session.connection()  # BEGIN now, with the lock this transaction needs
            finally:
                _WRITE.reset(token)
            yield session
        if write:
            for hook in self.after_commit:
                try:
                    hook()
                except Exception:  # noqa: BLE001 - the write is committed; report only
                    log.warning("after-commit hook %r failed", hook, exc_info=True)

    def has_table(self, name: str) -> bool:
        with self.engine.connect() as conn:
            return inspect(conn).has_table(name)

    def flush(self) -> None:
        """Wait for what the after-commit hooks started (a snapshot being published)."""
        for wait in self.on_flush:
            wait()

    def close(self) -> None:
        """Finish pending publications, then release the database."""
        try:
            self.flush()
            for stop in self.on_close:
                stop()
        finally:
            self.engine.dispose()


def open_store(target: str | os.PathLike[str] | None = None, *, wal: bool = False,
               private: bool = False, refuse_network_fs: bool = False,
               file_mode: int = 0o600) -> Store:
    """Open (creating it and its directory if needed) and migrate the database.

    Args:
        target: a SQLite file or a SQLAlchemy URL; default ``default_db_path()``.
        wal: put a SQLite file in WAL mode (readers never block the writer); only for
            node-local files.
        private: create its directory 0700 (and refuse one that is not the caller's).
        file_mode: the mode a new SQLite file is created with (default 0600: a record of
            jobs is nobody else's; give 0o640 and a group for a site's readers).
        refuse_network_fs: refuse a SQLite file on a network filesystem.

    Raises:
        StoreError: the target cannot be created or opened, is not ours, is on a network
            filesystem (with ``refuse_network_fs``), or needs a migration this user cannot
            write. Nothing is written in any of these cases.
    """
    target = default_db_path() if target is None else resolve_target(target)
    db = sqlite_path(target)
    if db is None:
        engine = _server_engine(os.fspath(target))
        where = display(target)
    else:
        where = str(db)
        _check_sqlite_header(db)
        if refuse_network_fs:
            try:
                check_writable_location(db)
            except LocationError as exc:
                raise StoreError(str(exc)) from None
        _create(db, private, file_mode)
        engine = _sqlite_engine(lambda: sqlite3.connect(db, timeout=BUSY_TIMEOUT_S,
                                                        check_same_thread=False))
    try:
        _check_ours(engine, where)
        if db is not None and wal:
            _enable_wal(engine, where)
        _migrate(engine)
    except (OperationalError, SQLAlchemyError) as exc:
        engine.dispose()
        raise StoreError(f"cannot open {where}: {_reason(exc)}") from None
    except StoreError:
        engine.dispose()
        raise
    return Store(engine, db, where)


def open_store_readonly(target: str | os.PathLike[str], *, immutable: bool = False,
                        limits: Any = None, name: str | None = None) -> Store:
    """Open a database for reading: no migrations, nothing created or written.

    Args:
        target: a SQLite file or a SQLAlchemy URL.
        immutable: the file never changes in place (a published snapshot, replaced
            atomically): SQLite reads it without any locking, safe on a network filesystem.
        limits: a ``guard.ReadLimits`` for a SQLite file someone else may have written:
            its schema is checked before any query (only our tables and columns; no views,
            triggers, virtual tables) and every query on it shares one deadline.
        name: how the file is named in messages (default: its path).

    Raises:
        StoreError: it does not exist, cannot be opened, or is not ours.
    """
    target = resolve_target(target)
    db = sqlite_path(target)
    if db is None:
        engine = _server_engine(os.fspath(target))
        where = display(target)
    else:
        where = name or str(db)
        if not db.is_file():
            raise StoreError(f"no database at {where}")
        _check_sqlite_header(db)
        uri = "file:" + urllib.parse.quote(str(db.absolute())) + "?mode=ro"
        if immutable:
            uri += "&immutable=1"
        connect = _guarded_connect(uri, where, limits) if limits is not None else (
            lambda: sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S,
                                    check_same_thread=False))
        engine = _sqlite_engine(connect)
    try:
        _check_ours(engine, where)
    except SQLAlchemyError as exc:
        engine.dispose()
        raise StoreError(f"cannot read {where}: {_reason(exc, limits)}") from None
    except StoreError:
        engine.dispose()
        raise
    return Store(engine, db, where, readonly=True)


def _guarded_connect(uri: str, where: str, limits: Any) -> Callable[[], sqlite3.Connection]:
    deadline = time.monotonic() + limits.seconds

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        try:
            guard.bounded(conn, deadline)
            guard.check_schema(conn, where)
        except BaseException:
            conn.close()
            raise
        return conn

    return connect


def _reason(exc: SQLAlchemyError, limits: Any = None) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).splitlines()[0]
    if limits is not None:
        text = guard.interrupted_reason(text, limits)
    return locked_hint(text)


def _check_sqlite_header(db: Path) -> None:
    try:
        with open(db, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except FileNotFoundError:
        return
    except IsADirectoryError:
        raise StoreError(f"{db} is a directory, not a database file") from None
    except OSError as exc:
        raise StoreError(f"cannot read {db}: {exc.strerror}") from None
    if head and head != SQLITE_MAGIC:
        raise StoreError(f"{db} is not an SQLite database (not a slurm-etc store); "
                         "nothing was written")


def _create(db: Path, private: bool, file_mode: int = 0o600) -> None:
    if db.exists():
        return
    try:
        if private:
            private_dir(db.parent)
        else:
            db.parent.mkdir(parents=True, exist_ok=True)
        # created with its mode before SQLite writes (SQLite's journal and WAL files take
        # the database's mode): never the umask's 0644 for a file of jobs
        private_file(db, file_mode)
    except LocationError as exc:
        raise StoreError(str(exc)) from None
    except OSError as exc:
        raise StoreError(f"cannot create the directory of {db}: {exc.strerror}") from None


def _server_engine(url: str) -> Engine:
    try:
        return create_engine(url, pool_pre_ping=True)
    except NoSuchModuleError:
        raise StoreError(f"{display(url)}: unknown database kind; use a SQLite path, "
                         "mysql+pymysql://... or postgresql://...") from None
    except ModuleNotFoundError as exc:
        raise StoreError(f"{display(url)}: its database driver is not installed "
                         f"(pip install {exc.name})") from None
    except (ArgumentError, ValueError) as exc:
        raise StoreError(f"cannot parse the database URL {display(url)}: "
                         f"{redact(str(exc), url)}") from None


def _sqlite_engine(connect: Callable[[], sqlite3.Connection]) -> Engine:
    engine = create_engine("sqlite://", creator=connect)

    # pysqlite's own transaction handling defers BEGIN and skips it for DDL; take control
    # (SQLAlchemy's documented recipe) so migrations and writes are real transactions.
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        dbapi_conn.execute("PRAGMA foreign_keys=ON")

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        write = conn.info.get("write_lock") or _WRITE.get()
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _check_ours(engine: Engine, where: str) -> str | None:
    """The schema revision, None for an empty database; StoreError if it is not ours."""
    with engine.connect() as conn:
        try:
            tables = set(inspect(conn).get_table_names())
            revision = (MigrationContext.configure(conn).get_current_revision()
                        if "alembic_version" in tables else None)
        except OperationalError as exc:
            raise StoreError(f"cannot read {where}: {_reason(exc)}") from None
        finally:
            conn.rollback()
    if not tables - {"alembic_version"}:
        return revision
    if revision is None:
        raise StoreError(f"{where} is not a slurm-etc database (it has tables but no "
                         "alembic_version of ours); nothing was written")
    if revision not in known_revisions():
        raise StoreError(f"{where} is at schema revision {revision!r}, which this slurm-etc "
                         "does not know (a newer slurm-etc, or another program's database); "
                         "nothing was written")
    return revision


def _enable_wal(engine: Engine, where: str) -> None:
    raw = engine.raw_connection()
    try:
        driver: Any = raw.driver_connection
        mode = driver.execute("PRAGMA journal_mode=WAL").fetchone()
    finally:
        raw.close()
    if not mode or str(mode[0]).lower() != "wal":
        log.warning("%s: SQLite refused WAL mode (journal mode %s); readers may block the "
                    "writer", where, mode[0] if mode else "unknown")


def _migrate(engine: Engine) -> None:
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    head = head_revision()
    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
        conn.rollback()
        if current == head:
            return
        # One writer migrates; a concurrent opener waits on the lock, then finds head.
        # SQLite: a batch migration rebuilds a table (copy, drop, rename); with foreign keys
        # on, dropping a parent table would cascade-delete its children, so they are off
        # while it runs (the pragma cannot change inside a transaction) and checked after.
        sqlite = engine.dialect.name == "sqlite"
        driver: Any = conn.connection.driver_connection
        conn.info["write_lock"] = True
        try:
            if sqlite:
                driver.execute("PRAGMA foreign_keys=OFF")
            with conn.begin():
                if MigrationContext.configure(conn).get_current_revision() != head:
                    cfg.attributes["connection"] = conn
                    command.upgrade(cfg, "head")
                    if sqlite and driver.execute("PRAGMA foreign_key_check").fetchall():
                        raise StoreError("the schema upgrade broke a foreign key; it was "
                                         "rolled back and nothing was written")
        finally:
            conn.info.pop("write_lock", None)
            if sqlite:
                driver.execute("PRAGMA foreign_keys=ON")

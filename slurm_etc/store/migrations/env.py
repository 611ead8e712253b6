"""Alembic environment: runs on the connection ``store.db`` hands over, else on a URL.

The URL is the config's ``sqlalchemy.url``, else ``-x db=PATH``, else the store's default
path (``$SLURM_ETC_DB`` or ``~/.local/share/slurm-etc/etc.db``).
"""
from alembic import context
from sqlalchemy import create_engine

from slurm_etc.store.db import default_db_path
from slurm_etc.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    path = context.get_x_argument(as_dictionary=True).get("db") or default_db_path()
    return f"sqlite:///{path}"


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
elif config.attributes.get("connection") is not None:
    _run(config.attributes["connection"])
else:
    with create_engine(_url()).begin() as conn:
        _run(conn)

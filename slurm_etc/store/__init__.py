"""The SQLite store (SQLAlchemy 2 + Alembic): the only package that imports sqlalchemy."""
from .db import ENV_DB, Store, StoreError, default_db_path, open_store
from .policies import StoredPolicy, get_policy, list_policies, set_policy, unset_policy

__all__ = ["ENV_DB", "Store", "StoreError", "StoredPolicy", "default_db_path", "get_policy",
           "list_policies", "open_store", "set_policy", "unset_policy"]

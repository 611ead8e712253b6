"""The resize policy that binds one job: its partition's and its account's, merged."""
from __future__ import annotations

from slurm_etc.policy.rules import EffectivePolicy, effective


def job_policy(partition: str | None, account: str | None, db: str | None = None
               ) -> EffectivePolicy:
    """Merge the stored policies of ``partition`` and ``account`` (defaults where none is
    set, or no policy database exists yet: reading never creates one)."""
    import os

    from slurm_etc.store.db import default_db_path, open_store_readonly
    from slurm_etc.store.policies import list_policies

    path = db or str(default_db_path())
    if "://" not in path and not os.path.exists(path):
        return EffectivePolicy()
    store = open_store_readonly(path)
    try:
        found = [(p.scope, p.policy) for p in list_policies(store)
                 if (p.scope.kind == "partition" and p.scope.name == partition)
                 or (p.scope.kind == "account" and p.scope.name == account)]
    finally:
        store.close()
    return effective(found)

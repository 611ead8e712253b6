"""The resize policy that binds one job: the site's, narrowed by the user's own.

The site's policies are read from :data:`SITE_POLICY_DB`, a file only root may write (its
owner and mode, and its directory's, are checked before it is read; anything else is
refused in one line, since a policy anyone could have written binds nobody). A policy
database the user names (``run --policy-db``) may only make the site's stricter
(:func:`slurm_etc.policy.admin.stricter`). None of this binds a user who runs another
program: Slurm's QOS and association limits do (see the README's access table).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from slurm_etc.plan.errors import ConfigError
from slurm_etc.policy.admin import stricter
from slurm_etc.policy.rules import EffectivePolicy, PolicyError, effective

# Where the site's policies live: written by `slurm-etc policy set` as root, read by every
# user's coordinator (world-readable: policies are no secret; root-owned: nobody else
# writes them). Sites install it on every node that runs a coordinator.
SITE_POLICY_DB = Path("/etc/slurm-etc/policies.db")


def site_policy_problem(path: Path) -> str | None:
    """Why the site's policy file cannot be trusted (one line), or None: it and its
    directory must be root's and writable by nobody else."""
    for what, p in (("its directory", path.parent), ("the file", path)):
        try:
            st = os.lstat(p)
        except OSError as exc:
            return f"cannot inspect {what} {p}: {exc.strerror}"
        if what == "the file" and not stat.S_ISREG(st.st_mode):
            return f"{p} is not a regular file"
        if st.st_uid != 0 or stat.S_IMODE(st.st_mode) & 0o022:
            return (f"{what} {p} is uid {st.st_uid}'s, mode {stat.S_IMODE(st.st_mode):04o}: "
                    "a site policy must be root's and writable by nobody else")
    return None


def _site_file_exists(path: Path) -> bool:
    """Whether the site has a policy file; one this user cannot even look at is an error,
    not "no policy" (a site's mistake must not lift its limits silently)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise ConfigError(f"cannot read the site's policies {path}: {exc.strerror} (the "
                          "site's policy file and its directory must be readable by every "
                          "user: 0644 in a 0755 directory, both root's)") from None
    return True


def read_policies(path: str | os.PathLike[str], partition: str | None,
                  account: str | None) -> EffectivePolicy:
    """The stored policies of ``partition`` and ``account`` in one database, merged."""
    from slurm_etc.store.db import open_store_readonly
    from slurm_etc.store.guard import ReadLimits
    from slurm_etc.store.policies import list_policies

    # a SQLite file is read with its schema checked and under a deadline, as status does
    store = open_store_readonly(path, limits=ReadLimits())
    try:
        found = [(p.scope, p.policy) for p in list_policies(store)
                 if (p.scope.kind == "partition" and p.scope.name == partition)
                 or (p.scope.kind == "account" and p.scope.name == account)]
    finally:
        store.close()
    return effective(found)


def job_policy(partition: str | None, account: str | None, db: str | None = None, *,
               site: str | os.PathLike[str] | None = None) -> EffectivePolicy:
    """The policy of a job in ``partition`` under ``account``.

    Args:
        db: the user's own policy database (``run --policy-db``: a path or URL); it can
            only make the site's policy stricter.
        site: the site's policy file (default :data:`SITE_POLICY_DB`); none there:
            defaults. Reading never creates a database.

    Raises:
        ConfigError: the site's file is not root's alone, or the two policies leave
            nothing (one line).
        StoreError: a database cannot be read or is not ours.
    """
    site_path = Path(site) if site is not None else SITE_POLICY_DB
    policy = EffectivePolicy()
    try:
        if _site_file_exists(site_path):
            problem = site_policy_problem(site_path)
            if problem:
                raise ConfigError(f"not using the site's policies: {problem}")
            policy = read_policies(site_path, partition, account)
        if db is not None:
            if "://" not in db and not db.startswith("@") and not os.path.exists(db):
                raise ConfigError(f"--policy-db {db}: no such file")
            policy = stricter(policy, read_policies(db, partition, account))
    except PolicyError as exc:
        raise ConfigError(f"resize policy: {exc}") from None
    return policy

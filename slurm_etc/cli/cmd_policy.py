"""`slurm-etc policy show|set|unset`: admin resize policies per partition or account
(`apply|check`, the limits Slurm enforces: cmd_policy_enforce.py).

Anyone may read policies; only root or a Slurm Operator/Administrator may change them.
Who is asking comes from the process's real uid (``os.getuid()`` -> ``pwd.getpwuid``),
never from LOGNAME/USER, and ``sacctmgr`` is asked about that user. That check is a
convenience that keeps honest users from mistakes: it runs in the caller's own process (a
user namespace makes anyone uid 0). The boundary is the site's policy file, which only
root can write (the kernel refuses anyone else, a namespace "root" included); and
``updated_by`` is the writer's claim about itself. Tests inject ``ctx.obj["admin_check"]``
and ``ctx.obj["site_policy_db"]``.
"""
from __future__ import annotations

import json
import os
import pwd
import subprocess
from collections.abc import Callable
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from .. import bounds
from ..coordinator.policy_lookup import SITE_POLICY_DB, site_policy_problem
from ..policy.admin import AdminVerdict, SacctmgrAnswer, adminlevel_command, verdict
from ..policy.rules import (
    DEFAULT_REQUEST_PATIENCE_S,
    FIELDS,
    EffectivePolicy,
    PolicyError,
    Scope,
    check_keys,
    effective,
    parse_assignments,
)
from ..store import (
    StoredPolicy,
    StoreError,
    get_policy,
    is_url,
    list_policies,
    open_store,
    open_store_readonly,
    set_policy,
    unset_policy,
)
from ..store.db import redact, sqlite_path, with_password_file
from .errors import UserError
from .params import SafePath, Text

SACCTMGR_TIMEOUT_S = 10
# Where sacctmgr is looked for: fixed system directories, not the caller's PATH, on which
# anyone can put a "sacctmgr" that claims Administrator.
SACCTMGR_DIRS = ("/usr/bin", "/usr/local/bin", "/bin", "/usr/sbin", "/usr/local/sbin",
                 "/opt/slurm/bin")


def real_user() -> tuple[int, str | None]:
    """The process's real uid and its name in the password database (None: no entry)."""
    uid = os.getuid()
    try:
        return uid, pwd.getpwuid(uid).pw_name
    except KeyError:
        return uid, None


def find_sacctmgr() -> str | None:
    for directory in SACCTMGR_DIRS:
        path = os.path.join(directory, "sacctmgr")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def ask_sacctmgr(user: str) -> SacctmgrAnswer:
    """``sacctmgr``'s answer about ``user``'s AdminLevel; a failure is one line."""
    sacctmgr = find_sacctmgr()
    if sacctmgr is None:
        return SacctmgrAnswer(problem=f"sacctmgr not found in {':'.join(SACCTMGR_DIRS)}")
    try:
        done = subprocess.run(adminlevel_command(user, sacctmgr), check=False,
                              capture_output=True, text=True, timeout=SACCTMGR_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return SacctmgrAnswer(problem=f"{sacctmgr} timed out after {SACCTMGR_TIMEOUT_S} s")
    except OSError as exc:
        return SacctmgrAnswer(problem=f"{sacctmgr} could not run: {exc.strerror or exc}")
    if done.returncode != 0:
        first = next((line.strip() for line in done.stderr.splitlines() if line.strip()), "")
        return SacctmgrAnswer(problem=f"{sacctmgr} exited with code {done.returncode}"
                                      + (f": {first}" if first else ""))
    return SacctmgrAnswer(output=done.stdout)


def slurm_admin_check() -> AdminVerdict:
    """root, or ``sacctmgr`` reports AdminLevel Operator/Administrator for the real uid's
    user."""
    uid, user = real_user()
    answer = ask_sacctmgr(user) if uid != 0 and user is not None else None
    return verdict(user, uid, answer)


def _scope(partition: str | None, account: str | None) -> Scope | None:
    """The one scope given, or None."""
    if partition and account:
        raise UserError("give --partition or --account, not both")
    if partition:
        return _make_scope("partition", partition)
    if account:
        return _make_scope("account", account)
    return None


def _required_scope(partition: str | None, account: str | None) -> Scope:
    scope = _scope(partition, account)
    if scope is None:
        raise UserError("give the policy's scope: --partition NAME or --account NAME")
    return scope


def _make_scope(kind: str, name: str) -> Scope:
    try:
        return Scope(kind, name)
    except PolicyError as exc:
        raise UserError(str(exc)) from None


def _target(ctx: click.Context) -> tuple[str, bool]:
    """The policy database: ``--db`` (a user's own, which ``run --policy-db`` can use to
    make the site's stricter) or the site's (:data:`SITE_POLICY_DB`); and whether it is the
    site's."""
    path = ctx.obj.get("db_path")
    if path:
        return with_password_file(path, ctx.obj.get("db_password_file")), False
    return str(ctx.obj.get("site_policy_db", SITE_POLICY_DB)), True


def _store(ctx: click.Context):
    target, site = _target(ctx)
    if site:  # every user's coordinator reads it: a directory they can traverse
        directory = Path(target).parent
        try:
            if not directory.exists():
                directory.mkdir(parents=True)
                os.chmod(directory, 0o755)  # whatever root's umask
        except OSError as exc:
            raise UserError(f"cannot create {directory} for the site's policies: "
                            f"{exc.strerror} (only root can write the site's policies)"
                            ) from None
    try:
        # the site's file is read by every user's coordinator (policies are no secret) and
        # written by root only; any other new database is its owner's alone
        return open_store(target, file_mode=0o644 if site else 0o600)
    except StoreError as exc:
        raise UserError(redact(str(exc), target)) from None


def _store_to_read(ctx: click.Context):
    """The store, or None when its file does not exist yet: reading creates nothing."""
    target, site = _target(ctx)
    if is_url(target) and sqlite_path(target) is None:
        return _store(ctx)
    db = sqlite_path(target)
    if db is None or not db.exists():
        return None
    if site:
        problem = site_policy_problem(db)
        if problem:
            raise UserError(f"not reading the site's policies: {problem}")
    try:
        return open_store_readonly(target)
    except StoreError as exc:
        raise UserError(redact(str(exc), target)) from None


def _require_admin(ctx: click.Context) -> str:
    """The user's name (from the real uid) if they may change policies; UserError (nothing
    written) if not."""
    check: Callable[[], AdminVerdict] = ctx.obj.get("admin_check", slurm_admin_check)
    result = check()
    if not result.allowed:
        raise UserError(f"permission denied: {result.reason}")
    return result.user


def _value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (tuple, list)):
        return ",".join(map(str, v))
    return str(v)


# What an unset field means in the effective policy, where it is not "no limit".
_UNSET_EFFECTIVE = {"request_patience_s": f"{DEFAULT_REQUEST_PATIENCE_S} (default)"}


def _table(policies: list[StoredPolicy], title: str,
           merged: EffectivePolicy | None = None) -> Table:
    """Fields as rows, one column per scope (narrow enough for a terminal), and the
    effective policy last when given ("any": no limit)."""
    t = Table(title=title)
    t.add_column("field", style="bold")
    for p in policies:
        t.add_column(str(p.scope), justify="right")
    if merged is not None:
        t.add_column("effective", justify="right", style="bold")
    for f in FIELDS:
        extra = [] if merged is None else [_value(getattr(merged, f)) if getattr(
            merged, f) is not None else _UNSET_EFFECTIVE.get(f, "any")]
        t.add_row(f, *(_value(getattr(p.policy, f)) for p in policies), *extra)
    pad = [] if merged is None else [""]
    t.add_row("changed by", *(p.updated_by for p in policies), *pad)
    t.add_row("changed at (UTC)", *(f"{p.updated_at:%Y-%m-%d %H:%M}" for p in policies), *pad)
    return t


@click.group()
@click.option("--db", "db_path", envvar="SLURM_ETC_DB", metavar="PATH|URL|@FILE",
              type=Text(bounds.PATH_CHARS),
              help=f"Another policy database (a SQLite file, a server URL, or @FILE: a "
                   f"URL kept in an owner-only file) instead of the site's "
                   f"({SITE_POLICY_DB}); `run --policy-db` can use it to make the site's "
                   "policies stricter, never looser.")
@click.option("--db-password-file", type=SafePath(dir_okay=False),
              envvar="SLURM_ETC_DB_PASSWORD_FILE",
              help="Read the --db URL's password from this owner-only file (never in argv "
                   "or the environment).")
@click.pass_context
def policy(ctx: click.Context, db_path: str | None, db_password_file: str | None) -> None:
    """Admin resize policies per partition or account (min/max nodes, tp/pp, growth,
    preemption grace, resize cap). The site's live in a root-owned file every
    coordinator reads; only root can write it, whatever the admin check says."""
    ctx.obj["db_path"] = db_path
    if db_password_file and not db_path:
        raise UserError("--db-password-file needs --db URL")
    ctx.obj["db_password_file"] = db_password_file


@policy.command()
@click.option("--partition", type=Text(), help="Show this partition's policy.")
@click.option("--account", type=Text(), help="Show this account's policy.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def show(ctx: click.Context, partition: str | None, account: str | None, as_json: bool) -> None:
    """Show policies: all, one scope's, or (with both options) what binds a job there."""
    both = bool(partition and account)
    if partition and account:
        scopes = [_make_scope("partition", partition), _make_scope("account", account)]
    else:
        scopes = [s for s in [_scope(partition, account)] if s]
    store = _store_to_read(ctx)
    found = []
    if store is not None:
        try:
            found = ([p for p in (get_policy(store, s) for s in scopes) if p] if scopes
                     else list_policies(store))
        finally:
            store.close()
    merged = None
    if both:
        try:
            merged = effective((p.scope, p.policy) for p in found)
        except PolicyError as exc:
            raise UserError(f"the policies contradict each other: {exc}") from None
    if as_json:
        out: dict = {"policies": [p.to_json() for p in found]}
        if merged is not None:
            out["effective"] = {f: _jsonable(getattr(merged, f)) for f in FIELDS}
            out["effective"]["request_patience_s"] = merged.patience_s  # unset: the 300 s
        click.echo(json.dumps(out, indent=2))
        return
    if not found and merged is None:
        click.echo(f"no policy for {scopes[0]}" if scopes else "no policies set", err=True)
        return
    title = (f"resize policies binding partition {partition}, account {account} "
             "(the stricter value wins)" if merged is not None else "resize policies")
    Console().print(_table(found, title, merged))


@policy.command("set")
@click.option("--partition", type=Text(), help="Set the policy of this partition.")
@click.option("--account", type=Text(), help="Set the policy of this account.")
@click.option("--json", "as_json", is_flag=True, help="Print the resulting policy as JSON.")
@click.argument("assignments", nargs=-1, required=True, metavar="KEY=VALUE...",
                type=Text(bounds.LINE_CHARS + 32))
@click.pass_context
def set_(ctx: click.Context, partition: str | None, account: str | None, as_json: bool,
         assignments: tuple[str, ...]) -> None:
    """Set policy fields, e.g. min_nodes=2 max_nodes=32 allowed_tp=2,4,8 grow=yes
    grow_partition=preempt grow_qos=scavenger preempt_grace_s=2m max_resizes_per_hour=6
    request_patience_s=5m."""
    scope = _required_scope(partition, account)
    try:
        changes = parse_assignments(assignments)
    except PolicyError as exc:
        raise UserError(str(exc)) from None
    who = _require_admin(ctx)
    store = _store(ctx)
    try:
        result = set_policy(store, scope, changes, who)
    except PolicyError as exc:
        raise UserError(f"{exc}; nothing was written") from None
    finally:
        store.close()
    _print_result(result, scope, as_json)


@policy.command()
@click.option("--partition", type=Text(), help="Unset fields of this partition's policy.")
@click.option("--account", type=Text(), help="Unset fields of this account's policy.")
@click.option("--json", "as_json", is_flag=True, help="Print the remaining policy as JSON.")
@click.argument("keys", nargs=-1, metavar="[KEY...]", type=Text())
@click.pass_context
def unset(ctx: click.Context, partition: str | None, account: str | None, as_json: bool,
          keys: tuple[str, ...]) -> None:
    """Unset policy fields (defaults apply again); without keys, remove the whole policy."""
    scope = _required_scope(partition, account)
    try:
        names = check_keys(keys)
    except PolicyError as exc:
        raise UserError(str(exc)) from None
    who = _require_admin(ctx)
    store = _store(ctx)
    try:
        result = unset_policy(store, scope, names or None, who)
    except PolicyError as exc:
        raise UserError(str(exc)) from None
    finally:
        store.close()
    _print_result(result, scope, as_json)


def _print_result(result: StoredPolicy | None, scope: Scope, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"policy": result.to_json() if result else None}, indent=2))
    elif result is None:
        click.echo(f"{scope}: policy removed", err=True)
    else:
        Console().print(_table([result], f"{scope}"))


def _jsonable(v):
    return list(v) if isinstance(v, tuple) else v

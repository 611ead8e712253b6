"""Admin resize policies in the store: read by anyone, written in one short transaction.

Authorisation is the caller's job (the CLI checks root or Slurm admin level); this module
validates every change as a whole before writing, so an invalid change writes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterable, Mapping

from sqlalchemy import select

from ..policy.rules import FIELDS, PolicyError, ResizePolicy, Scope, updated
from .db import Store, guarded
from .models import PolicyRow

_guarded = guarded("the policy database", "; nothing was written")

_LISTS = ("allowed_tp", "allowed_pp")


@dataclass(frozen=True)
class StoredPolicy:
    """A policy with its scope and who changed it last, when."""

    scope: Scope
    policy: ResizePolicy
    updated_at: datetime
    updated_by: str

    def to_json(self) -> dict:
        fields = {k: list(v) if k in _LISTS and v is not None else v
                  for k, v in ((f, getattr(self.policy, f)) for f in FIELDS)}
        return {"scope": str(self.scope), "kind": self.scope.kind, "name": self.scope.name,
                **fields, "updated_at": self.updated_at.isoformat(),
                "updated_by": self.updated_by}


@_guarded
def list_policies(store: Store) -> list[StoredPolicy]:
    """Every stored policy, partitions first, then accounts, each by name."""
    with store.transaction() as session:
        rows = session.scalars(select(PolicyRow)).all()
        out = [_stored(r) for r in rows]
    return sorted(out, key=lambda p: (p.scope.kind != "partition", p.scope.name))


@_guarded
def get_policy(store: Store, scope: Scope) -> StoredPolicy | None:
    """The policy of one scope, or None."""
    with store.transaction() as session:
        row = _row(session, scope)
        return _stored(row) if row else None


@_guarded
def set_policy(store: Store, scope: Scope, changes: Mapping[str, object],
               user: str) -> StoredPolicy:
    """Set fields of a scope's policy (creating it), validated with the fields already set.

    Raises:
        PolicyError: the merged policy is invalid; nothing is written.
    """
    if not changes:
        raise PolicyError("nothing to set: give key=value pairs")
    with store.transaction(write=True) as session:
        row = _row(session, scope)
        current = _policy(row) if row else ResizePolicy()
        try:
            merged = updated(current, changes)
        except PolicyError as exc:
            raise PolicyError(f"{scope}: {exc}"
                              + (" (with the fields already set)" if row else "")) from None
        if row is None:
            row = PolicyRow(scope_kind=scope.kind, scope_name=scope.name)
            session.add(row)
        _write(row, merged, user)
        session.flush()
        return _stored(row)


@_guarded
def unset_policy(store: Store, scope: Scope, keys: Iterable[str] | None,
                 user: str) -> StoredPolicy | None:
    """Unset fields of a scope's policy; all of them (deleting it) when ``keys`` is None.

    Returns:
        The remaining policy, or None if the scope has no policy left.

    Raises:
        PolicyError: the scope has no policy.
    """
    with store.transaction(write=True) as session:
        row = _row(session, scope)
        if row is None:
            raise PolicyError(f"{scope} has no policy")
        remaining = updated(_policy(row), {k: None for k in keys}) if keys else ResizePolicy()
        if remaining.is_empty():
            session.delete(row)
            return None
        _write(row, remaining, user)
        session.flush()
        return _stored(row)


def _row(session, scope: Scope) -> PolicyRow | None:
    return session.scalars(select(PolicyRow).where(PolicyRow.scope_kind == scope.kind,
                                                   PolicyRow.scope_name == scope.name)).first()


def _policy(row: PolicyRow) -> ResizePolicy:
    values = {f: getattr(row, f) for f in FIELDS}
    for f in _LISTS:
        if values[f] is not None:
            values[f] = tuple(int(v) for v in values[f].split(","))
    return ResizePolicy(**values)


def _write(row: PolicyRow, policy: ResizePolicy, user: str) -> None:
    for f in FIELDS:
        value = getattr(policy, f)
        if f in _LISTS and value is not None:
            value = ",".join(map(str, value))
        setattr(row, f, value)
    row.updated_at = datetime.now(timezone.utc)
    row.updated_by = user


def _stored(row: PolicyRow) -> StoredPolicy:
    at = row.updated_at if row.updated_at.tzinfo else row.updated_at.replace(tzinfo=timezone.utc)
    return StoredPolicy(Scope(row.scope_kind, row.scope_name), _policy(row), at, row.updated_by)

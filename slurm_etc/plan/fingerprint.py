"""One fingerprint of a migration plan: what every participant must agree on.

The coordinator sends it with a resize order and records it; each worker plans again and
compares; the executor's program digest extends it with the chunking. Deterministic on every
process given the same plan (integer arrays hashed as int64, layouts by their repr).
"""
from __future__ import annotations

import hashlib

import numpy as np

from .plan import MigrationPlan


def plan_fingerprint(plan: MigrationPlan) -> bytes:
    """32 bytes over the layouts, the lost devices, the model, every transfer and every
    message (source, destination, bytes, round)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(repr((plan.old.config, plan.old.devices, plan.new.config, plan.new.devices,
                   plan.catalog.model.name, tuple(plan.lost))).encode())
    t, m = plan.transfers, plan.messages
    for arr in (t.src, t.dst, t.frag, t.nbytes, t.offset, m.src, m.dst, m.nbytes, m.round):
        h.update(np.ascontiguousarray(arr, np.int64).tobytes())
    return h.digest()


def plan_digest(plan: MigrationPlan) -> str:
    """The fingerprint as the hex text orders and the record carry."""
    return plan_fingerprint(plan).hex()

"""Run a whole migration inside one process, one thread per device (ThreadTransport).

For tests and quick checks: the same executor, the same protocol and the same packing as
across processes, only the wire is a queue.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .executor import MigrationError, MigrationOptions, MigrationResult, execute_migration
from .faults import FaultInjector
from .program import group_devices
from .shards import LocalShard
from .transport import ThreadHub

if TYPE_CHECKING:
    from slurm_etc.plan.plan import MigrationPlan


def run_threads(plan: MigrationPlan, old_state: Mapping[int, Sequence[LocalShard]], *,
                options: MigrationOptions | None = None,
                faults: FaultInjector | None = None,
                destinations: Mapping[int, Sequence] | None = None,
                agreed: bool = False, join_timeout_s: float = 600.0
                ) -> dict[int, MigrationResult | BaseException]:
    """Execute ``plan`` with every device of the migration group as a thread.

    Args:
        old_state: the old shards of each device (devices without an old rank may be absent).
        destinations: per device, the tensors its new shards go into (see
            ``execute_migration``); default: fresh ones.
        agreed: the ranks agreed on the program before (``execute_migration(agreed=True)``:
            no gate vote).

    Returns:
        Per device, its MigrationResult, or the exception it raised (MigrationAborted on an
        abort).
    """
    devices = group_devices(plan)
    hub = ThreadHub(len(devices))
    out: dict[int, MigrationResult | BaseException] = {}

    def work(rank: int, device: int) -> None:
        try:
            out[device] = execute_migration(plan, hub.transports()[rank], device,
                                            old_state.get(device, ()), options=options,
                                            faults=faults,
                                            destinations=(destinations or {}).get(device),
                                            agreed=agreed)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            out[device] = exc

    threads = [threading.Thread(target=work, args=(r, d), name=f"migrate-{d}", daemon=True)
               for r, d in enumerate(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout_s)
    hung = [d for t, d in zip(threads, devices) if t.is_alive()]
    if hung:
        raise MigrationError(f"devices {hung} did not finish within {join_timeout_s:.0f} s")
    return out

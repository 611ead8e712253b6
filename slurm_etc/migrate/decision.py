"""The commit of a migration, decided once for every rank.

The commit vote is an allgather: when a rank dies inside it, the survivors' views of it can
differ (some got every rank's OK before the death, some an error). Each following its own
view would split the job: some install the new layout, some keep the old. Instead, each
rank proposes what it saw under one key of the rendezvous store (which the coordinator
hosts: it outlives any worker) with compare-and-set; the first proposal recorded is the
decision, and every rank follows it.

Either decision is safe to follow: ``commit`` is proposed only by a rank that saw every
rank's vote OK, so every rank (each one's own vote included) had finished its part of the
data; ``abort`` keeps the old state, which no rank has dropped before the decision.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

COMMIT, ABORT = b"commit", b"abort"


class CommitDecision:
    """``decide(saw_commit) -> bool``: the migration's one decision (True: commit).

    Args:
        store: a ``torch.distributed`` store every rank of the migration reaches.
        key: the decision's key, unique per resize (e.g. ``<job>/g<generation>/commit``).
        store_lost: called with the error when the store stopped answering (its
            coordinator died: it records a commit decision before any rank hears of it,
            and a restarted one sets every decision of its record again); returns once the
            store answers again, and the decision is asked again. None: the error stands.
    """

    def __init__(self, store: Any, key: str, *,
                 store_lost: Callable[[Any], None] | None = None) -> None:
        self.store, self.key, self.store_lost = store, key, store_lost

    def __call__(self, saw_commit: bool) -> bool:
        from slurm_etc.protocol.store import StoreUnreachable  # torch's: not at import

        while True:
            try:
                got = self.store.compare_set(self.key, "", COMMIT if saw_commit else ABORT)
                break
            except StoreUnreachable as err:
                if self.store_lost is None:
                    raise
                self.store_lost(err)
        if got not in (COMMIT, ABORT):
            raise RuntimeError(f"the commit decision {self.key!r} holds {got[:40]!r}, "
                               "neither commit nor abort")
        return bool(got == COMMIT)

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

from typing import Any

COMMIT, ABORT = b"commit", b"abort"


class CommitDecision:
    """``decide(saw_commit) -> bool``: the migration's one decision (True: commit).

    Args:
        store: a ``torch.distributed`` store every rank of the migration reaches.
        key: the decision's key, unique per resize (e.g. ``<job>/g<generation>/commit``).
    """

    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key = store, key

    def __call__(self, saw_commit: bool) -> bool:
        got = self.store.compare_set(self.key, "", COMMIT if saw_commit else ABORT)
        if got not in (COMMIT, ABORT):
            raise RuntimeError(f"the commit decision {self.key!r} holds {got[:40]!r}, "
                               "neither commit nor abort")
        return bool(got == COMMIT)

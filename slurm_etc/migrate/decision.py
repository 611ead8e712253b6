"""The commit of a migration, decided once for every rank.

The commit vote is an allgather: when a rank dies inside it, the survivors' views of it can
differ (some got every rank's OK before the death, some an error). Each following its own
view would split the job: some install the new layout, some keep the old. Instead, the
decision is recorded under one key of the rendezvous store (which the coordinator hosts: it
outlives any worker) with compare-and-set; the first proposal recorded is the decision, and
every rank follows it.

Either decision is safe to follow: ``commit`` is proposed only by a rank that saw every
rank's vote OK, so every rank (each one's own vote included) had finished its part of the
data; ``abort`` keeps the old state, which no rank has dropped before the decision.

Who asks the store: with a ``share`` (the migration group's own small allgather), a rank
that saw every vote OK asks it only if it is the group's proposer (rank 0); a rank whose
view failed always does. Then every rank shares what the store answered it, and all follow
the decision one of them got: one store request a resize where nothing failed, instead of
one a rank. Where the share fails (a peer died since the vote, a rank not in it), each rank
asks the store itself, as without a share; so where the asking rank found the store gone
(its coordinator died: it shares "not asked", and every rank asks and waits for the restart
on its own, reattaching as it does). Every value shared is the store's one decision (each
was its compare-and-set's answer), so following any of them is following the store.

The share carries each rank's data phase too (microseconds, the share's second int64): where
it succeeds every rank knows the group's longest, and its proposer answers the coordinator
for all of them, one message a resize instead of one a rank (``longest_data_s``; None where
the share failed: each rank answers for itself).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

COMMIT, ABORT = b"commit", b"abort"
# what a rank shares of the decision: not asked, or the store's answer
_UNKNOWN, _SHARED = 0, {COMMIT: 1, ABORT: 2}


class CommitDecision:
    """``decide(saw_commit) -> bool``: the migration's one decision (True: commit).

    Args:
        store: a ``torch.distributed`` store every rank of the migration reaches.
        key: the decision's key, unique per resize (e.g. ``<job>/g<generation>/commit``).
        store_lost: called with the error when the store stopped answering (its
            coordinator died: it records a commit decision before any rank hears of it,
            and a restarted one sets every decision of its record again); returns once the
            store answers again, and the decision is asked again. None: the error stands.
        share: every rank of the migration calls it once with what it knows of the decision
            and its data phase in microseconds, and gets every rank's knowledge and the
            longest data phase (an allgather over the migration group); raises when a rank
            is missing. None: every rank asks the store.
        proposer: this rank asks the store for the group when it saw every vote OK.

    Attributes:
        longest_data_s: after a call whose share succeeded, the group's longest data phase
            (seconds); else None.
    """

    def __init__(self, store: Any, key: str, *,
                 store_lost: Callable[[Any], None] | None = None,
                 share: Callable[[int, int], tuple[Sequence[int], int]] | None = None,
                 proposer: bool = True) -> None:
        self.store, self.key, self.store_lost = store, key, store_lost
        self.share, self.proposer = share, proposer
        self.longest_data_s: float | None = None

    def __call__(self, saw_commit: bool, data_s: float = 0.0) -> bool:
        """The decision (True: commit), given this rank's view of the vote and how long its
        part of the data phase took."""
        from slurm_etc.protocol.store import StoreUnreachable  # torch's: not at import

        if self.share is None:
            return self._ask(saw_commit) == COMMIT
        got = None
        if self.proposer or not saw_commit:
            try:
                got = self._ask(saw_commit, wait=False)
            except StoreUnreachable:
                pass  # shares "not asked": every rank asks, each waiting for the restart
        try:
            shared, longest_us = self.share(_UNKNOWN if got is None else _SHARED[got],
                                            max(0, round(data_s * 1e6)))
            self.longest_data_s = longest_us / 1e6
        except RuntimeError:  # a peer died or is not in it (the transport's error): ask
            shared = ()
        known = {v for v in shared if v != _UNKNOWN}
        if got is None and len(known) == 1:
            got = COMMIT if known == {_SHARED[COMMIT]} else ABORT
        elif got is None:  # nothing shared (or, impossibly, two answers): ask
            got = self._ask(saw_commit)
        return got == COMMIT

    def _ask(self, saw_commit: bool, wait: bool = True) -> bytes:
        """The store's decision, this rank's view proposed (compare-and-set). A store that
        stopped answering is waited out (``store_lost``) only with ``wait``: a rank asking
        for the group shares that it could not, rather than keep the others waiting in the
        share while its coordinator restarts (each then asks, and reattaches, itself)."""
        from slurm_etc.protocol.store import StoreUnreachable  # torch's: not at import

        while True:
            try:
                got = self.store.compare_set(self.key, "", COMMIT if saw_commit else ABORT)
                break
            except StoreUnreachable as err:
                if self.store_lost is None or not wait:
                    raise
                self.store_lost(err)
        if got not in (COMMIT, ABORT):
            raise RuntimeError(f"the commit decision {self.key!r} holds {got[:40]!r}, "
                               "neither commit nor abort")
        return bytes(got)


def shared_over(transport: Any, timeout_s: float
                ) -> Callable[[int, int], tuple[Sequence[int], int]]:
    """A :class:`CommitDecision`'s ``share`` over a migration's transport: an allgather of
    two int64 a rank (what it knows of the decision, its data phase in microseconds) on its
    control group (as the votes), within ``timeout_s``."""

    def share(value: int, data_us: int) -> tuple[Sequence[int], int]:
        import torch

        mine = torch.tensor([value, data_us], dtype=torch.int64, device="cpu")  # as the votes
        table = transport.allgather(mine.view(torch.uint8), timeout_s)
        rows = table.contiguous().view(torch.int64).view(-1, 2)
        return [int(v) for v in rows[:, 0]], int(rows[:, 1].max())

    return share

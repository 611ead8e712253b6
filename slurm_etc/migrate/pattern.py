"""The plan's own message pattern as plain contiguous buffers: the data phase's wire floor.

:func:`raw_pattern` moves exactly the bytes the executor moves between the same pairs in the
same rounds (``plan.messages``: source, destination, size, round), over the same kind of
transport, but from and into warm contiguous buffers: no packing, no unpacking, no local
copies, no votes. The executor's data phase against it (``data_over_raw_pattern``) says how
much of the pause the executor adds on top of what the wire itself takes.

Fairness (what keeps it the same pattern as the executor's, not a faster or slower one):

* same messages, sizes, peers and rounds; a round's sends and receives are posted together
  and all are waited for before the next round, as the executor's steps are;
* chunked like the executor (``chunk_bytes``, the chunk of its staging budget): a message
  larger than a chunk travels in the same chunks, one round-step at a time, so the pattern
  has as many synchronisation points as the executor's step list;
* buffers are allocated and written once before the timed runs (warm, as the executor's
  prepared destinations are) and reused;
* every rank starts after a control allgather (the executor's first vote is one too) and the
  time is taken from there to the last completed operation of the rank, its slowest rank
  being the figure, as the executor's data phase is the slowest rank's.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from .program import chunk_range, group_devices, num_chunks
from .transport import Transport

if TYPE_CHECKING:
    from slurm_etc.plan.plan import MigrationPlan


def pattern_steps(plan: MigrationPlan, device: int, chunk_bytes: int | None = None
                  ) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    """This device's (sends, receives) per global step: (peer migration rank, bytes) each.

    One step per round and chunk index (``chunk_bytes`` None: one step per round), the same
    global step list on every rank, as the executor walks it.
    """
    devices = group_devices(plan)
    rank_of = {d: i for i, d in enumerate(devices)}
    m = plan.messages
    if not len(m):
        return []
    rounds = np.asarray(m.round, np.int64)
    nbytes = np.asarray(m.nbytes, np.int64)
    steps: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = []
    for r in range(int(rounds.max()) + 1):
        ks = np.flatnonzero(rounds == r).tolist()
        if not ks:
            continue
        chunks = {k: (num_chunks(int(nbytes[k]), chunk_bytes) if chunk_bytes else 1)
                  for k in ks}
        for j in range(max(chunks.values())):
            sends, recvs = [], []
            for k in ks:
                if j >= chunks[k]:
                    continue
                n = int(nbytes[k])
                c0, c1 = chunk_range(n, chunk_bytes, j) if chunk_bytes else (0, n)
                src, dst = int(m.src[k]), int(m.dst[k])
                if src == device:
                    sends.append((rank_of[dst], c1 - c0))
                if dst == device:
                    recvs.append((rank_of[src], c1 - c0))
            steps.append((sends, recvs))
    return steps


def raw_pattern(plan: MigrationPlan, transport: Transport, device: int, *,
                chunk_bytes: int | None = None, repeats: int = 1, timeout_s: float = 300.0
                ) -> list[float]:
    """Run the plan's message pattern ``repeats`` times; this rank's seconds for each run.

    Collective over the plan's participants (the transport's ranks). Buffers: one send and
    one receive buffer of the largest step's size, written once before the first run.
    """
    steps = pattern_steps(plan, device, chunk_bytes)
    largest = max((n for sends, recvs in steps for _, n in sends + recvs), default=0)
    send = transport.empty(largest)
    recv = transport.empty(largest)
    send.fill_(1)
    recv.fill_(0)
    token = torch.zeros(8, dtype=torch.uint8, device="cpu")  # a vote: host memory
    out = []
    for _ in range(repeats):
        transport.allgather(token, timeout_s)
        t0 = time.perf_counter()
        for i, (sends, recvs) in enumerate(steps):
            if not sends and not recvs:
                continue
            pending = transport.exchange([(p, send[:n]) for p, n in sends],
                                         [(p, recv[:n]) for p, n in recvs], tag=i)
            for p in pending:
                p.wait(timeout_s)
        out.append(time.perf_counter() - t0)
    transport.allgather(token, timeout_s)
    return out

"""The grow scene several unit files share: a 4-node cluster of 2 devices, a 4-layer GPT
that fits 2, 4 and 8 devices but not 6, the layout ``decide`` picks on a set of nodes, and a
real coordinator over a recording backend training on n1 with a request pending."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from slurm_etc.alloc import ClusterTopology, Device, Hardware, TrainingJob, identity_layout
from slurm_etc.plan import PRESETS
from slurm_etc.policy import JobView, ResizeDecision, decide
from slurm_etc.policy.rules import EffectivePolicy
from tests.unit.coordinator_harness import coordinator_over

# the cluster: 4 nodes of 2 devices; a 4-layer GPT, global batch 16: 6 devices (3
# nodes) fit no valid layout (dp | 16, pp | 4, tp in a node), 2, 4 and 8 do, each faster
TOPO = ClusterTopology(2, ("n1", "n2", "n3", "n4"))
JOB = TrainingJob(replace(PRESETS["gpt-1.3b"], num_layers=4, name="four-layers"),
                  global_batch=16)
HW = Hardware(gpus_per_node=2)


def node(*names: str) -> frozenset[Device]:
    return frozenset(Device(n, i) for n in names for i in range(2))


def fake_cost(layout: Any, config: Any, allocation: Any) -> int:
    return len(set(allocation.vranks) ^ set(layout.devices))


ANCHOR = node("n1")


def on(held: frozenset[Device], pinned: frozenset[Device] = ANCHOR) -> tuple[Any, Any]:
    """The vranks and layout ``decide`` starts on ``held``."""
    d = decide(JobView(0.0, JOB, HW, TOPO, held, pinned=pinned), EffectivePolicy(grow=False),
               cost=fake_cost)
    resize = next(a for a in d.actions if isinstance(a, ResizeDecision))
    return resize.allocation.vranks, identity_layout(resize.config, resize.allocation.pool)


def of(decision: Any, kind: type) -> list[Any]:
    return [a for a in decision.actions if isinstance(a, kind)]


@contextmanager
def growing_from_one_node(tmp_path: Any, job: str, backend: Any, policy: EffectivePolicy,
                          sent_ago_s: float) -> Iterator[Any]:
    """A coordinator over ``backend`` training on n1's devices, with a request for three
    more nodes pending for ``sent_ago_s`` seconds; yields it."""
    vranks, layout = on(node("n1"))
    with coordinator_over(tmp_path, job, backend, training=JOB, policy=policy,
                          hardware=HW, backend_name="local") as (c, _db):
        c.holdings = replace(c.holdings, held={d: "a0" for d in node("n1")},
                             layout=layout, vranks=dict(vranks), step=5)
        c.launches.pinned = set(node("n1"))
        c.request.count, c.request.growing = 1, 3
        c.request.sent_at = time.monotonic() - sent_ago_s
        yield c

"""A synthetic trace: a shared GPU cluster where elastic jobs soak up what rigid jobs leave.

Everything is drawn from one seeded generator, so a (parameters, seed) pair always gives the
same trace. The workload, per simulated hour on 256 nodes (scaled with the node count):

- rigid jobs arrive as a Poisson stream, half of them small (1, 2 or 4 GPUs on one node),
  half whole-node (1 to 8 nodes), running 0.5 h plus an exponential time (mean 2 h, at
  most 6 h in all); their offered load is ``rigid_load`` (default 85%) of the cluster's
  GPUs, so with the elastic jobs the cluster is busy and a queue forms, as on a shared
  production cluster;
- each elastic job asks to grow about every 25 min (a Poisson stream): the sizes in the
  trace, whole nodes (1-4) or 2-6 GPUs on one node (what backfill can start soon), are
  what the naive launcher submits; slurm-etc submits what ``decide`` asks for instead;
- each elastic job's members are preempted about every 1.5 h (8-32 GPUs, for 1-3 h);
- about one node fails every 2 h and comes back 1-4 h later.
"""
from __future__ import annotations

import math
import random

from ..policy.rules import ResizePolicy, Scope
from .trace import ClusterSpec, ElasticJobSpec, Event, Trace

HOUR = 3600.0

# (model, global batch): batch sizes as published recipes use them.
JOB_MIX = (("gpt-1.3b", 512), ("llama-7b", 1024), ("llama-13b", 1536), ("gpt-1.3b", 768),
           ("llama-7b", 512), ("llama-13b", 1024))


def synthetic_trace(nodes: int = 256, gpus_per_node: int = 8, jobs: int = 6,
                    hours: float = 24.0, seed: int = 0, nodes_per_switch: int = 16,
                    rigid_load: float = 0.85) -> Trace:
    """Generate the trace described in the module docstring.

    Args:
        nodes: cluster nodes.
        gpus_per_node: devices per node.
        jobs: elastic jobs (models cycle through ``JOB_MIX``).
        hours: simulated time.
        seed: random seed.
        nodes_per_switch: nodes per leaf switch.
        rigid_load: rigid jobs' offered load as a fraction of the cluster's GPUs.
    """
    rng = random.Random(seed)
    G = gpus_per_node
    end = hours * HOUR
    cluster = ClusterSpec(nodes, G, nodes_per_switch)
    elastic = tuple(
        ElasticJobSpec(name=f"elastic-{i}", model=JOB_MIX[i % len(JOB_MIX)][0],
                       global_batch=JOB_MIX[i % len(JOB_MIX)][1], nodes=4,
                       account=("ml-research", "ml-prod")[i % 2],
                       start=round(rng.uniform(0, 0.5 * HOUR)))
        for i in range(jobs))
    max_nodes = max(8, nodes // max(jobs, 1))
    policies = (
        (Scope("partition", "gpu"), ResizePolicy(min_nodes=2, max_nodes=max_nodes, grow=True,
                                                 grow_partition="preempt",
                                                 preempt_grace_s=120,
                                                 max_resizes_per_hour=6)),
        (Scope("account", "ml-prod"), ResizePolicy(allowed_pp=(1, 2, 4, 8))),
    )
    events: list[Event] = []

    def poisson(rate_per_hour: float):
        t = rng.expovariate(rate_per_hour) * HOUR
        while t < end:
            yield round(t)  # whole seconds keep saved traces readable
            t += rng.expovariate(rate_per_hour) * HOUR

    # Rigid jobs: 0.5 h plus an exponential part (mean 2 h), at most 6 h.
    mean_hours = 0.5 + 2.0 * (1 - math.exp(-(6.0 - 0.5) / 2.0))
    mean_gpus = 0.5 * (1 + 2 + 4) / 3 + 0.5 * 4.5 * G
    rate = rigid_load * nodes * G / (mean_gpus * mean_hours)
    for k, t in enumerate(poisson(rate)):
        duration = round(min(0.5 * HOUR + rng.expovariate(1 / (2.0 * HOUR)), 6 * HOUR))
        if rng.random() < 0.5:
            events.append(Event(t, "submit", job=f"rigid-{k}", gpus=rng.choice((1, 2, 4)),
                                duration=duration))
        else:
            events.append(Event(t, "submit", job=f"rigid-{k}", nodes=rng.randint(1, 8),
                                duration=duration))
    for j in elastic:
        for t in poisson(60 / 25):
            if t < j.start:
                continue
            if rng.random() < 0.6:
                events.append(Event(t, "grow", job=j.name, nodes=rng.randint(1, 4)))
            else:
                events.append(Event(t, "grow", job=j.name, gpus=rng.choice((2, 4, 6))))
        for t in poisson(1 / 1.5):
            if t > j.start:
                events.append(Event(t, "preempt", job=j.name, gpus=rng.choice((8, 16, 24, 32)),
                                    duration=round(rng.uniform(1, 3) * HOUR)))
    for t in poisson(0.5 * nodes / 256):
        node = rng.randrange(nodes)
        events.append(Event(t, "fail", node=node))
        back = t + round(rng.uniform(1, 4) * HOUR)
        if back < end:
            events.append(Event(back, "recover", node=node))
    events.sort(key=lambda e: e.t)
    return Trace(cluster, elastic, tuple(events), end, policies)

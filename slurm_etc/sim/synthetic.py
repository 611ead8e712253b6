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

from .. import bounds
from ..policy.rules import ResizePolicy, Scope
from .trace import ClusterSpec, ElasticJobSpec, Event, Trace

HOUR = 3600.0

# (model, global batch): batch sizes as published recipes use them.
JOB_MIX = (("gpt-1.3b", 512), ("llama-7b", 1024), ("llama-13b", 1536), ("gpt-1.3b", 768),
           ("llama-7b", 512), ("llama-13b", 1024))


# Events per hour: each elastic job grows (60/25) and is preempted (1/1.5); nodes fail (and
# recover) at one per 2 h per 256 nodes.
_ELASTIC_PER_JOB_HOUR = 60 / 25 + 1 / 1.5
_FAILS_PER_NODE_HOUR = 0.5 / 256


def _rigid_rate(nodes: int, gpus_per_node: int, rigid_load: float) -> float:
    """Rigid jobs per hour: 0.5 h plus an exponential part (mean 2 h), at most 6 h."""
    mean_hours = 0.5 + 2.0 * (1 - math.exp(-(6.0 - 0.5) / 2.0))
    mean_gpus = 0.5 * (1 + 2 + 4) / 3 + 0.5 * 4.5 * gpus_per_node
    return rigid_load * nodes * gpus_per_node / (mean_gpus * mean_hours)


def expected_events(nodes: int, gpus_per_node: int, jobs: int, hours: float,
                    rigid_load: float) -> float:
    """How many events a synthetic trace of these sizes holds on average."""
    per_hour = (_rigid_rate(nodes, gpus_per_node, rigid_load) + jobs * _ELASTIC_PER_JOB_HOUR
                + 2 * _FAILS_PER_NODE_HOUR * nodes)
    return per_hour * hours


def check_size(nodes: int, gpus_per_node: int, jobs: int, hours: float,
               rigid_load: float) -> None:
    """Refuse sizes whose trace could not be generated or simulated (BoundError), before
    anything is drawn: each size within its bound, the devices (nodes x GPUs) and the expected
    events (nodes x GPUs x hours x load, jobs x hours) too."""
    bounds.NODES.check("nodes", nodes)
    bounds.GPUS_PER_NODE.check("gpus_per_node", gpus_per_node)
    bounds.SIM_JOBS.check("jobs", jobs)
    bounds.HOURS.check("hours", hours)
    bounds.LOAD.check("rigid_load", rigid_load)
    bounds.check_product("the synthetic cluster", {"nodes": nodes,
                                                   "gpus_per_node": gpus_per_node},
                         bounds.DEVICES)
    expected = expected_events(nodes, gpus_per_node, jobs, hours, rigid_load)
    if expected > bounds.TRACE_EVENTS.high:
        raise bounds.BoundError(
            f"a synthetic trace of {nodes:,} nodes x {gpus_per_node} GPUs, {jobs} jobs and "
            f"{hours:g} h holds about {expected:,.0f} events; the bound is "
            f"{bounds.TRACE_EVENTS.high:,.0f} (fewer hours or nodes)")


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
    check_size(nodes, gpus_per_node, jobs, hours, rigid_load)
    rng = random.Random(seed)
    G = gpus_per_node
    end = hours * HOUR
    cluster = ClusterSpec(nodes, G, nodes_per_switch)
    elastic, policies = elastic_jobs(rng, jobs, nodes)
    events: list[Event] = []
    for k, t in enumerate(_poisson(rng, _rigid_rate(nodes, G, rigid_load), end)):
        duration = round(min(0.5 * HOUR + rng.expovariate(1 / (2.0 * HOUR)), 6 * HOUR))
        if rng.random() < 0.5:
            events.append(Event(t, "submit", job=f"rigid-{k}", gpus=rng.choice((1, 2, 4)),
                                duration=duration))
        else:
            events.append(Event(t, "submit", job=f"rigid-{k}", nodes=rng.randint(1, 8),
                                duration=duration))
    events += elastic_events(rng, elastic, end)
    for t in _poisson(rng, _FAILS_PER_NODE_HOUR * nodes, end):
        node = rng.randrange(nodes)
        events.append(Event(t, "fail", node=node))
        back = t + round(rng.uniform(1, 4) * HOUR)
        if back < end:
            events.append(Event(back, "recover", node=node))
    events.sort(key=lambda e: e.t)
    return Trace(cluster, elastic, tuple(events), end, policies)


def _poisson(rng: random.Random, rate_per_hour: float, end: float):
    """Event times (whole seconds: saved traces stay readable) of a Poisson stream."""
    t = rng.expovariate(rate_per_hour) * HOUR
    while t < end:
        yield round(t)
        t += rng.expovariate(rate_per_hour) * HOUR


def elastic_jobs(rng: random.Random, jobs: int, nodes: int
                 ) -> tuple[tuple[ElasticJobSpec, ...], tuple[tuple[Scope, ResizePolicy], ...]]:
    """``jobs`` elastic jobs (models from ``JOB_MIX``, 4 nodes each, starting in the first
    half hour) and the admin policies that bind them: what a synthetic trace and a
    replayed history add to the rigid work (:func:`elastic_events` their events)."""
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
    return elastic, policies


def elastic_events(rng: random.Random, elastic: tuple[ElasticJobSpec, ...], end: float
                   ) -> list[Event]:
    """Each elastic job's grow and preemption events until ``end`` (the module docstring's
    rates)."""
    events: list[Event] = []
    for j in elastic:
        for t in _poisson(rng, 60 / 25, end):
            if t < j.start:
                continue
            if rng.random() < 0.6:
                events.append(Event(t, "grow", job=j.name, nodes=rng.randint(1, 4)))
            else:
                events.append(Event(t, "grow", job=j.name, gpus=rng.choice((2, 4, 6))))
        for t in _poisson(rng, 1 / 1.5, end):
            if t > j.start:
                events.append(Event(t, "preempt", job=j.name, gpus=rng.choice((8, 16, 24, 32)),
                                    duration=round(rng.uniform(1, 3) * HOUR)))
    return events

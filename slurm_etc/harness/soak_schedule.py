"""The schedule of ``slurm-etc soak``, drawn from a seed: pure (no I/O, no clock), so the same
seed gives the same schedule on every machine (:func:`draw_schedule`).

A schedule is one job on a simulated local cluster (:data:`NODES` nodes of
:data:`GPUS_PER_NODE` devices, the first node the anchor) and ``events`` events in order.
Each event is one of :data:`KINDS`, and is carried out by one of three means:

* **the events script** of the local backend (``grant``, ``preempt``, ``lose``): fired by the
  backend when the job reached the event's step *and is settled* (no resize in flight), so
  a node lost by the script is always lost between resizes (``lose`` is the loss "after
  commit");
* **the trainer's kill hook** (``phase-kill``): a worker SIGKILLs itself at one phase of the
  resize to one generation (:class:`~slurm_etc.migrate.faults.KillSpec`: before its sends =
  paused, mid-transfer and after-receive = data phase, before-commit and in-vote = commit
  vote, after-commit); armed for the whole job, it hits where that generation's resize
  exists and some worker does that phase, else it is reported as not hit;
* **the soak itself**, from outside, once the job's training reaches the event's turn
  (``worker-kill`` of a worker's process group in steady training, ``resize-kill`` of one
  while a migration is open in the record: the preparation, the pause or the data phase,
  whichever it meets, so drawn as "during a resize", not a phase; both skipped while the
  job's workers run on one node, where nothing outside the node holds a copy of the state;
  ``coordinator-kill``, a
  SIGKILL and a restart on the same record after ``delay_s``; ``duplicate``, a second
  coordinator started on the live job, which must be refused; ``full-disk``, the record's
  filesystem filled for ``steps`` steps).

Node losses *inside* a resize phase are the worker deaths of ``phase-kill`` and
``resize-kill``: the local backend's losses (a whole node's devices taken) fire only while the
job is settled, so a node cannot be taken deterministically inside a phase on this backend.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from slurm_etc.migrate.faults import KILL_PHASES

GPUS_PER_NODE = 2
# the most nodes the job is given at once (the anchor included): up to 6 workers on this
# machine's cores. Nodes lost or preempted never come back (the local backend), so every
# grant is of a fresh node: the cluster has one node per grant besides the anchor.
MOST_HELD = 3
# kinds carried out by the events script, by the trainer's kill hook, by the soak
SCRIPT_KINDS = ("grant", "preempt", "lose")
SOAK_KINDS = ("worker-kill", "resize-kill", "coordinator-kill", "duplicate", "full-disk")
KINDS = SCRIPT_KINDS + ("phase-kill",) + SOAK_KINDS
# how often each kind is drawn (grants and losses drive the resizes the faults land in)
WEIGHTS = {"grant": 5, "preempt": 4, "lose": 3, "phase-kill": 3, "worker-kill": 2,
           "resize-kill": 2, "coordinator-kill": 2, "duplicate": 1, "full-disk": 1}
# preemption notices: none at all to minutes
GRACES_S = (0.0, 0.5, 2.0, 5.0, 15.0, 60.0, 180.0)
# settled steps between two script events, and the steps trained after the last one
SPACING = (4, 8)
TAIL_STEPS = 15
# the workers' train_steps (the LR schedule's length; training ends by the script's end_step)
BUDGET = 100_000


@dataclass(frozen=True)
class SoakEvent:
    """One event of a schedule.

    Attributes:
        index: position in the schedule, from 1.
        kind: one of :data:`KINDS`.
        at_step: script events: the settled step it fires at (the script's ``at_step``);
            the others: the steps of training after the script event before it.
        grace_s: ``preempt``: the notice's grace.
        phase: ``phase-kill``: the kill phase (:data:`~slurm_etc.migrate.faults.
            KILL_PHASES`).
        generation: ``phase-kill``: the generation whose resize it is armed in.
        delay_s: ``coordinator-kill``: seconds between the kill and the restart.
        steps: ``full-disk``: steps trained while the disk is full.
        pick: which worker a kill hits (an index into the live workers, modulo their count).
    """

    index: int
    kind: str
    at_step: int = 0
    grace_s: float = 0.0
    phase: str = ""
    generation: int = 0
    delay_s: float = 0.0
    steps: int = 0
    pick: int = 0

    @property
    def by(self) -> str:
        """Who carries it out: ``script``, ``trainer`` or ``soak``."""
        if self.kind in SCRIPT_KINDS:
            return "script"
        return "trainer" if self.kind == "phase-kill" else "soak"

    def describe(self) -> str:
        what = {"preempt": f"preempt 1 node, grace {self.grace_s:g} s",
                "grant": "grant 1 node", "lose": "lose 1 node (settled)",
                "phase-kill": f"a worker dies at {self.phase} of the resize to generation "
                              f"{self.generation}",
                "worker-kill": "SIGKILL a worker (steady training)",
                "resize-kill": "SIGKILL a worker while a migration is open",
                "coordinator-kill": f"SIGKILL the coordinator, restart after "
                                    f"{self.delay_s:g} s",
                "duplicate": "a second coordinator on the live job (must be refused)",
                "full-disk": f"the record's disk full for {self.steps} steps"}[self.kind]
        where = (f"at settled step {self.at_step}" if self.by == "script" else
                 "armed from the start" if self.by == "trainer" else
                 f"{self.at_step} step(s) after the script event before it")
        return f"event {self.index}: {what} ({where})"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "kind": self.kind, "by": self.by,
                               "at_step": self.at_step}
        for key in ("grace_s", "phase", "generation", "delay_s", "steps", "pick"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        return out


@dataclass(frozen=True)
class Schedule:
    """A drawn schedule (see the module doc)."""

    seed: int
    events: tuple[SoakEvent, ...]
    nodes: int
    gpus_per_node: int = GPUS_PER_NODE
    full_disk: bool = True
    notes: tuple[str, ...] = field(default=())

    @property
    def script_events(self) -> tuple[SoakEvent, ...]:
        return tuple(e for e in self.events if e.by == "script")

    @property
    def phase_kills(self) -> tuple[SoakEvent, ...]:
        return tuple(e for e in self.events if e.kind == "phase-kill")

    @property
    def end_step(self) -> int:
        """The settled step training ends at (the script's ``end_step``)."""
        return max((e.at_step for e in self.script_events), default=0) + TAIL_STEPS

    def script(self) -> dict[str, Any]:
        """The local backend's events script (:mod:`slurm_etc.local.script`) of the script
        events: counted in settled steps, training ends ``TAIL_STEPS`` after the last."""
        events: list[dict[str, Any]] = []
        for e in self.script_events:
            ev: dict[str, Any] = {"at_step": e.at_step, e.kind: 1,
                                  "reason": f"soak event {e.index}"}
            if e.kind == "preempt":
                ev["grace_s"] = e.grace_s
            events.append(ev)
        return {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node, "initial_nodes": 1,
                "settled_steps": True, "end_step": self.end_step, "events": events}

    def kill_specs(self) -> str:
        """The phase kills as the kill hook's switch reads them (``;``-separated
        :class:`~slurm_etc.migrate.faults.KillSpec`s), empty when none."""
        return ";".join(f"{e.phase}@,{e.generation}" for e in self.phase_kills)

    def counts(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS}
        for e in self.events:
            out[e.kind] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "end_step": self.end_step, "events": [e.to_json() for e in self.events],
                "notes": list(self.notes)}


def draw_schedule(seed: int, events: int, *, full_disk: bool = True) -> Schedule:
    """The schedule of ``events`` events drawn from ``seed`` (pure: the same arguments give
    the same schedule). ``full_disk``: whether ``full-disk`` events may be drawn (they need
    a filesystem of the soak's own: root's tmpfs); without, that weight goes to none.

    The first event is a grant (the job starts on the anchor alone), the last one a script
    event (training ends a few settled steps after it, so every soak event before it
    happens while the job trains). A script event drawn is a grant while the job is
    expected to hold the anchor alone, a preemption or a loss while it holds
    :data:`MOST_HELD` nodes. Phase kills are armed at generations 1 .. (script events
    + 1), each generation once; a phase kill drawn past them becomes a ``resize-kill``.

    Raises:
        ValueError: ``events`` < 1.
    """
    if events < 1:
        raise ValueError(f"a soak needs at least 1 event, got {events}")
    rng = random.Random(f"slurm-etc soak {seed}")
    drawn = ["grant"] + rng.choices(KINDS, [WEIGHTS[k] for k in KINDS], k=events - 1)
    if not full_disk:  # the same schedule otherwise: a duplicate coordinator in its place
        drawn = ["duplicate" if k == "full-disk" else k for k in drawn]
    if drawn[-1] not in SCRIPT_KINDS:
        drawn[-1] = rng.choice(SCRIPT_KINDS)
    resizes = sum(k in SCRIPT_KINDS for k in drawn) + 1
    free_generations = list(range(1, resizes + 1))
    rng.shuffle(free_generations)
    out: list[SoakEvent] = []
    settled = 0
    held = 1
    for i, kind in enumerate(drawn, start=1):
        # every figure drawn for every event, used or not: an event's kind changes none of
        # the figures drawn after it
        pick, spacing, soak_at = rng.randrange(1 << 16), rng.randint(*SPACING), rng.randint(0, 1)
        grace, phase = rng.choice(GRACES_S), rng.choice(KILL_PHASES)
        delay, full_steps, shrink = rng.choice((0.0, 0.5, 2.0)), rng.randint(2, 6), rng.random()
        if kind in SCRIPT_KINDS:
            if held == 1:
                kind = "grant"
            elif held >= MOST_HELD and kind == "grant":
                kind = "preempt" if shrink < 0.5 else "lose"
            held += 1 if kind == "grant" else -1
            settled += spacing
            out.append(SoakEvent(i, kind, at_step=settled,
                                 grace_s=grace if kind == "preempt" else 0.0, pick=pick))
        elif kind == "phase-kill" and free_generations:
            out.append(SoakEvent(i, kind, phase=phase, generation=free_generations.pop(),
                                 pick=pick))
        else:  # a phase kill past the generations armed: a worker killed during a resize
            kind = "resize-kill" if kind == "phase-kill" else kind
            out.append(SoakEvent(i, kind, at_step=soak_at,
                                 delay_s=delay if kind == "coordinator-kill" else 0.0,
                                 steps=full_steps if kind == "full-disk" else 0, pick=pick))
    notes = () if full_disk else (
        "no full-disk window: it needs a filesystem of the soak's own (a tmpfs: root)",)
    grants = sum(e.kind == "grant" for e in out)
    return Schedule(seed, tuple(out), 1 + grants, full_disk=full_disk, notes=notes)

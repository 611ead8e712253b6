"""What a coordinator restarted on its job's record takes up: the resizes a killed
coordinator saw decided (rolled forward), the events and node request still open, the
live workers of the open generation (reattached), or the first layout started again from
the newest checkpoint, recorded as a rebuild with the steps lost (functions over
:class:`~slurm_etc.coordinator.loop.Coordinator`: see docs/architecture.md)."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from slurm_etc.alloc.topology import Device
from slurm_etc.lifecycle import ResizeOutcome
from slurm_etc.migrate.decision import ABORT, COMMIT
from slurm_etc.protocol.messages import Hello
from slurm_etc.protocol.rendezvous import GenerationKeys, commit_decision
from slurm_etc.store import jobs as record

from . import acting, devices, resume, verdicts
from .backend import RequestNodes, StopWorkers, perform

if TYPE_CHECKING:
    from .loop import Coordinator

logger = logging.getLogger(__name__)


def recover(c: Coordinator) -> None:
    """Resume from the record (a coordinator restarted on the same job and database):
    a migration that was in flight is closed as aborted, once (its workers are
    restarted, nothing of it was committed); events recorded and not handled are
    handled by the first decision; generation numbers and request keys continue after
    the recorded ones (no duplicate request, no generation recorded twice); a node
    request recorded and not yet answered (no grant, no failure) is sent again with its
    own key (a backend that has it does nothing: a Slurm member still pending or running
    is not submitted twice) and the job counts as growing until it is answered. Where
    every worker of the open generation still runs, they are reattached and train on
    from their step (:func:`reattach`); else the first layout is launched again, from
    the newest checkpoint if there is one."""
    rolled = roll_forward(c)
    got = record.recover(c.io.store, c.spec.job_id)
    seed_decisions(c, [t for _f, t in rolled], got.aborted)
    c.phase.event_ids += list(got.pending_events)
    c.request.count = max(c.request.count, got.requests)
    if got.requests:
        resend_open_request(c, got.open_request)
    if got.last_generation >= 0 and reattach(c, got):
        # a worker still in the vote of a resize rolled forward trains in the
        # generation before it until it hears the decision
        c.restart.admit_from = min([c.generation, *(f for f, _t in rolled)])
        return
    if got.last_generation >= 0:
        c.restart.rebuilt_into_next = trained_last(c)
        c.restart.generation = got.last_generation + 1
        c.restart.admit_from = c.restart.generation
        c.resize.last_generation = max(c.resize.last_generation, c.restart.generation)
        logger.warning("coordinator restarted: resuming job %s after generation %d (%d "
                       "events pending, %d migrations aborted); workers start again",
                       c.spec.job_id, got.last_generation, len(got.pending_events),
                       len(got.aborted))


def trained_last(c: Coordinator) -> tuple[int, int] | None:
    """The newest generation that trained a step, and its last step recorded: what a
    restart that finds no worker to reattach starts again from (the way through the
    checkpoint is recorded with the next start, the steps since it lost)."""
    detail = record.job_detail(c.io.store, c.spec.job_id)
    ran = [g for g in detail.generations if g.last_step] if detail else []
    if not ran:
        return None
    g = max(ran, key=lambda g: g.number)
    return g.number, int(g.last_step or 0)


def roll_forward(c: Coordinator) -> list[tuple[int, int]]:
    """Resizes the killed coordinator saw decided commit (:meth:`commit_decided`) and
    did not record committed: recorded so now, the old generation closed, the new one
    opened on the layout recorded with the decision, from the old one's last step (its
    workers train in it: :func:`reattach` takes them up). Returns each one's
    generations (from, to)."""
    detail = record.job_detail(c.io.store, c.spec.job_id)
    if detail is None:
        return []
    # by the generation it opens (the migration's id may not have been written yet when
    # the decision was: a record catching up after a full disk)
    still_open = {m.to_generation: m for m in detail.migrations if m.outcome is None}
    gens = {g.number: g for g in detail.generations}
    rolled = []
    for e in detail.events:
        p = e.payload
        if e.kind != "commit-decided" or not isinstance(p, dict) or \
                p.get("generation") not in still_open:
            continue
        m = still_open.pop(p["generation"])
        old = gens.get(m.from_generation)
        step = max(old.last_step or 0, old.first_step or 0) if old is not None else 0
        c.io.journal.write(record.record_migration_finish, m.id,
                           outcome=ResizeOutcome.COMMITTED)
        if old is not None and old.ended_at is None:
            c.io.journal.write(record.close_generation, c.spec.job_id, old.number,
                               reason="resized (committed before the coordinator's "
                                      "restart)", last_step=old.last_step,
                               last_loss=old.last_loss)
        vranks = {int(v): Device.parse(d) for v, d in p["vranks"].items()}
        c.io.journal.write(record.open_generation, c.spec.job_id, m.to_generation,
                           p["layout"], [int(v) for v in p["ranks"]], vranks,
                           first_step=step)
        logger.warning("coordinator restarted: the resize to generation %d was decided "
                       "commit before the kill: recorded committed (%s from step %d)",
                       m.to_generation, p["layout"], step)
        rolled.append((m.from_generation, m.to_generation))
    return rolled


def seed_decisions(c: Coordinator, committed: Iterable[int],
                   aborted: Iterable[Any]) -> None:
    """This coordinator's store starts empty: the commit decision of each resize the
    restart settled is set again, so that a worker whose vote lost the store finds it
    there once reattached. The aborted ones' generations are remembered: a worker that
    trains in one is not taken up (:func:`admits`)."""
    detail = record.job_detail(c.io.store, c.spec.job_id)
    to_gen = {m.id: m.to_generation for m in detail.migrations} if detail else {}
    c.restart.gave_up = frozenset(to_gen[m] for m in aborted if m in to_gen)
    if c.io.post is None:
        return
    decided = [(g, COMMIT) for g in committed] + [(g, ABORT) for g in c.restart.gave_up]
    for gen, value in decided:
        c.io.post(commit_decision(GenerationKeys(c.spec.job_id, gen).prefix), value)


def reattach(c: Coordinator, got: record.ResumePoint) -> bool:
    """Take up the workers of the killed coordinator: the processes recorded at their
    launch (:func:`.acting.record_launch`) that the backend finds still running, the same ones
    (pid and start time). Where some worker of the open generation is alive: the
    layout, vranks and step come from the record, the workers say Hello again to this
    coordinator (it binds the address they look at, see run.py) and train on from the
    step they are at; nothing is relaunched, no step is trained twice. Its members found
    dead are a loss: their devices count as failed (once held again) and the first
    decision resizes around them, as after a node lost without grace (from a replica,
    or rebuilt from peer copies or a checkpoint, the lost steps trained again). A resize in
    flight at the kill was closed as aborted by the recovery (its commit vote goes
    through the rendezvous store, which died with the coordinator): its joiners that
    live are stopped, and the workers drop its order when they reattach. With no
    worker of the layout alive, or a commit past the open generation recorded and not
    acted on (the workers left the layout the record has), every live one is stopped
    and False is returned: the first layout starts again (from the newest checkpoint).
    A backend that adopts nothing (:class:`BackendDefaults`) reattaches nothing."""
    detail = record.job_detail(c.io.store, c.spec.job_id)
    if detail is None:
        return False
    open_gen = resume.open_generation(detail)
    if open_gen is None:
        return False
    workers = resume.launched(detail.events)
    c.launches.launched_in = {v: w.generation for v, w in workers.items()}
    alive = set(c.io.backend.adopt(list(workers.values())))
    if not alive:
        return False
    got_up = resume.reattach(detail, open_gen, workers, alive)
    if isinstance(got_up, resume.Refuse):
        perform(c.io.backend, StopWorkers(tuple(sorted(alive)), 5.0,
                                          "the layout cannot be reattached whole"))
        logger.warning("coordinator restarted: generation %d cannot be taken up (%s); "
                       "stopping the %d live worker(s) and starting again",
                       got_up.generation,
                       f"none of its vranks {', '.join(map(str, got_up.missing))} alive"
                       if got_up.missing else "its workers moved on past the record",
                       len(alive))
        return False
    gen, members, config = got_up.generation, got_up.layout.devices, got_up.layout.config
    c.holdings = replace(c.holdings, layout=got_up.layout, generation=gen,
                         vranks=got_up.vranks, step=got_up.step, loss=got_up.loss)
    c.resize.last_generation = max(c.resize.last_generation, got.last_generation)
    c.io.channel.generation = gen
    c.restart.reattached = True
    c.phase.trains()  # taken up: a worker of it that never comes back is a loss, not a start
    # joiners of the aborted resize: nothing takes them in
    c.resize.idle = set(got_up.idle)
    live = [v for v in members if v not in got_up.dead]
    acting.await_hello(c, live, gen)
    c.restart.dead_at_reattach = {got_up.vranks[v]: v for v in got_up.dead}
    c.restart.found_dead = got_up.dead
    summary = (f"reattached {len(live)} live worker(s) of generation {gen} "
               f"({config}) at step {c.step}")
    if got_up.dead:
        summary += (f"; vrank(s) {', '.join(map(str, sorted(got_up.dead)))} dead: lost, "
                    "the layout resizes around them")
    eid = c.io.journal.write(record.record_event, c.spec.job_id, "reattach",
                             source="coordinator",
                             key=f"reattach:g{gen}:{os.getpid()}:{time.time():.3f}",
                             payload={"summary": summary, "vranks": live,
                                      "dead": sorted(got_up.dead)})
    c.io.journal.write(record.mark_event_handled, eid, "reattached")
    logger.warning("coordinator restarted: %s (%d events pending, %d migrations aborted)",
                   summary, len(got.pending_events), len(got.aborted))
    return True


def admits(c: Coordinator, hello: Hello) -> bool:
    """Whether the sender of ``hello`` is taken for the vrank it names: one just started
    (``step`` < 0), or one that lost its coordinator and trains in a generation this
    coordinator runs."""
    if verdicts.admits(step=hello.step, trained=hello.trained, gave_up=c.restart.gave_up,
                       admit_from=c.restart.admit_from):
        return True
    if hello.trained in c.restart.gave_up:
        logger.warning("vrank %d trains in generation %d, whose resize the record does "
                       "not hold committed (its commit was not written before the kill): "
                       "not taken up", hello.vrank, hello.trained)
    return False


def resend_open_request(c: Coordinator, request: record.OpenRequest | None) -> None:
    if request is None or request.key != c.request.key:
        return
    key, nodes = request.key, request.nodes
    refusal = verdicts.refuse_restored(c.spec.policy, len(c.io.topology.nodes), nodes)
    if refusal is not None:
        # recorded as answered: no later restart sends it either
        eid = c.io.journal.write(record.record_event, c.spec.job_id, "request-failed",
                                 source="coordinator", key=f"request-refused:{key}",
                                 payload={"request": key, "summary": refusal[:200]})
        c.io.journal.write(record.mark_event_handled, eid, "dropped at a restart")
        logger.warning("coordinator restarted: request %s is still open but %s; dropped",
                       key, refusal)
        return
    c.request.growing = int(nodes)
    logger.warning("coordinator restarted: request %s (%d node(s)) is still open; sent "
                   "again under its own key", key, c.request.growing)
    perform(c.io.backend, RequestNodes(c.request.growing, key,
                                       "open at a coordinator restart"))


def reattached_dead(c: Coordinator) -> None:
    """Members of the reattached layout found dead at the restart, on devices the
    backend holds again: failed now, a loss the next decision resizes around."""
    held = [d for d in c.restart.dead_at_reattach if d in c.held]
    if not held:
        return
    for d in held:
        logger.warning("vrank %d of generation %d was found dead at the restart: %s "
                       "counts as failed", c.restart.dead_at_reattach.pop(d),
                       c.generation, d)
    c.holdings = devices.failed(c.holdings, held, c.io.clock())
    c.launches.exit_failed |= set(held)
    c.phase.dirty = True


def start_again(c: Coordinator, why: str) -> None:
    """The reattached layout's workers are all gone and none came back to this
    coordinator (e.g. blocked in a collective on a dead peer past their reattach
    wait): nothing of their state survives, so the first layout starts again from the
    newest checkpoint, as after a restart that found none alive. The devices failed
    only because their workers died are whole again."""
    gen = c.generation
    logger.warning("%s; starting again", why)
    c.io.journal.write(record.close_generation, c.spec.job_id, gen, reason=why[:250],
                       last_step=c.step, last_loss=c.loss)
    # _start records the way through the checkpoint, with the steps lost
    c.restart.rebuilt_into_next = (gen, c.step)
    whole = c.launches.exit_failed
    c.holdings = replace(c.holdings, layout=None, vranks={}, step=0, loss=None,
                         lost=c.lost - whole, leaving=frozenset(),
                         notices={d: n for d, n in c.notices.items()
                                  if d not in whole})
    c.restart.generation = max(gen, c.resize.last_generation) + 1
    c.resize.last_generation = c.restart.admit_from = c.restart.generation
    # joiners of a resize given up are stopped, not forgotten: the first layout's launch
    # waits for them to end (soak seed 101: launched over one, the job stopped)
    acting.stop_idle(c, "the job starts again")
    c.restart.reattached, c.restart.found_dead = False, frozenset()
    c.launches.exit_failed = set()
    c.restart.dead_at_reattach, c.launches.unjoined = {}, {}
    c.watch.dead_since = None
    c.phase.dirty = True


def record_rebuild(c: Coordinator, gen: int, newest: int | None) -> None:
    """A layout lost whole, started again from the checkpoint of step ``newest`` (None:
    from step 1): the record holds it as a migration into ``gen`` that rebuilt the state
    from the checkpoint, with the steps trained since lost (trained again)."""
    base = newest or 0
    old, last = c.restart.rebuilt_into_next or (gen - 1, base)
    c.restart.rebuilt_into_next = None
    lost = (base + 1, last) if last > base else None
    mid = c.io.journal.write(record.record_migration_start, c.spec.job_id,
                             from_generation=old, to_generation=gen, plan_digest="",
                             moved_bytes=0, kept_bytes=0, lower_bound_bytes=0,
                             messages=0, rounds=0)
    c.io.journal.write(record.record_migration_finish, mid,
                       outcome=ResizeOutcome.COMMITTED, measured_seconds=0.0,
                       lost_steps=lost,
                       rebuilt_from=None if newest is None else "checkpoint")
    if lost is not None:
        logger.warning("steps %d-%d lost with generation %d (%s); training them again",
                       lost[0], lost[1], old, "no checkpoint: from the start"
                       if newest is None else f"rebuilt from the checkpoint of step "
                                              f"{newest}")

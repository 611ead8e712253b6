"""What the coordinator does about a decision: launch the first layout, order a resize
(record it, launch its joiners, order the old layout once they are ready), settle it from
its commit vote and the workers' answers, and carry out a settled resize's effects, record
first (functions over :class:`~slurm_etc.coordinator.loop.Coordinator`: see
docs/architecture.md)."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from slurm_etc.alloc.topology import Device, format_devices
from slurm_etc.lifecycle import ResizeOutcome
from slurm_etc.migrate.decision import ABORT
from slurm_etc.plan import Layout, Topology
from slurm_etc.policy.decide import ResizeDecision
from slurm_etc.protocol.env import GPUS_PER_NODE, LAYOUT, REATTACH_WAIT, TIMEOUT
from slurm_etc.protocol.messages import ENCODER, Abort, format_layout
from slurm_etc.protocol.recovery import RESUME_FROM, newest_checkpoint
from slurm_etc.protocol.rendezvous import GenerationKeys, commit_decision
from slurm_etc.store import jobs as record

from . import deciding, observe, reconcile, restart
from .backend import LaunchWorkers, StopWorkers, WorkerSpec, perform
from .reconcile import InflightResize, JobStopped

if TYPE_CHECKING:
    from .loop import Coordinator

logger = logging.getLogger(__name__)


def worker_env(c: Coordinator) -> dict[str, str]:
    return {**c.spec.env, **c.spec.recovery.env(), **c.io.channel.worker_env(),
            GPUS_PER_NODE: str(c.io.topology.gpus_per_node),
            TIMEOUT: str(c.spec.worker_timeout_s),
            REATTACH_WAIT: str(c.spec.reattach_wait_s)}


def start(c: Coordinator, action: ResizeDecision) -> None:
    from slurm_etc.alloc.vranks import identity_layout

    layout = identity_layout(action.config, action.allocation.pool)
    gen = c.restart.generation
    c.holdings = replace(c.holdings, layout=layout, generation=gen,
                         vranks=dict(action.allocation.vranks))
    c.io.channel.generation = gen
    workers = tuple(WorkerSpec(v, c.vranks[v]) for v in layout.devices)
    env = {**worker_env(c), LAYOUT: format_layout(layout)}
    # The first layout trains on from the newest complete checkpoint (after a restart
    # that found no whole layout alive to reattach, nothing else holds the state): every
    # worker loads the same one, and no step below it is trained or written again.
    # (a directory without --checkpoint-every: where peer copies that do not fit host
    # memory fall back to periodic checkpoints)
    where = c.spec.recovery.checkpoint_dir
    newest = newest_checkpoint(where)
    if where is not None and newest is not None:
        env[RESUME_FROM] = os.path.join(where, f"step-{newest}")
        c.holdings = replace(c.holdings, step=max(c.step, newest))
        logger.warning("generation %d resumes from the checkpoint of step %d (%s)", gen,
                       newest, env[RESUME_FROM])
    # recorded before the launch (record, then act): a coordinator killed after it finds
    # the generation without all its workers alive and starts the layout again (reattach())
    c.io.journal.write(record.open_generation, c.spec.job_id, gen, str(layout.config),
                       layout.devices, c.vranks, first_step=c.step)
    if c.restart.rebuilt_into_next is not None:
        restart.record_rebuild(c, gen, newest)
    clear_leaving(c, {w.vrank: w.device for w in workers})
    perform(c.io.backend, LaunchWorkers(gen, workers, c.spec.argv, env))
    record_launch(c, gen, layout.devices)
    c.phase.started()
    await_hello(c, layout.devices, gen)
    logger.info("generation %d: %s on vranks %s", gen, layout.config, list(layout.devices))


def clear_leaving(c: Coordinator, launches: Mapping[int, Device]) -> None:
    """Processes that left the job at the last commit and are still exiting (tearing
    their groups down) where ``launches`` (vrank -> device) start new ones, under the
    same vrank or on the same device: they have nothing left to do and stop; the
    backend's launch waits for them to end (else it takes the launch for a retry of that
    process and starts nothing, or refuses a device another vrank runs on: soak seed
    107, a shrink onto the device a leaving vrank still ran on stopped the job)."""
    if not c.leaving or not launches:
        return
    where = {v: w.device for v, w in c.io.backend.workers().items()
             if v in c.leaving and w.running}
    taken = set(launches.values())
    stop = {v for v in c.leaving if v in launches or where.get(v) in taken}
    if stop:
        perform(c.io.backend, StopWorkers(tuple(sorted(stop)), 2.0,
                                          "its vrank or device joins again"))
        c.holdings = replace(c.holdings, leaving=c.leaving - stop)


def resize(c: Coordinator, action: ResizeDecision) -> None:
    decided_at = time.time()  # wall clock, as the workers' step times
    if c.layout is None:
        return
    old = c.layout
    if all(c.vranks[v] in c.lost for v in old.devices):
        none_left(c, old)
        return
    gen = max(c.generation, c.resize.last_generation) + 1
    got = reconcile.order_resize(
        c.holdings, job_id=c.spec.job_id, generation=gen, config=action.config,
        pool=action.allocation.vranks, deadline=action.deadline, reason=action.reason,
        now=c.io.clock(), model=c.spec.job.model,
        topology=Topology(c.io.topology.gpus_per_node, c.spec.hardware.intra_node_gbps,
                          c.spec.hardware.inter_node_gbps),
        gpus_per_node=c.io.topology.gpus_per_node,
        can_rebuild=c.spec.recovery.enabled,
        prepare_while_training=c.spec.prepare_while_training,
        longest_aside_s=c.resize.aside_preparation_s,
        first_aside_grace_s=c.spec.prepare_aside_min_grace_s, step_s=c.watch.step_s)
    order, plan, lost = got.order, got.plan, got.order.lost
    if got.rebuild:
        logger.warning("devices %s failed holding state no replica holds: rebuilding it "
                       "from peer copies or the last checkpoint (the steps since are "
                       "lost and trained again)", format_devices(c.vranks[v] for v in lost))
    c.resize.last_generation = gen
    new = plan.new
    joiners, vranks = set(got.joiners), dict(got.vranks)
    # joiners of an aborted resize stop; the retry starts its joiners afresh
    stop_idle(c, "resize retried")
    left = got.grace_left
    if c.spec.prepare_while_training and not order.prepare_while_training and not lost:
        logger.info("generation %d: %.1f s of grace left (< %.1f s): the old layout "
                    "prepares at full speed, not beside training", gen, left,
                    got.aside_needs)
    if left is not None and not lost and plan.est_seconds > left:
        logger.warning("the migration's estimate (%.1f s) exceeds the %.1f s of grace left",
                       plan.est_seconds, left)
    mid = c.io.journal.write(
        record.record_migration_start, c.spec.job_id, from_generation=c.generation,
        to_generation=gen, plan_digest=order.plan_digest, moved_bytes=plan.moved_bytes,
        kept_bytes=plan.kept_bytes, lower_bound_bytes=plan.lower_bound_moved_bytes,
        messages=len(plan.messages), rounds=plan.rounds,
        estimated_seconds=plan.est_seconds)
    c.resize.inflight = InflightResize(order, plan, mid, got.participants, got.joiners,
                                       got.vranks, frozenset(c.resize.release_later),
                                       time.monotonic(),
                                       stayers=frozenset(set(old.devices) - set(lost)),
                                       rebuild=got.rebuild, decided_at=decided_at,
                                       step_at_launch=c.step)
    c.io.channel.generation = gen
    clear_leaving(c, {v: vranks[v] for v in joiners})
    if joiners:
        workers = tuple(WorkerSpec(v, vranks[v]) for v in sorted(joiners))
        perform(c.io.backend, LaunchWorkers(gen, workers, c.spec.argv,
                                            worker_env(c)))
        record_launch(c, gen, joiners)
        await_hello(c, joiners, gen)
    # The old layout is ordered (and pauses at its next step boundary) only once every
    # joiner said Ready: it trains on while they import torch and megatron-core and
    # warm up (seconds on a busy node), and a joiner that never gets ready (a script
    # that does not end in run_worker, a crash at import) pauses nobody.
    order_when_joined(c)
    c.io.crash("after-order")
    logger.info("generation %d: resize %s -> %s (%s), moving %.1f MiB (lower bound "
                "%.1f MiB) in %d messages, %d rounds", gen, old.config, new.config,
                action.reason, plan.moved_bytes / 2**20,
                plan.lower_bound_moved_bytes / 2**20, len(plan.messages), plan.rounds)


def none_left(c: Coordinator, old: Layout) -> None:
    """Every vrank of the layout is lost (with its peer copies): no resize can move
    anything, nobody is left to publish the layout's catalog to joiners. The first
    layout starts again from the newest checkpoint; without one the state is gone and
    the job stops with one line (soak seed 101: a rebuild ordered to joiners alone
    waited for the dead)."""
    devices_text = format_devices(c.vranks[v] for v in old.devices)
    newest = newest_checkpoint(c.spec.recovery.checkpoint_dir)
    if newest is None:
        raise JobStopped(f"every device of generation {c.generation} is lost "
                         f"({devices_text}) and no checkpoint holds its state: nothing "
                         "is left to train on (periodic checkpoints: slurm-etc run "
                         "--checkpoint-every M --checkpoint-dir D)")
    restart.start_again(c, f"every device of generation {c.generation} is lost "
                        f"({devices_text}): the first layout again, from the checkpoint "
                        f"of step {newest}")


def order_stayers(c: Coordinator) -> None:
    """Send the order to the workers of the old layout (the pause starts at their next
    step boundary): to a few (:func:`reconcile.first_told`; the step's collectives give it
    to the rest), to all where it names the dead or none of the few was reached."""
    fl = c.resize.inflight
    assert fl is not None
    to = set(reconcile.first_told(fl))
    missed = set(c.io.channel.broadcast(fl.order, to))
    if missed >= to and to != set(fl.stayers):
        to = set(fl.stayers)
        missed = set(c.io.channel.broadcast(fl.order, to - missed)) | missed
    fl = reconcile.ordered(fl, to - missed, time.monotonic())
    c.resize.inflight = fl
    if fl.order.lost and c.io.post is not None:
        # the survivors wait at a step boundary for votes the dead never give: the
        # order in the store ends that wait the moment it is there
        c.io.post(GenerationKeys(c.spec.job_id, c.generation).lost,
                  ENCODER.encode(fl.order))
    if fl.joiners:
        logger.info("generation %d: old layout ordered %.2f s after the joiners' launch, "
                    "steps %d..%d trained meanwhile", fl.order.generation,
                    fl.sent_at - fl.started, fl.step_at_launch, c.step)
    if c.watch.noticed_at is not None:
        c.watch.reaction_s.append(time.perf_counter() - c.watch.noticed_at)
        c.watch.noticed_at = None


def record_launch(c: Coordinator, generation: int, vranks: Iterable[int]) -> None:
    """Record each launched worker's process (pid and start time, as the backend knows
    them): a coordinator restarted on this record finds those still alive and
    reattaches them (:func:`.restart.reattach`)."""
    vranks = sorted(vranks)
    c.launches.launched_in.update((v, generation) for v in vranks)
    workers = c.io.backend.workers()
    launched = [w for w in (workers.get(v) for v in vranks)
                if w is not None and w.generation == generation]
    if not launched:
        return
    # one transaction for the whole launch (thousands of workers), one to close them
    ids = c.io.journal.write(record.record_observed, c.spec.job_id, [
        record.Observed("launch", f"launch:g{generation}:v{w.vrank}:{w.pid}:{w.start}",
                        {"summary": f"vrank {w.vrank} on {w.device}: pid {w.pid}",
                         "vrank": w.vrank, "generation": generation,
                         "device": str(w.device), "pid": w.pid, "start": w.start})
        for w in launched], source="coordinator")
    c.io.journal.write(record.mark_events_handled, ids if isinstance(ids, list) else [ids],
                       "launched")


def await_hello(c: Coordinator, vranks: Iterable[int], generation: int) -> None:
    """The launched vranks wait for their Hello, in launch order (the oldest first: the
    order :func:`.reconcile.late_to_join` reads them in)."""
    now = time.monotonic()
    for v in vranks:
        c.launches.unjoined.pop(v, None)  # launched again: it goes to the end
        c.launches.unjoined[v] = (generation, now)


def order_when_joined(c: Coordinator) -> None:
    """Order the old layout once every joiner of the resize in flight said Ready."""
    if reconcile.may_order(c.resize.inflight, c.spec.order_after_joined):
        order_stayers(c)


def tell_joiner(c: Coordinator, vrank: int) -> None:
    """A worker said hello: it gets the resize in flight if it has not had it — a joiner,
    or a worker of the old layout still starting when the order went out (on Slurm a
    member can be granted before the first layout's processes finished importing)."""
    fl = c.resize.inflight
    if fl is not None and reconcile.owes_order(fl, vrank) and \
            c.io.channel.send(vrank, fl.order):
        c.resize.inflight = reconcile.told(fl, vrank)


def settle(c: Coordinator) -> None:
    fl = c.resize.inflight
    assert fl is not None
    if c.resize.commit_heard == fl.order.generation and not fl.decided:
        c.resize.inflight = fl = reconcile.decided_commit(fl)
    if c.resize.agreed_heard == fl.order.generation and not fl.agreed:
        c.resize.inflight = fl = reconcile.agreed(fl)
    now = time.monotonic()
    settled = reconcile.settle(fl, now, c.spec.worker_timeout_s)
    if settled.resend:
        c.io.channel.broadcast(fl.order, set(settled.resend))
        c.resize.inflight = fl = reconcile.resent(fl, now)
    outcome = settled.outcome
    if isinstance(outcome, reconcile.CloseVote):
        outcome = close_vote(c, fl, outcome)
    if isinstance(outcome, reconcile.Wait | reconcile.CloseVote):
        return
    wall = now - fl.started
    if isinstance(outcome, reconcile.Abort):
        aborted(c, fl, wall, outcome)
        return
    pause, lost_steps = outcome.pause_s, outcome.lost_steps
    c.resize.aside_preparation_s = reconcile.longest_aside(
        c.resize.aside_preparation_s, fl, now,
        pause)
    after, effects = reconcile.commit(c.holdings, fl, outcome, wall)
    observe.flush_late(c)
    c.resize.late = reconcile.late_answers(fl, outcome)
    if lost_steps is not None:  # rolled back: the steps after the copy are trained again
        logger.warning("steps %d-%d lost with devices %s (rebuilt from %s of step %d); "
                       "training them again", lost_steps[0], lost_steps[1],
                       format_devices(fl.vranks[v] for v in fl.order.lost),
                       outcome.rebuilt_from, lost_steps[0] - 1)
    for effect in effects:
        if isinstance(effect, reconcile.ReleaseLater):  # what is held changes first
            c.holdings = after
            c.phase.trains()
            c.resize.times.append(c.io.clock())
            c.resize.inflight = None
            if c.watch.noticed_at is not None:  # a notice that came meanwhile waited
                c.watch.noticed_at = time.perf_counter()
        perform_effect(c, effect)
    new = fl.order.new.layout()
    for report in fl.early:
        observe.progress(c, report)
    observe.record_pauses(c, c.watch.pauses.committed(c.generation, fl.migration_id,
                                                      new.devices, fl.decided_at))
    observe.report_step(c, c.step)
    c.phase.dirty = True
    logger.info("generation %d committed: %s on vranks %s, pause %.3f s, resize %.2f s",
                c.generation, new.config, list(new.devices), pause, wall)


def close_vote(c: Coordinator, fl: InflightResize, close: reconcile.CloseVote
               ) -> reconcile.Wait | reconcile.Abort:
    """A participant died: the commit vote closed as abort where no rank decided it
    (an abort, decided again without the dead at once: the survivors wait for that
    order only their own timeout), else waited out (it holds commit: the survivors
    install the new layout and the dead is a loss of it)."""
    key = commit_decision(GenerationKeys(c.spec.job_id, fl.order.generation).prefix)
    held = c.io.close_vote(key) if c.io.close_vote is not None else b""
    if held != ABORT:
        c.resize.inflight = reconcile.vote_looked_at(fl)
        return reconcile.Wait()
    # every live participant: the old layout's ranks not told learned the order from the
    # told at a step's decision (a worker that has not taken the order up yet drops it)
    told = (set(fl.told) | set(fl.stayers)) - set(fl.dead)
    if told:
        c.io.channel.broadcast(Abort(c.spec.job_id, fl.order.generation, close.why),
                               told)
    return reconcile.Abort(close.why, retry=True)


def perform_effect(c: Coordinator, effect: reconcile.Effect) -> None:
    """Carry out one effect of a reconcile decision (records through the journal;
    a coordinator killed after one resumes from the record)."""
    job = c.spec.job_id
    match effect:
        case reconcile.RecordFinish():
            c.io.journal.write(record.record_migration_finish, effect.migration_id,
                               outcome=effect.outcome,
                               measured_seconds=effect.measured_seconds,
                               pause_seconds=effect.pause_seconds, error=effect.error,
                               lost_steps=effect.lost_steps,
                               rebuilt_from=effect.rebuilt_from,
                               data_seconds=effect.data_seconds)
            if effect.outcome == ResizeOutcome.COMMITTED:
                c.io.crash("after-commit-record")
        case reconcile.CloseGeneration():
            c.io.journal.write(record.close_generation, job, effect.generation,
                               reason=effect.reason, last_step=effect.last_step,
                               last_loss=effect.last_loss)
        case reconcile.OpenGeneration():
            c.io.journal.write(record.open_generation, job, effect.generation,
                               str(effect.layout.config), effect.layout.devices,
                               effect.vranks, first_step=effect.first_step)
        case reconcile.ReleaseLater():
            c.resize.release_later |= effect.devices
            deciding.release_now(c)
        case reconcile.StopIdle():
            stop_idle(c, effect.why)
        case reconcile.NeverJoined():
            observe.silent(c, effect.vranks, effect.what)
        case reconcile.NeverReady():
            observe.never_ready(c, effect.whys)
        case reconcile.Supersede():
            supersede(c, effect.why)


def finished_first(c: Coordinator, fl: InflightResize) -> None:
    """Training ended before the old layout took up the resize in flight: it is moot."""
    perform_effect(c, reconcile.RecordFinish(fl.migration_id, ResizeOutcome.ABORTED,
                                             time.monotonic() - fl.started,
                                             error="training finished before the resize began"))
    perform(c.io.backend, StopWorkers(tuple(sorted(fl.joiners)), 5.0, "training finished"))
    c.resize.inflight = None


def aborted(c: Coordinator, fl: InflightResize, wall: float,
            abort: reconcile.Abort) -> None:
    """Record the abort, keep the old layout, and decide again (``abort.retry``) or
    stop the job (reconcile.settle's rules)."""
    logger.error("resize to generation %d aborted: %s", fl.order.generation, abort.why)
    c.resize.inflight = None
    c.resize.idle = {v for v in fl.joiners - fl.dead}
    for effect in reconcile.abort(fl, abort, wall):
        perform_effect(c, effect)
    if not abort.retry:
        raise JobStopped(f"resize to generation {fl.order.generation} aborted: {abort.why}")
    logger.info("retrying without the dead: vrank(s) %s",
                ", ".join(str(v) for v in sorted(fl.dead)))
    c.phase.dirty = True


def stop_idle(c: Coordinator, why: str) -> None:
    if c.resize.idle:
        perform(c.io.backend, StopWorkers(tuple(sorted(c.resize.idle)), 5.0, why))
    c.resize.idle = set()


def supersede(c: Coordinator, why: str) -> None:
    """Give up the grow in flight whose joiners warm up (its end already recorded)."""
    fl = c.resize.inflight
    assert fl is not None
    logger.warning("resize to generation %d: %s", fl.order.generation, why)
    for v in fl.joiners:
        c.launches.unjoined.pop(v, None)
    # stopped by the next decision (or its resize, before it launches its own joiners)
    c.resize.idle = set(fl.joiners - fl.dead)
    c.resize.inflight = None
    c.phase.dirty = True

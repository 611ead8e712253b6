"""When and what the coordinator decides: record, then act (no decision while the record
is behind), the policy's decision over a snapshot of the job and what it says to do with
node requests, releases and pauses, the anchor's devices used again, and whether a job with
nothing training has anything left to wait for (functions over
:class:`~slurm_etc.coordinator.loop.Coordinator`: see docs/architecture.md)."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from slurm_etc.alloc.topology import Device, format_devices
from slurm_etc.lifecycle import JobState
from slurm_etc.policy.decide import (
    JobView,
    Notice,
    Pause,
    Release,
    RequestGrow,
    ResizeDecision,
    WithdrawRequest,
    decide,
)
from slurm_etc.protocol.messages import Stop
from slurm_etc.protocol.recovery import newest_checkpoint
from slurm_etc.store import jobs as record

from . import acting, devices, outlook, restart, verdicts
from .backend import CancelRequest, ReleaseDevices, RequestNodes, perform
from .job import Life

if TYPE_CHECKING:
    from .loop import Coordinator

logger = logging.getLogger(__name__)

# Every worker of the layout gone and nothing pending for this long: the job has failed.
DEAD_GRACE_S = 1.0
# said once when a decision waits for the record to catch up (record, then act)
HELD_FOR_RECORD = "decisions wait for the job record"
# The partition's usable nodes are read again at a decision this long after the last read
# (at once after a loss): one sinfo a minute at most, while a node DOWN that this job does
# not hold raises no event.
PARTITION_REREAD_S = 60.0
# How often the loop asks whether a job with nothing training has anything to wait for.
OUTLOOK_EVERY_S = 1.0


def record_holds(c: Coordinator) -> bool:
    """Whether the record holds everything so far, so that a decision may act (record,
    then act). While a full disk keeps it behind, nothing is launched, resized,
    released or requested: a coordinator killed then would restart on a record that
    does not know what it did (soak seeds 101, 104, 107, 202: workers launched
    unrecorded ran on beside the ones a restart launched again). Training goes on in
    the layout it has; the decision is taken once the record caught up."""
    if not c.io.journal.behind:
        c.phase.held_for_record = False
        return True
    c.io.journal.retry(hurry=True)
    if not c.io.journal.behind:
        c.phase.held_for_record = False
        return True
    if not c.phase.held_for_record:
        c.phase.held_for_record = True
        logger.warning("%s (%d write(s) behind: %s): nothing is launched, resized or "
                       "released that it could not hold; generation %d trains on",
                       HELD_FOR_RECORD, c.io.journal.behind, c.io.journal.last_error,
                       c.generation)
    return False


def nothing_left(c: Coordinator) -> str | None:
    """Why the job cannot go on when every worker of the layout has exited and nothing
    is pending (no resize in flight, no node request open, no event waiting for its
    decision) for DEAD_GRACE_S (a worker's last report may trail its exit); None
    while anything is alive or pending. A vrank the backend never reported is not
    counted as dead. With a checkpoint the first layout starts again from it instead
    (an open node request then waits no longer)."""
    if c.layout is None or c.resize.inflight is not None or c.phase.event_ids:
        c.watch.dead_since = None
        return None
    workers = c.io.backend.workers()
    if verdicts.anyone_left(c.layout, workers, c.restart.found_dead) or (
            # a node request may bring devices; a checkpoint brings the state back now
            # (the directory listed only once every worker is gone)
            c.request.growing and
            newest_checkpoint(c.spec.recovery.checkpoint_dir) is None):
        c.watch.dead_since = None
        return None
    now = time.monotonic()
    if c.watch.dead_since is None:
        c.watch.dead_since = now
    if now - c.watch.dead_since < DEAD_GRACE_S:
        return None
    got = verdicts.none_left(
        generation=c.generation, step=c.step, members=len(c.layout.devices),
        reattached=c.restart.reattached, came_back=c.restart.came_back,
        newest=newest_checkpoint(c.spec.recovery.checkpoint_dir),
        exits=[w for w in map(workers.get, c.layout.devices) if w is not None],
        said=c.launches.exit_said.get(c.generation))
    if isinstance(got, verdicts.Stop):
        return got.line
    restart.start_again(c, got.why)
    return None


def check_outlook(c: Coordinator) -> str | None:
    """Whether a job with nothing training has anything left to wait for (asked every
    OUTLOOK_EVERY_S, :func:`outlook.outlook`): what it waits for, or since when it is
    stranded, goes into the record's reason (``status``) when it changes; the line the
    job fails with once stranded past ``give_up_after_s``, else None."""
    now = time.monotonic()
    if now < c.watch.outlook_at + OUTLOOK_EVERY_S:
        return None
    c.watch.outlook_at = now
    wall = c.io.clock()
    got = outlook.outlook(prospects(c, wall), c.watch.stranded_since, wall,
                          c.spec.give_up_after_s)
    said: str | None
    match got:
        case outlook.GiveUp():
            return got.line
        case outlook.Stranded():
            c.watch.stranded_since = got.since
            said = got.what
        case outlook.Waits():
            c.watch.stranded_since = None
            said = got.what
        case _:
            c.watch.stranded_since = None
            said = None
    if said != c.watch.outlook_said:
        if said is not None:
            logger.warning("job %s: %s", c.spec.job_id, said)
        elif c.watch.outlook_said is not None:
            logger.info("job %s: training again", c.spec.job_id)
        c.watch.outlook_said = said
        c.io.journal.write(record.set_job_state, c.spec.job_id, JobState.RUNNING,
                           reason=None if said is None else said[:250])
    return None


def prospects(c: Coordinator, wall: float) -> outlook.Prospects:
    """What the job could go on with now (the inputs of :func:`outlook.outlook`). A
    layout's worker the backend never reported counts as alive (it may be starting);
    the loop over the layout ends at its first live worker."""
    training = c.layout is not None and verdicts.anyone_left(
        c.layout, c.io.backend.workers(), c.restart.found_dead)
    if training or c.resize.inflight is not None or c.phase.event_ids or \
            c.phase.life is Life.ENDING:
        return outlook.Prospects(busy=True)
    if not c.held:
        why = "the job holds no device"
    elif c.phase.paused is not None:
        why = f"paused: {c.phase.paused}"
    elif c.layout is not None:
        why = f"every worker of generation {c.generation} exited"
    else:
        why = "no layout started on the devices held"
    key = c.request.key
    since = (None if c.request.sent_at is None
             else wall - (time.monotonic() - c.request.sent_at))
    met = c.io.backend.request_can_be_met(key) if c.request.growing else True
    return outlook.Prospects(busy=False, idle_why=why, request_nodes=c.request.growing,
                             request_met=met, request_since=since,
                             request_held=c.io.backend.pending_reasons.get(key) or "")


def snapshot(c: Coordinator) -> JobView:
    layout_vranks = ({v: c.vranks[v] for v in c.layout.devices}
                     if c.layout is not None else {})
    by_deadline: dict[tuple[float, str], set[Device]] = {}
    for d, key in c.notices.items():
        if d in c.held:
            by_deadline.setdefault(key, set()).add(d)
    return JobView(
        now=c.io.clock(), job=c.spec.job, hardware=c.spec.hardware,
        topology=c.io.topology, held=frozenset(c.held), layout=c.layout,
        vranks=layout_vranks,
        notices=tuple(Notice(frozenset(ds), deadline, cause)
                      for (deadline, cause), ds in sorted(by_deadline.items())),
        resizes=tuple(c.resize.times), growing=c.request.growing,
        pinned=frozenset(c.launches.pinned), partition_nodes=partition_nodes(c),
        request_age_s=(None if not c.request.growing or c.request.sent_at is None
                       else time.monotonic() - c.request.sent_at))


def partition_nodes(c: Coordinator) -> int:
    """The nodes this job can hold now: re-read through the backend (``usable_nodes``:
    the Slurm backend counts those not DOWN/DRAIN, with the job's own) after a loss was
    observed and otherwise at most every PARTITION_REREAD_S, since nodes of the
    partition that go down later raise no event of this job; the last count where the
    backend cannot say (a scripted cluster: all of its nodes)."""
    reread_partition(c)
    return c.request.partition_nodes


def reread_partition(c: Coordinator) -> bool:
    """Ask the backend for the count when it is due; True when it gave one (None: it
    cannot say, now or ever, and the last count stays)."""
    now = time.monotonic()
    if not (c.request.partition_stale or c.request.partition_read_at is None
            or now >= c.request.partition_read_at + PARTITION_REREAD_S):
        return False
    c.request.partition_read_at, c.request.partition_stale = now, False
    count = c.io.backend.usable_nodes()
    if count is not None and count != c.request.partition_nodes:
        logger.info("the partition has %d usable node(s) for this job (was %d)",
                    count, c.request.partition_nodes)
        c.request.partition_nodes = count
    return count is not None


def request_overdue(c: Coordinator) -> bool:
    """Decide again about the pending request: it waited past the policy's patience
    (once a minute at most), or a fresh count of the partition's usable nodes (at most
    every PARTITION_REREAD_S) no longer meets it. Either way it may be withdrawn and
    asked again smaller."""
    if not c.request.growing or c.request.sent_at is None:
        return False
    now = time.monotonic()
    usable = c.request.partition_nodes if reread_partition(c) else None
    why = verdicts.request_overdue(
        nodes=c.request.growing, usable_nodes=usable,
        keeps=len({d.node for d in c.held if d not in c.resize.release_later}),
        age_s=now - c.request.sent_at, patience_s=c.spec.policy.patience_s,
        since_last_look_s=now - c.request.overdue_checked)
    if why == verdicts.PAST_PATIENCE:
        c.request.overdue_checked = now
    return why is not None


def decide_now(c: Coordinator) -> None:
    c.phase.dirty = False
    if c.phase.event_ids:
        c.io.crash("after-record")
    if not c.held:
        return
    if not c.known.complete and c.layout is not None:
        c.phase.dirty = True  # decided once the workers said their model (model_built())
        return
    decision = decide(snapshot(c), c.spec.policy)
    if any(isinstance(a, Pause) for a in decision.actions) and not any(
            isinstance(a, ResizeDecision) for a in decision.actions) and \
            reuse_anchor(c):
        decision = decide(snapshot(c), c.spec.policy)
    was_paused, c.phase.paused = c.phase.paused, None
    text = " | ".join(decision.lines())
    if text != c.phase.reason:
        c.phase.reason = text
        for line in decision.lines():
            logger.info("decision: %s", line)
    for action in decision.actions:
        match action:
            case ResizeDecision():
                if c.layout is None:
                    acting.start(c, action)
                elif c.step < 1 and not action.forced:
                    # the optimizer has no state to move before the first step: a grant
                    # that came while the first workers were starting waits for it
                    c.phase.dirty_at_first_step = True
                else:
                    acting.resize(c, action)
            case Release():
                c.resize.release_later |= set(action.devices)
            case WithdrawRequest():
                if c.request.growing:
                    # recorded before it is withdrawn: a coordinator killed between the two
                    # does not send it again at its restart (it is answered)
                    key = c.request.key
                    eid = c.io.journal.write(
                        record.record_event, c.spec.job_id, "request-withdrawn",
                        source="coordinator", key=f"withdraw:{key}",
                        payload={"nodes": action.nodes, "request": key,
                                 "summary": action.reason[:200]})
                    perform(c.io.backend, CancelRequest(key, action.reason))
                    c.request.growing, c.request.sent_at = 0, None
                    c.io.journal.write(record.mark_event_handled, eid, "withdrawn")
            case RequestGrow():
                if not c.request.growing:
                    c.request.count += 1
                    c.request.growing = action.nodes
                    request = RequestNodes(action.nodes, c.request.key,
                                           action.reason)
                    # recorded before it is sent: a restarted coordinator's keys
                    # continue after it (a duplicate key would be the same request)
                    eid = c.io.journal.write(
                        record.record_event, c.spec.job_id, "request", source="coordinator",
                        key=f"request:{request.key}",
                        payload={"nodes": request.nodes, "summary": request.reason[:200]})
                    perform(c.io.backend, request)
                    c.request.sent_at = time.monotonic()
                    c.io.crash("after-request")
                    c.io.journal.write(record.mark_event_handled, eid, "sent")
            case Pause():
                if was_paused != action.reason:  # said once, not at every decision
                    logger.warning("paused: %s", action.reason)
                c.phase.paused = action.reason
    if c.resize.inflight is None:
        acting.stop_idle(c, "no resize takes them in")
        release_now(c)
    c.io.journal.write(record.mark_events_handled, list(c.phase.event_ids),
                       decision.reason[:200])
    c.phase.event_ids.clear()


def reuse_anchor(c: Coordinator) -> bool:
    """Nothing fits the usable devices: the anchor's devices whose workers died (their
    process, not a loss the backend reported: the anchor is the job's own allocation and
    its node is up) are used again, each at most :data:`verdicts.MAX_REUSES` times (a device
    whose workers keep dying stays out). Whether any was."""
    in_layout = ({c.vranks[v] for v in c.layout.devices}
                 if c.layout is not None else set())
    # a device of the layout stays its dead vrank's (whose state is gone) until a
    # resize or a start again moves the layout off it
    again = verdicts.anchor_again(c.launches.pinned, c.launches.exit_failed,
                                  in_layout, c.launches.reused)
    if not again or c.launches.anchor_allocation is None:
        return False
    c.launches.reused.update(again)
    c.launches.exit_failed -= set(again)
    c.holdings = devices.grant(c.holdings, again, c.launches.anchor_allocation)
    logger.warning("nothing fits the usable devices: the anchor's %s, whose workers died, "
                   "are used again (at most %d times each)", format_devices(again),
                   verdicts.MAX_REUSES)
    return True


def release_now(c: Coordinator) -> None:
    if c.io.journal.behind:  # record, then act: given back once the record holds it
        c.phase.dirty = True
        return
    free = devices.to_release(c.holdings, c.resize.release_later, c.launches.pinned)
    c.resize.release_later.clear()
    if not free:
        return
    # recorded before the backend gives them back: a coordinator killed between the two
    # is told by its backend what the job still holds (a grant), never the reverse
    c.io.journal.write(record.set_device_state, c.spec.job_id, sorted(free), "released")
    perform(c.io.backend, ReleaseDevices(tuple(sorted(free)), "not in the layout"))
    c.holdings = devices.released(c.holdings, free)


def stop_training(c: Coordinator) -> None:
    """The backend ended training and no resize is in flight: Stop the layout's
    workers (once); each finishes its step and exits, and the job ends finished when
    all have (as at ``train_steps``)."""
    if c.phase.stop_sent or c.layout is None:
        return
    c.phase.stop_sent = True
    live = set(c.layout.devices) - c.launches.done
    logger.info("job %s: training ends at the backend's word (%s)", c.spec.job_id,
                c.phase.why)
    c.io.channel.broadcast(Stop(c.spec.job_id, c._stop_generation,
                                c.phase.why or ""), live)

"""What the coordinator hears: the backend's events (grants, notices, losses, failed
requests, worker exits: recorded in one transaction a poll, before any is acted on) and the
workers' reports on the control channel (progress, resize answers, pauses, exits, the model
they built, Hello, Ready), and the workers that never join (functions over
:class:`~slurm_etc.coordinator.loop.Coordinator`: see docs/architecture.md)."""
from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from slurm_etc.alloc.topology import Device
from slurm_etc.lifecycle import JobState, ProcessOutcome
from slurm_etc.protocol.messages import (
    CopiesChosen,
    Exited,
    Hello,
    ModelBuilt,
    ModelReport,
    Progress,
    Ready,
    Resized,
    Resumed,
)
from slurm_etc.store import jobs as record
from slurm_etc.store.jobs import PEER_COPIES_EVENT

from . import acting, devices, job_model, reconcile, restart, verdicts
from .backend import (
    EndTraining,
    Grant,
    Loss,
    PreemptNotice,
    RequestFailed,
    StopWorkers,
    WorkerExited,
    perform,
)
from .job import Life
from .pause import MeasuredPause

if TYPE_CHECKING:
    from .loop import Coordinator

logger = logging.getLogger(__name__)

POLL_S = 0.02


def observe_backend(c: Coordinator) -> None:
    """Take in the backend's events: each changes what the job holds at once; one poll's
    events are recorded in one transaction (a burst of a thousand node events is one
    commit), before any of them is acted on (:func:`.deciding.decide_now`)."""
    seen: list[record.Observed] = []
    for event in c.io.backend.poll():
        if isinstance(event, EndTraining):
            c.phase.end_training(event.reason)
            continue  # the job's end says it (nothing for a decision)
        if stale_exit(c, event):
            continue
        heard = backend_event(c, event, c.io.clock())
        if heard is not None:
            seen.append(heard)
        c.phase.dirty = True
    if c.restart.dead_at_reattach:
        restart.reattached_dead(c)
    if any(o.kind in ("preempt-notice", "loss") for o in seen):
        for effect in reconcile.supersede(c.resize.inflight, time.monotonic()):
            acting.perform_effect(c, effect)
    if seen:
        c.io.crash("before-record")
        ids = c.io.journal.write(record.record_observed, c.spec.job_id, seen)
        c.phase.event_ids += ids if isinstance(ids, list) else [ids]  # or a Deferred
        for o in seen:
            logger.info("event: %s %s", o.kind, o.payload["summary"])


def backend_event(c: Coordinator, event: Any, now: float) -> record.Observed | None:
    """What one backend event changes, and what of it is recorded (None: nothing)."""
    match event:
        case Grant():
            c.holdings = devices.grant(c.holdings, event.devices, event.allocation)
            if not c.launches.pinned and event.request is None and (
                    c.layout is None or c.restart.reattached):
                c.launches.pinned = set(event.devices)  # the anchor
                c.launches.anchor_allocation = event.allocation
            if event.request == c.request.key:
                c.request.growing = 0  # the current request is met (not an older one a
                # restarted backend announces again with what it holds)
            role = "anchor" if set(event.devices) <= c.launches.pinned else "member"
            return observed(c, "grant", event, f"{len(event.devices)} devices "
                            f"({', '.join(event.nodes)})", state="granted", role=role)
        case PreemptNotice():
            c.holdings = devices.notice(c.holdings, event.devices, event.deadline)
            c.watch.noticed_at = time.perf_counter()
            return observed(c, "preempt-notice", event, f"{len(event.devices)} devices, "
                            f"{event.deadline - now:.0f} s of grace", state="preempting",
                            deadline=event.deadline)
        case Loss():
            c.request.partition_stale = True  # a node DOWN may take others with it
            c.launches.exit_failed -= set(event.devices)  # lost, not only their workers
            c.holdings = devices.loss(c.holdings, event.devices, event.allocation,
                                      event.cause, now)
            lost_in_flight(c, event.devices)
            return observed(c, "loss", event,
                            f"{len(event.devices)} devices ({event.cause})", state="lost")
        case RequestFailed():
            if event.request == c.request.key:
                c.request.growing = 0  # the current request is over: ask again if need be
            return observed(c, "request-failed", event, f"request {event.request} ended "
                            f"without a grant ({event.reason})")
        case WorkerExited():
            return worker_exited(c, event, now)
    return None


def stale_exit(c: Coordinator, event: Any) -> bool:
    """The exit of a process its vrank was launched again after (an idle joiner's, killed):
    not the death of the one that runs now (soak seed 101)."""
    return isinstance(event, WorkerExited) and \
        event.generation < c.launches.launched_in.get(event.vrank, event.generation)


def worker_exited(c: Coordinator, event: WorkerExited, now: float) -> record.Observed | None:
    """A worker process ended: before it joined (:func:`never_joined`), unexplained (its
    device fails: :func:`worker_died`), or as told or done (nothing recorded)."""
    c.resize.idle.discard(event.vrank)
    c.holdings = replace(c.holdings, leaving=c.leaving - {event.vrank})
    if forget_unjoined(c, event.vrank, event.generation) and not event.stopped:
        # any code, 0 included: a script that never calls run_worker
        never_joined(c, event.vrank, event.device, f"exited with {event.returncode}",
                     event.returncode == 0)
        return observed(c, "worker-exit", event, f"vrank {event.vrank} exited with "
                        f"{event.returncode} before joining the job")
    if event.returncode != 0 and not event.stopped and event.vrank not in c.launches.done:
        worker_died(c, event, now)
        return observed(c, "worker-exit", event,
                        f"vrank {event.vrank} exited with {event.returncode}")
    return None


def observed(c: Coordinator, kind: str, event: Any, summary: str, *,
             state: str | None = None,
             role: str = "member", deadline: float | None = None) -> record.Observed:
    devices = [str(d) for d in getattr(event, "devices", ())]
    if isinstance(event, WorkerExited):
        devices = [str(event.device)]
    allocation = getattr(event, "allocation", None)
    payload = {"summary": summary, "allocation": allocation, "devices": devices}
    if isinstance(event, (Grant, RequestFailed)):
        payload["request"] = event.request  # a restart finds requests still open
    return record.Observed(kind, event_key(kind, event), payload, _dt(deadline),
                           allocation if state else None, state, role,
                           getattr(event, "nodes", None) if state else None)


def observe_workers(c: Coordinator) -> None:
    deadline = time.monotonic() + POLL_S
    while (got := c.io.channel.recv(max(0.0, deadline - time.monotonic()))) is not None:
        vrank, report = got
        match report:
            case Progress():
                fl = c.resize.inflight
                if fl is not None and fl.rebuild and \
                        report.generation == fl.order.generation:
                    c.resize.inflight = reconcile.replayed(fl, report)
                elif progress(c, report):
                    return  # the backend heard of the step: its events polled now
            case Resized():
                fl = c.resize.inflight
                if fl and report.generation == fl.order.generation:
                    c.resize.inflight = reconcile.answered(fl, vrank, report)
                    if c.resize.inflight.reports[vrank] is not report:
                        answered_after_commit(vrank, report)
                elif c.resize.late is not None and \
                        report.generation == c.resize.late.generation:
                    late_answer(c, vrank, report)
            case Resumed():
                record_pauses(c, c.watch.pauses.add(report))
            case Exited():
                if report.reason == "done" or (report.reason == "stopped"
                                               and c.phase.stop_sent):
                    c.launches.done.add(vrank)
                elif report.reason not in ("stopped", "left"):
                    c.launches.exit_said.setdefault(report.generation, report.reason)
            case CopiesChosen():
                copies_chosen(c, report)
            case ModelBuilt():
                model_built(c, vrank, report.model)
                chunks_said(c, report.chunks)
            case Hello():
                if c.launches.unjoined.get(vrank, (report.generation + 1,))[0] <= \
                        report.generation:  # not a Hello of a process before it
                    del c.launches.unjoined[vrank]
                    c.restart.came_back = True
                acting.tell_joiner(c, vrank)
                acting.order_when_joined(c)
            case Ready():
                fl = c.resize.inflight
                if fl is not None and report.generation == fl.order.generation and \
                        vrank in fl.joiners:
                    c.resize.inflight = reconcile.became_ready(fl, vrank)
                    logger.info("vrank %d ready for generation %d after %.2f s of warm-up",
                                vrank, report.generation, report.seconds)
                    acting.order_when_joined(c)


def answered_after_commit(vrank: int, report: Resized) -> None:
    logger.error("vrank %d answered %s to generation %d after it committed (%s): its "
                 "commit stands", vrank, report.outcome, report.generation, report.error)


def late_answer(c: Coordinator, vrank: int, report: Resized) -> None:
    """An answer to the resize committed from its decision before it came: the
    longest data phase is recorded once the last came (reconcile.late_answer)."""
    late = c.resize.late
    assert late is not None
    if report.outcome == ProcessOutcome.ABORTED:
        answered_after_commit(vrank, report)
    c.resize.late, longest = reconcile.late_answer(late, report)
    if longest is not None:
        c.io.journal.write(record.record_migration_data, late.migration_id,
                           data_seconds=longest)


def flush_late(c: Coordinator) -> None:
    """Record the longest data phase heard of the last resize committed from its
    decision where it grew and some answers never came (a participant died since)."""
    late, c.resize.late = c.resize.late, None
    if late is not None and late.longest > late.recorded:
        c.io.journal.write(record.record_migration_data, late.migration_id,
                           data_seconds=late.longest)


def copies_chosen(c: Coordinator, got: CopiesChosen) -> None:
    """The workers chose the peer-copy interval ("auto"): said once, and recorded
    (``status`` shows it)."""
    logger.info("job %s: %s", c.spec.job_id, got.line)
    eid = c.io.journal.write(
        record.record_event, c.spec.job_id, PEER_COPIES_EVENT, source="workers",
        key=f"{PEER_COPIES_EVENT}:g{got.generation}",
        payload={"every": got.every, "checkpoint_every": got.checkpoint_every,
                 "copy_seconds": round(got.copy_seconds, 6),
                 "step_seconds": round(got.step_seconds, 6),
                 "held_bytes": got.held_bytes, "host_bytes": got.host_bytes,
                 "generation": got.generation, "line": got.line})
    c.io.journal.write(record.mark_event_handled, eid, "chosen")


def model_built(c: Coordinator, vrank: int, got: ModelReport) -> None:
    """A worker built its model: the job plans with it, or stops (job_model.model_built)."""
    heard = job_model.model_built(c.known, c.spec.job, vrank, got)
    if heard.fatal is not None:
        c.phase.end(JobState.FAILED, heard.fatal)
    elif heard.known is not c.known:
        c.known = heard.known
        c.spec = replace(c.spec, job=heard.job)
        logger.info("planning with the model of vrank %d: %s", vrank,
                    job_model.describe_job(heard.job))
        c.phase.dirty = True


def chunks_said(c: Coordinator, chunks: bool) -> None:
    """A worker's script builds virtual pipeline chunks: vpp layouts may be chosen."""
    job = job_model.chunks_said(c.spec.job, chunks)
    if job is not c.spec.job and c.phase.failed is None:
        c.spec = replace(c.spec, job=job)
        c.phase.dirty = True


def progress(c: Coordinator, report: Progress) -> bool:
    """A step reported: recorded and shown; whether the backend was told of it. A step
    of a layout whose commit is not settled here yet is shown, not the job's step yet
    (the commit's switch step is the old layout's last: soak seed 102)."""
    if report.generation > c.generation:
        show_progress(c, report)
        return False
    if report.step <= c.step:
        return False
    c.holdings = replace(c.holdings, step=report.step, loss=report.loss)
    if report.ended > report.started > 0:
        c.watch.step_s = report.ended - report.started
    if c.phase.dirty_at_first_step:
        c.phase.dirty, c.phase.dirty_at_first_step = True, False
    told = report_step(c, report.step)
    if report.generation == c.generation:  # else not committed yet
        c.io.journal.write(record.record_progress, c.spec.job_id,
                           report.generation, last_step=report.step,
                           last_loss=report.loss)
    show_progress(c, report)
    return told


def show_progress(c: Coordinator, report: Progress) -> None:
    c.io.progress({"step": report.step, "loss": report.loss,
                   "lr": report.lr, "layout": report.layout,
                   "generation": report.generation, "started": report.started,
                   "ended": report.ended})


def record_pauses(c: Coordinator, pauses: list[tuple[Any, MeasuredPause]]) -> None:
    """Write the pauses measured at the step boundaries into their migrations."""
    for mid, p in pauses:
        c.io.journal.write(record.record_migration_pause, mid, pause_seconds=p.seconds,
                           paused_at=datetime.fromtimestamp(p.paused_at, timezone.utc),
                           resumed_at=datetime.fromtimestamp(p.resumed_at, timezone.utc),
                           preparation_seconds=p.preparation_seconds,
                           processes=p.processes, stall_seconds=p.stall_seconds,
                           interrupted_seconds=p.interrupted_seconds)
        stall = (f"; before it, training stopped {p.stall_seconds:.3f} s at one step "
                 f"boundary (vrank {p.stall_vrank}: the new world built)"
                 if p.stall_vrank is not None else "")
        cut = (f" ({p.interrupted_seconds:.3f} s of it the step in flight, lost with the "
               f"node; recovery {p.seconds - p.interrupted_seconds:.3f} s)"
               if p.interrupted_seconds > 0 else "")
        logger.info("migration %s: training paused %.3f s%s (the widest gap between "
                    "steps, vrank %d, over %d processes) after %.2f s of preparation%s",
                    mid, p.seconds, cut, p.vrank, p.processes, p.preparation_seconds,
                    stall)


def report_step(c: Coordinator, step: int) -> bool:
    """Tell the backend the job's step (returns whether it was told), only when settled
    (no resize in flight, no event waiting for a decision): a scripted cluster's next
    group of events then fires after the group before was decided and its resize
    settled, whatever the timing (the
    events script's documented semantics; a loss during a migration is the faults
    issue's case)."""
    if c.resize.inflight is None and not c.phase.event_ids:
        c.io.backend.on_step(step)
        return True
    return False


def worker_died(c: Coordinator, event: WorkerExited, now: float) -> None:
    """A worker of the layout or of the resize in flight died unexplained (no loss, no
    stop): its device counts as failed, as after a loss without notice: the resize in
    flight settles without it, and the next one plans with the surviving devices."""
    fl = c.resize.inflight
    in_layout = c.layout is not None and event.vrank in c.layout.devices
    if fl is not None and event.vrank in fl.participants:
        c.resize.inflight = reconcile.died(fl, event.vrank)
    elif not in_layout:
        return
    c.holdings = devices.failed(c.holdings, [event.device], now)
    c.launches.exit_failed.add(event.device)


def lost_in_flight(c: Coordinator, lost: Iterable[Device]) -> None:
    """Participants of the resize in flight on lost devices are dead to it, as after an
    unexplained death: it settles without them (the survivors' vote is closed, the
    resize retried without them). Their exit is the loss's, not news of its own (soak
    seed 201: a notice of 0.5 s ran out inside the shrink it ordered; the survivors
    waited 120 s for the killed, aborted, and the job stopped)."""
    fl = c.resize.inflight
    if fl is None:
        return
    gone = set(lost)
    dead = [v for v in fl.participants if v not in fl.dead
            and (fl.vranks.get(v) or c.vranks.get(v)) in gone]
    for v in dead:
        fl = reconcile.died(fl, v)
    c.resize.inflight = fl


def forget_unjoined(c: Coordinator, vrank: int, generation: int) -> bool:
    """Whether the process of ``vrank`` launched for ``generation`` ended (or is given
    up) without having said Hello; it is no longer waited for."""
    if c.launches.unjoined.get(vrank, (None,))[0] != generation:
        return False
    del c.launches.unjoined[vrank]
    return True


def never_joined(c: Coordinator, vrank: int, device: Device, what: str,
                 clean: bool) -> None:
    """A worker that never said Hello (it exited, or stayed silent past the join
    timeout). One of the first layout: nothing has trained and nothing would, so the job
    stops with one line saying what to change. A joiner of the resize in flight: it
    counts as dead on a failed device, and the resize, whose old layout is ordered only
    once every joiner said Hello, ends without having paused anyone (see settle())."""
    fl = c.resize.inflight
    in_resize = fl is not None and vrank in fl.participants
    got = verdicts.never_joined(
        vrank, what, clean, first_layout=c.phase.life is Life.STARTING, in_resize=in_resize,
        in_layout=c.layout is not None and vrank in c.layout.devices)
    if got.fatal:
        c.phase.end(JobState.FAILED, got.why)
        return
    if fl is not None and in_resize:
        c.resize.inflight = reconcile.died(fl, vrank, got.why)
    if got.dead:
        c.holdings = devices.failed(c.holdings, [device], c.io.clock())
        c.launches.exit_failed.add(device)


def silent(c: Coordinator, vranks: Iterable[int], what: str) -> None:
    """Launched workers that never said Hello in time: each one still running is
    stopped and handled as one that exited before joining."""
    workers = c.io.backend.workers()
    for v in vranks:
        forget_unjoined(c, v, c.launches.unjoined[v][0])
        w = workers.get(v)
        if w is None:
            continue
        perform(c.io.backend, StopWorkers((v,), 5.0, "it never said hello"))
        never_joined(c, v, w.device, what, False)


def never_ready(c: Coordinator, whys: Mapping[int, str]) -> None:
    """Joiners that said Hello but not Ready in time: stopped, dead on failed devices;
    the resize (its old layout never ordered) is replanned without them (settle())."""
    fl = c.resize.inflight
    assert fl is not None
    perform(c.io.backend, StopWorkers(tuple(sorted(whys)), 5.0, "it was never ready"))
    for v, why in whys.items():
        fl = reconcile.died(fl, v, why)
    c.resize.inflight = fl
    c.holdings = devices.failed(c.holdings, [fl.vranks[v] for v in whys],
                                c.io.clock())


def join_deadlines(c: Coordinator) -> None:
    """Give up the launched workers late past the join timeout (reconcile.overdue)."""
    for effect in reconcile.overdue(c.resize.inflight, c.launches.unjoined,
                                    time.monotonic(),
                                    c.spec.join_timeout_s, c.spec.order_after_joined):
        acting.perform_effect(c, effect)


def event_key(kind: str, event: Any) -> str:
    """An event's identity in the record: the same event reported again (a restarted
    coordinator's backend re-reads what it holds) is recorded once."""
    if isinstance(event, WorkerExited):
        return f"{kind}:g{event.generation}:v{event.vrank}:{event.device}"
    digest = hashlib.sha1(",".join(str(d) for d in event.devices).encode()).hexdigest()[:12]
    when = f":{event.deadline:.0f}" if isinstance(event, PreemptNotice) else ""
    return f"{kind}:{event.allocation[:64]}{when}:{digest}"


def _dt(t: float | None) -> Any:
    from datetime import UTC, datetime

    return None if t is None else datetime.fromtimestamp(t, UTC)

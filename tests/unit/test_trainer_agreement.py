"""What a step's agreement makes of the orders the ranks wrote (worker/trainer.newest_order),
and what the coordinator keeps of a process's answers (coordinator/reconcile.answer).

Found in a full run under load (tests/dist/test_inject.py, a worker killed before the commit
vote): a rank learned the retried resize's order from a peer's agreement value before its
own copy came by the channel; that copy, taken while the resize ran, was written into the
new generation's first agreement, every rank carried the order out again and refused it
("order's old layout ... is not the current"), and that refusal, overwriting the commits,
stopped the job."""
from __future__ import annotations

from slurm_etc.coordinator.reconcile import answer
from slurm_etc.protocol.messages import (
    ENCODER,
    ORDER_DECODER,
    Abort,
    LayoutSpec,
    Resize,
    Resized,
    Stop,
)
from slurm_etc.worker.agreement import how_decided, order_key
from slurm_etc.worker.trainer import newest_order

OLD = LayoutSpec.make("dp=2,tp=1,pp=1", (0, 1))
NEW = LayoutSpec.make("dp=2,tp=2,pp=1", (0, 1, 2, 3))


def order(generation: int) -> Resize:
    return Resize("j", generation, OLD, NEW)


def test_an_order_of_the_process_own_generation_is_carried_out_already():
    values = [ENCODER.encode(order(2)), b"-", b"-", b"-"]
    assert newest_order(values, 2, set()) is None  # a copy taken during the resize
    assert newest_order(values, 1, set()) == order(2)  # still ahead: the resize
    assert newest_order(values, 3, set()) is None


def test_the_newest_order_ahead_wins_and_aborted_ones_are_over():
    values = [ENCODER.encode(order(3)), ENCODER.encode(order(4)), b"-"]
    assert newest_order(values, 2, set()) == order(4)
    assert newest_order(values, 2, {4}) == order(3)
    assert newest_order(values, 2, {3, 4}) is None
    stop = Stop("j", 3, "end")  # the coordinator stops with generation + 1
    assert newest_order([ENCODER.encode(stop), b"-"], 2, set()) == stop
    assert newest_order([ENCODER.encode(Abort("j", 3, "no")), b"-"], 2, {3}) is None


def said(outcome: str, pause: float = 0.0) -> Resized:
    return Resized("j", 2, 0, outcome, 9, pause_seconds=pause)  # type: ignore[arg-type]


def test_a_commit_is_final_and_a_later_commit_brings_the_figures():
    assert answer(None, said("aborted")) == said("aborted")
    assert answer(said("committed"), said("aborted")) == said("committed")
    assert answer(said("committed"), said("committed", 0.2)) == said("committed", 0.2)
    assert answer(said("aborted"), said("committed")) == said("committed")


def test_a_stop_is_never_passed_over_even_in_an_aborted_resize_generation():
    # soak seed 102: a resize to generation 11 aborted here, then the coordinator's Stop came
    # as generation 11 (its committed 10 + 1): dropped as "aborted", the workers trained on
    stop = Stop("j", 11, "the events script played out")
    assert newest_order([ENCODER.encode(stop), b"-"], 10, {11}) == stop
    assert newest_order([ENCODER.encode(order(12)), ENCODER.encode(stop)], 10, {11}) == stop



def _decided(held: list) -> str:
    """How the trainer's collectives after an open gate decide (an all-reduce of each rank's
    key, the max of the key and of its negation), written out over the ranks' (order held,
    store lost)."""
    keys = [order_key(o, lost) for o, lost in held]
    return how_decided(min(keys), max(keys))


def test_the_collectives_decide_unless_no_order_is_held_and_a_store_closed():
    assert _decided([(order(3), False)] * 4) == "held"
    assert _decided([(None, False)] * 3) == "held"  # nobody holds anything now: no order
    assert _decided([(order(3), True), (order(3), False)]) == "held"
    # one rank told, a newer one come to some, a Stop beside a resize: the newest is given
    assert _decided([(order(3), False), (None, False)]) == "given"
    assert _decided([(order(3), False), (order(4), False)]) == "given"
    assert _decided([(Stop("j", 3, "end"), False), (order(3), False)]) == "given"
    assert _decided([(order(3), False), (None, True)]) == "given"
    # nothing held and a store lost: the store's agreement waits for its restart
    assert _decided([(None, True), (None, True)]) == "store"
    assert _decided([(None, True), (None, False)]) == "store"


def test_an_order_key_is_its_order_and_the_newest_is_the_highest():
    stops = [Stop("j", 1, "a"), Stop("j", 2, "b")]
    keys = [order_key(o) for o in (order(1), order(2), order(40), *stops)]
    assert keys == sorted(keys) and len(set(keys)) == 5 and min(keys) > 1  # none is 0 or 1
    assert order_key(Stop("j", 2, "a")) == order_key(Stop("j", 2, "b"))
    assert order_key(Stop("j", 1, "a")) > order_key(order(10 ** 6))  # a Stop is never passed
    # the highest key is the order newest_order picks among them
    values = [ENCODER.encode(o) for o in (order(3), order(5), Stop("j", 4, "x"))]
    newest = newest_order(values, 2, set())
    assert order_key(newest) == max(order_key(ORDER_DECODER.decode(v)) for v in values)

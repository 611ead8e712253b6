"""Pure parts of the elastic worker: sampler order, constant global batch, sequences, the
scripted control seam and the order/report wire format."""
from __future__ import annotations

import msgspec
import pytest

from slurm_etc.plan import Layout, ParallelConfig
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import PRESETS
from slurm_etc.protocol.messages import (
    ENCODER,
    ORDER_DECODER,
    REPORT_DECODER,
    LayoutSpec,
    Progress,
    Resize,
    Stop,
)
from slurm_etc.worker.data import BatchError, check_batch, microbatch_samples
from slurm_etc.worker.scripted import ScriptedControl, ScriptEntry
from slurm_etc.worker.sequence import ResizeSequence, default_global_batch, parse_sequence


def test_every_sample_of_a_step_read_once_whatever_the_dp():
    for dp in (1, 2, 3, 4, 6):
        seen = sorted(i for r in range(dp) for mb in microbatch_samples(24, 12, 1, dp, r)
                      for i in mb)
        assert seen == list(range(24, 36)), dp


def test_megatron_sampler_order():
    # dp rank 1 of 2, micro batch 2, global batch 8: rounds of 4 samples, its second pair
    assert microbatch_samples(0, 8, 2, 2, 1) == [range(2, 4), range(6, 8)]
    assert microbatch_samples(16, 8, 2, 2, 0) == [range(16, 18), range(20, 22)]


def test_global_batch_that_cannot_be_kept_is_refused_with_the_options():
    assert check_batch(12, 2, 3) == 2
    with pytest.raises(BatchError, match=r"dp=3 cannot keep the global batch of 8.*dp may be "
                                         r"1, 2, 4, 8"):
        check_batch(8, 1, 3)


def test_parse_sequence_and_its_errors():
    assert parse_sequence("dp=2,tp=1,pp=2 -> dp=1,tp=2") == [ParallelConfig(2, 1, 2),
                                                           ParallelConfig(1, 2, 1)]
    for bad in ("dp=2", "dp=2 -> ", "dp=2 => dp=1", "dp=x -> dp=1", "tp=2 -> dp=1"):
        with pytest.raises(ConfigError):
            parse_sequence(bad)


def test_sequence_refuses_a_step_that_does_not_divide_the_model_or_the_batch():
    tiny = PRESETS["tiny"]
    with pytest.raises(ConfigError, match="tp \\(3\\) must divide"):
        ResizeSequence(tiny, (ParallelConfig(1), ParallelConfig(1, 3)), 2, 8)
    with pytest.raises(BatchError, match="dp=3 cannot keep"):
        ResizeSequence(tiny, (ParallelConfig(2), ParallelConfig(3)), 2, 8)
    with pytest.raises(ConfigError, match="to itself"):
        ResizeSequence(tiny, (ParallelConfig(2), ParallelConfig(2)), 2, 8)
    assert default_global_batch([ParallelConfig(2), ParallelConfig(3)]) == 12


def test_sequence_layouts_are_planned_on_the_processes():
    seq = ResizeSequence(PRESETS["tiny"], (ParallelConfig(2, 1, 2), ParallelConfig(1, 2, 1),
                                           ParallelConfig(3)), 2, 12)
    layouts, digests = seq.layouts()
    assert [lay.config for lay in layouts] == list(seq.configs)
    assert layouts[0].devices == (0, 1, 2, 3)
    assert all(set(lay.devices) <= set(range(4)) for lay in layouts)
    assert digests[0] == "" and len(set(digests[1:])) == 2
    assert seq.layouts() == (layouts, digests)  # deterministic


def _resize(gen: int) -> Resize:
    return Resize("j", gen, LayoutSpec.make("dp=2,tp=1,pp=1", (0, 1)),
                  LayoutSpec.make("dp=1,tp=2,pp=1", (1, 2)))


def test_scripted_control_hands_orders_at_their_step_to_their_recipients():
    step = [0]
    script = [ScriptEntry(3, _resize(1), frozenset({0, 2})), ScriptEntry(5, Stop("j", 2))]
    rank0 = ScriptedControl(script, 0, clock=lambda: step[0])
    rank1 = ScriptedControl(script, 1, clock=lambda: step[0])
    joiner = ScriptedControl(script, 2, clock=lambda: 0)
    assert rank0.poll() is None and rank1.poll() is None
    assert joiner.wait(0.0) == _resize(1)  # a joining process gets its order at once
    step[0] = 3
    assert rank0.poll() == _resize(1) and rank0.poll() is None
    assert rank1.poll() is None  # not told: the trainer's agreement tells it
    step[0] = 5
    assert rank1.poll() == Stop("j", 2)
    late = ScriptedControl(script, 0, clock=lambda: 9, after_generation=1)
    assert late.poll() == Stop("j", 2)


def test_orders_and_reports_round_trip_and_reject_garbage():
    order = _resize(4)
    assert ORDER_DECODER.decode(ENCODER.encode(order)) == order
    assert order.new.layout() == Layout(ParallelConfig(1, 2, 1), (1, 2))
    rep = Progress("j", 1, 0, 7, 2.5, 1e-3, 56, "dp=2,tp=1,pp=1")
    assert REPORT_DECODER.decode(ENCODER.encode(rep)) == rep
    with pytest.raises(msgspec.ValidationError):
        ORDER_DECODER.decode(ENCODER.encode(rep))
    with pytest.raises(msgspec.ValidationError):
        ORDER_DECODER.decode(ENCODER.encode({"type": "resize", "job": "j"}))


def _views(tensors: dict, split: int = 2) -> list[dict]:
    """Views as megatron_view gives them: each tensor cut into ``split`` row blocks over
    as many ranks, raw bits."""
    import numpy as np

    views: list[dict] = [{"shards": {}, "shapes": {}} for _ in range(split)]
    for key, value in tensors.items():
        rows = value.shape[0] // split
        for r in range(split):
            lo = (r * rows,) + (0,) * (value.ndim - 1)
            hi = ((r + 1) * rows,) + value.shape[1:]
            block = np.ascontiguousarray(value[r * rows:(r + 1) * rows])
            views[r]["shards"][(key, lo, hi, (0, 0, 0))] = block.view(np.uint32).reshape(-1)
            views[r]["shapes"][key] = value.shape
    return views


def test_the_no_resize_comparison_judges_full_tensors_against_their_largest_value():
    """The no-resize reference's state check: rounding passes, a wrong block does not,
    a tensor missing on one side does not; each side is assembled from its own ranks."""
    import numpy as np

    from slurm_etc.worker.sequence import STATE_RTOL, _compare_full_tensors

    rng = np.random.default_rng(0)
    ref = {"w": rng.standard_normal((4, 3)).astype(np.float32),
           "optimizer.state.exp_avg_sq.w": (rng.random((4, 3)) * 1e-8).astype(np.float32)}
    tol = STATE_RTOL["fp32"]
    rounded = {k: (v * (1 + 1e-7)).astype(np.float32) for k, v in ref.items()}
    bad, n, worst = _compare_full_tensors(_views(rounded), _views(ref, 4), tol)
    assert bad == [] and n == 2 and worst < tol
    wrong = dict(ref, w=ref["w"].copy())
    wrong["w"][2:] = ref["w"][:2]  # a block moved to the wrong place
    bad, _, worst = _compare_full_tensors(_views(wrong), _views(ref), tol)
    assert [m["shard"] for m in bad] == ["w"] and worst > tol
    bad, _, _ = _compare_full_tensors(_views({"w": ref["w"]}), _views(ref), tol)
    assert [(m["shard"], m["problem"]) for m in bad] == [
        ("optimizer.state.exp_avg_sq.w", "missing")]
    # every Adam step on both sides: one rank a step behind is caught
    same, behind = _views(ref), _views(ref)
    for v in same + behind:
        v["steps"] = [6.0]
    behind[1]["steps"] = [5.0]
    assert _compare_full_tensors(same, same, tol, 6)[0] == []
    bad, _, _ = _compare_full_tensors(behind, same, tol, 6)
    assert [m["shard"] for m in bad] == ["Adam step"]

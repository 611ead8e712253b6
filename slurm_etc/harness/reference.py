"""The independent oracle of ``slurm-etc verify``: state read through megatron-core and torch.

Nothing here uses slurm-etc's shard adapter (``state.local_shards``, ``param_pieces``), its
shard catalog, its region tables (``plan/regions.py``, ``migrate/shards.py``) or the
executor. A training state is read the way megatron-core reads it for its own checkpoints:

* parameters: every ``ShardedTensor`` of the model's ``sharded_state_dict()``
  (``ShardedTensorFactory`` built with megatron's own ``build()``, e.g. SwiGLU's fc1 halves),
  each with megatron's global box (``global_offset``, ``local_shape``, ``prepend_axis_num``)
  and ``replica_id``;
* optimizer state by parameter: ``optimizer.state[main_param]`` of the torch Adam inside
  megatron's ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` (the fp32 main copy
  of each bf16 parameter as ``fp32_param``); for the ``DistributedOptimizer``, megatron's own
  gather ``get_parameter_state_dp_zero()`` (full buffers on dp rank 0), cut into parameters
  with megatron's buffer metadata (``param_index_map``, bucket offsets). Each optimizer
  tensor gets its parameter's global box through megatron's
  ``make_sharded_optimizer_tensor`` (``optimizer.state.<name>.<parameter key>``);
* the Adam step of every parameter (torch's ``state["step"]``), the CPU generator, and the
  rank's megatron coordinates (tp, dp, pp ranks, layer numbers).

The parent then assembles full global tensors from a layout's views (every element held,
replicas bit-identical) and compares bit for bit: old layout against migrated layout
(:func:`compare_globals`), and rank by rank against the state megatron's checkpoint loaded
(:func:`compare_ranks`). A shard present on one side only is a mismatch.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
MOMENTS = ("exp_avg", "exp_avg_sq")

# A shard as the oracle names it: megatron key, box (lo, hi over the global axes), replica id.
ShardKey = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _bits(tensor: Any) -> np.ndarray:
    """Raw bits of a tensor (row-major, a copy) as a numpy integer array."""
    import torch

    t = tensor.detach().contiguous().reshape(-1)
    return t.view(getattr(torch, _NP_INT[t.element_size()].__name__)).numpy().copy()


def rng_digest() -> str:
    import torch

    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()


def _sharded_tensors(node: Any) -> Iterable[Any]:
    """ShardedTensors of a sharded state dict (factories built by megatron)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for leaf in nested_values(node):
        if isinstance(leaf, ShardedTensorFactory):
            yield from _sharded_tensors(leaf.build())
        elif isinstance(leaf, ShardedTensor):
            yield leaf


def _entry(sh: Any) -> tuple[ShardKey, np.ndarray, tuple[int, ...]]:
    if sh.flattened_range is not None:
        raise ValueError(f"{sh.key}: flattened ShardedTensors are not model-space tensors")
    p = sh.prepend_axis_num
    lo = tuple(int(x) for x in sh.global_offset)
    hi = tuple(o + 1 for o in lo[:p]) + tuple(o + int(n) for o, n in zip(lo[p:], sh.local_shape))
    if tuple(sh.data.shape) != tuple(int(n) for n in sh.local_shape):
        raise ValueError(f"{sh.key}: data shape {tuple(sh.data.shape)} is not its local shape "
                         f"{tuple(sh.local_shape)}")
    replica = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
    return ((sh.key, lo, hi, tuple(int(x) for x in replica)), _bits(sh.data),
            tuple(int(x) for x in sh.global_shape))


def _optimizer_tensors(state: Any, params_by_id: Mapping[int, Any]
                       ) -> tuple[list[tuple[Any, str, Any]], list[float]]:
    """(model parameter, state name, tensor of the parameter's local shape) for every
    optimizer tensor this rank reports, and every parameter's Adam step on this rank."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    subs = list(getattr(state.optimizer, "chained_optimizers", None) or [state.optimizer])
    out: list[tuple[Any, str, Any]] = []
    steps: list[float] = []
    for sub in subs:
        inner = sub.optimizer
        steps += [float(st["step"]) for st in inner.state.values() if "step" in st]
        if isinstance(sub, DistributedOptimizer):
            out += _dist_optimizer_tensors(sub)
        elif isinstance(sub, Float16OptimizerWithFloat16Params):
            for group16, group32 in zip(sub.float16_groups, sub.fp32_from_float16_groups):
                for param, main in zip(group16, group32):
                    out.append((param, "fp32_param", main))
                    out += [(param, k, inner.state[main][k]) for k in MOMENTS]
            for group in sub.fp32_from_fp32_groups:
                for param in group:
                    out += [(param, k, inner.state[param][k]) for k in MOMENTS]
        elif isinstance(sub, FP32Optimizer):
            for group in inner.param_groups:
                for param in group["params"]:
                    out += [(param, k, inner.state[param][k]) for k in MOMENTS]
        else:
            raise TypeError(f"the oracle cannot read {type(sub).__name__}")
    unknown = [p for p, _, _ in out if id(p) not in params_by_id]
    if unknown:
        raise ValueError(f"{len(unknown)} optimizer parameter(s) are not model parameters")
    return out, steps


def _dist_optimizer_tensors(sub: Any) -> list[tuple[Any, str, Any]]:
    """megatron's ``get_parameter_state_dp_zero()`` (collective over the dp group), cut into
    parameters on dp rank 0 with the DDP buffers' ``param_index_map``: each bucket's
    unpadded range follows the previous buckets' in the gathered tensor."""
    import torch

    gathered = sub.get_parameter_state_dp_zero()
    if gathered is None:  # not dp rank 0
        return []
    out = []
    for gbuf_idx, buffer in enumerate(sub.buffers):
        (world,) = gathered[gbuf_idx].values()
        starts = np.cumsum([0] + [b.numel_unpadded for b in buffer.buckets])
        if int(starts[-1]) != int(world["numel_unpadded"]):
            raise ValueError(f"buffer {gbuf_idx}: buckets hold {int(starts[-1])} unpadded "
                             f"elements, the gather {world['numel_unpadded']}")
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            pos = int(starts[bucket_id]) + start - buffer.buckets[bucket_id].offset
            names = MOMENTS + (("fp32_param",) if param.dtype != torch.float32 else ())
            for name in names:
                flat = world["param" if name == "fp32_param" else name]
                out.append((param, name, flat[pos:pos + end - start].view(param.shape)))
    return out


def megatron_view(state: Any, *, model_only: bool = False) -> dict:
    """This rank's training state as megatron-core and torch hold it (see module docstring).

    Collective over the state's data-parallel groups when it has a DistributedOptimizer.
    Returns ``{"shards": {ShardKey: bits}, "shapes": {key: global shape}, "steps": [...],
    "rng": digest, "coords": {"tp", "dp", "pp", "layers"}}``.
    """
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    model_sd = state.model_sharded_state_dict()
    shards: dict[ShardKey, np.ndarray] = {}
    shapes: dict[str, tuple[int, ...]] = {}

    def add(sh: Any) -> None:
        key, bits, shape = _entry(sh)
        if key in shards:
            raise ValueError(f"{key}: reported twice on one rank")
        shards[key] = bits
        shapes[key[0]] = shape

    for sh in _sharded_tensors(model_sd):
        add(sh)
    steps: list[float] = []
    if not model_only:
        by_param = {id(v.data): v for v in nested_values(model_sd)
                    if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
        tensors, steps = _optimizer_tensors(state, by_param)
        for param, name, tensor in tensors:
            optimizer_sh = make_sharded_optimizer_tensor(by_param[id(param)], tensor,
                                                         prefix=f"optimizer.state.{name}")
            for sh in _sharded_tensors({"x": optimizer_sh}):
                add(sh)
    layers = [int(layer.layer_number) for gpt in state.gpts for layer in gpt.decoder.layers]
    return {"shards": shards, "shapes": shapes, "steps": sorted(set(steps)),
            "rng": rng_digest(),
            "coords": {"tp": parallel_state.get_tensor_model_parallel_rank(),
                       "dp": parallel_state.get_data_parallel_rank(),
                       "pp": parallel_state.get_pipeline_model_parallel_rank(),
                       "layers": layers}}


# -- worker phases ------------------------------------------------------------------------

def w_megatron_view(ctx: Any, name: str = "state", *, model_only: bool = False) -> dict | None:
    """Worker phase: :func:`megatron_view` of live state ``name`` (None where there is none)."""
    state = ctx.objects.get(name)
    return None if state is None else megatron_view(state, model_only=model_only)


def w_seed_rng(ctx: Any, seed: int) -> str | None:
    """Worker phase: give every rank's CPU generator a state of its own, so that a new rank
    continuing the wrong generator (or a stale one) cannot go unnoticed. Training does not
    draw from it (no dropout)."""
    import torch

    if "state" not in ctx.objects:
        return None
    torch.manual_seed(int.from_bytes(hashlib.sha256(f"{seed}/rng/{ctx.index}".encode())
                                     .digest()[:8], "little") >> 1)
    torch.rand(ctx.index + 1)
    return rng_digest()


# -- the parent's side ----------------------------------------------------------------------

@dataclass
class Assembled:
    """Full global tensors of one layout (raw bits), assembled from its ranks' views."""

    tensors: dict[str, np.ndarray]
    problems: list[dict] = field(default_factory=list)
    shards: int = 0


def _index(shape: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> tuple[slice, ...]:
    if len(lo) != len(shape) or any(not 0 <= a < b <= n for a, b, n in zip(lo, hi, shape)):
        raise ValueError(f"box {lo}..{hi} does not fit global shape {tuple(shape)}")
    return tuple(slice(a, b) for a, b in zip(lo, hi))


def assemble(views: Sequence[dict | None], side: str) -> Assembled:
    """Put a layout's views together: every element held, every replica bit-identical.

    Problems (``side`` names the layout) name the key, the rank and the box.
    """
    tensors: dict[str, np.ndarray] = {}
    filled: dict[str, np.ndarray] = {}
    out = Assembled(tensors)
    for rank, view in enumerate(views):
        if view is None:
            continue
        for (key, lo, hi, replica), bits in view["shards"].items():
            shape = view["shapes"][key]
            if key not in tensors:
                tensors[key] = np.zeros(shape, bits.dtype)
                filled[key] = np.zeros(shape, bool)
            elif tensors[key].shape != tuple(shape) or tensors[key].dtype != bits.dtype:
                out.problems.append(_problem(side, key, rank, lo, hi, "global shape or dtype "
                                             "differs between ranks"))
                continue
            idx = _index(shape, lo, hi)
            box = bits.reshape(tuple(b - a for a, b in zip(lo, hi)))
            seen = filled[key][idx]
            differ = seen & (tensors[key][idx] != box)
            if differ.any():
                out.problems.append(_problem(
                    side, key, rank, lo, hi,
                    f"{int(differ.sum())} elements differ from another replica (replica_id "
                    f"{replica})"))
            tensors[key][idx] = box
            filled[key][idx] = True
            out.shards += 1
    for key, f in filled.items():
        if not f.all():
            out.problems.append({"side": side, "state_key": key, "problem":
                                 f"{int((~f).sum())} of {f.size} elements held by no rank"})
    return out


def _problem(side: str, key: str, rank: int, lo, hi, what: str) -> dict:
    return {"side": side, "state_key": key, "rank": rank, "lo": list(lo), "hi": list(hi),
            "problem": what}


def _first_difference(got: np.ndarray, want: np.ndarray) -> dict:
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    i = int(bad[0])
    return {"differing": int(len(bad)), "of": int(got.size), "first": i,
            "got": int(got.reshape(-1)[i]), "expected": int(want.reshape(-1)[i])}


def compare_globals(old: Assembled, new_views: Sequence[dict | None], new: Assembled,
                    oracle: str) -> tuple[list[dict], dict[str, dict]]:
    """Every shard of every new rank against the old layout's full tensor, and every full
    tensor against the other side's (keys, shapes, every element).

    Returns (mismatches, per key ``{"shards", "bytes"}`` compared).
    """
    mismatches: list[dict] = []
    checked: dict[str, dict] = {}
    for key in sorted(set(old.tensors) - set(new.tensors)):
        mismatches.append({"oracle": oracle, "state_key": key,
                           "problem": "held in the old layout, by no rank of the new one"})
    for key in sorted(set(new.tensors) - set(old.tensors)):
        mismatches.append({"oracle": oracle, "state_key": key,
                           "problem": "held in the new layout, not in the old one"})
    for rank, view in enumerate(new_views):
        if view is None:
            continue
        for (key, lo, hi, _replica), bits in sorted(view["shards"].items()):
            want = old.tensors.get(key)
            if want is None:
                continue
            entry = checked.setdefault(key, {"shards": 0, "bytes": 0})
            entry["shards"] += 1
            entry["bytes"] += bits.nbytes
            if want.shape != tuple(view["shapes"][key]) or want.dtype != bits.dtype:
                mismatches.append({"oracle": oracle, "new_rank": rank, "state_key": key,
                                   "lo": list(lo), "hi": list(hi), "problem":
                                   f"global {tuple(view['shapes'][key])} x {bits.dtype}, the "
                                   f"old layout has {want.shape} x {want.dtype}"})
                continue
            box = want[_index(want.shape, lo, hi)]
            if not np.array_equal(box.reshape(-1), bits):
                mismatches.append({"oracle": oracle, "new_rank": rank, "state_key": key,
                                   "lo": list(lo), "hi": list(hi),
                                   **_first_difference(bits, box)})
    for problem in new.problems:
        mismatches.append({"oracle": oracle, **problem})
    return mismatches, checked


def compare_ranks(got: Sequence[dict | None], want: Sequence[dict | None], oracle: str,
                  *, keys: Iterable[str] | None = None) -> tuple[list[dict], dict[str, dict]]:
    """Rank by rank, shard by shard: ``got`` against ``want`` (same layout). A shard on one
    side only is a mismatch. ``keys``: compare only these state keys (None: all)."""
    wanted_keys = None if keys is None else set(keys)
    mismatches: list[dict] = []
    checked: dict[str, dict] = {}
    for rank, (a, b) in enumerate(zip(got, want)):
        if a is None and b is None:
            continue
        sa = {} if a is None else a["shards"]
        sb = {} if b is None else b["shards"]
        for skey in sorted(set(sa) | set(sb)):
            key, lo, hi, replica = skey
            if wanted_keys is not None and key not in wanted_keys:
                continue
            where = {"oracle": oracle, "new_rank": rank, "state_key": key, "lo": list(lo),
                     "hi": list(hi)}
            if skey not in sa or skey not in sb:
                side = "the migrated state" if skey not in sa else "the reference"
                mismatches.append({**where, "problem": f"shard (replica {replica}) missing "
                                                       f"in {side}"})
                continue
            entry = checked.setdefault(key, {"shards": 0, "bytes": 0})
            entry["shards"] += 1
            entry["bytes"] += sa[skey].nbytes
            if sa[skey].shape != sb[skey].shape or sa[skey].dtype != sb[skey].dtype:
                mismatches.append({**where, "problem": f"{sa[skey].size} x {sa[skey].dtype} "
                                   f"vs {sb[skey].size} x {sb[skey].dtype}"})
            elif not np.array_equal(sa[skey], sb[skey]):
                mismatches.append({**where, **_first_difference(sa[skey], sb[skey])})
    return mismatches, checked


def expected_rng_sources(old_views: Sequence[dict | None], new_views: Sequence[dict | None]
                         ) -> dict[int, int]:
    """New rank -> the old rank whose generator it must continue, from megatron's own
    coordinates: same tp and dp rank (modulo the old degrees), on the old rank that held
    the new stage's first layer."""
    old = {r: v["coords"] for r, v in enumerate(old_views) if v is not None}
    old_tp = 1 + max(c["tp"] for c in old.values())
    old_dp = 1 + max(c["dp"] for c in old.values())
    out = {}
    for rank, view in enumerate(new_views):
        if view is None:
            continue
        c = view["coords"]
        first = min(c["layers"])
        match = [r for r, o in old.items() if o["tp"] == c["tp"] % old_tp
                 and o["dp"] == c["dp"] % old_dp and first in o["layers"]]
        if len(match) != 1:
            raise ValueError(f"new rank {rank}: {len(match)} old ranks match {c}")
        out[rank] = match[0]
    return out


def w_train_steps(ctx: Any, name: str, *, first_step: int, count: int, seed: int, seq: int,
                  global_batch: int) -> list[float] | None:
    """Worker phase: ``count`` training steps (forward, backward, optimizer update) of live
    state ``name`` on the seeded batches of steps ``first_step, first_step + 1, ...`` (the
    step index comes from the caller, not from the state); the loss of each. A step that
    megatron skips for non-finite gradients (a broken state) ends the run with a NaN loss
    (every rank sees the same global gradient norm, so all end together)."""
    from slurm_etc.megatron import build

    state = ctx.objects.get(name)
    if state is None:
        return None
    losses: list[float] = []
    for i in range(count):
        try:
            losses.append(build._train_step(state, seed=seed, step=first_step + i,
                                            micro_batch=1, seq=seq, global_batch=global_batch))
        except RuntimeError as exc:
            if "skipped" not in str(exc):
                raise
            losses.append(float("nan"))
            break
    return losses

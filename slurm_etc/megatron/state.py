"""A live megatron-core training state as the executor's shards, and back.

The executor (:mod:`slurm_etc.migrate`) moves ``LocalShard``s: for every state tensor of the
shard catalog (``build_catalog``), the regions a rank holds (``region_table``), as contiguous
tensors. This module is the bridge to a real megatron-core ``TrainingState``
(:mod:`.build`):

* :func:`local_shards` reads this rank's shards out of the model and the optimizer, as
  zero-copy views: parameters through the model's ``sharded_state_dict()`` (one ShardedTensor
  per layer, SwiGLU's fc1 as its two halves, the tied output layer of the last pipeline stage
  as ``embedding.word_embeddings.weight@output_layer``); Adam moments and fp32 main
  parameters (``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>``) from the optimizer,
  cut like their parameter (non-distributed optimizer) or, for the DistributedOptimizer, the
  flat range of each parameter this data-parallel rank owns, split over the parameter's boxes.
* :func:`install_shards` puts shards received for a new layout into a model and optimizer
  built for it (:func:`build_empty_state`) after the migration committed (the executor
  returns new shards only then: two-phase). A tensor that one received shard covers whole
  takes over the shard's memory (no copy); the rest is copied; Adam state is created.
* :class:`ResumeState` is what is not a tensor of the catalog: the Adam step (identical on
  every rank; checked) and the torch CPU generator state. It travels over the migration
  group's control allgather (:func:`exchange_resume_state`) before the data moves.
* :func:`prepare_resize` does what needs no pause (migration group, program, destination
  tensors with their pages touched); :func:`resize_in_place` is the pause: shards -> step
  and RNG -> execute -> commit -> new training group -> new model/optimizer -> install.
* Oracles for ``slurm-etc verify``: :func:`assemble_globals` puts the old layout's shards
  together into full global tensors (checking that replicas agree and every element is held),
  :func:`expected_shards` cuts a layout's regions out of them, :func:`compare_shards` compares
  bit for bit.

megatron-core is imported lazily; on CPU install :mod:`.cpu_compat` first.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from slurm_etc.migrate.shards import LocalShard, shard_specs
from slurm_etc.plan.catalog import TIED_SUFFIX, Catalog
from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.model import ModelDesc
from slurm_etc.plan.regions import region_table

from .build import TrainingState
from .shards import iter_sharded_tensors

logger = logging.getLogger(__name__)

Box3 = tuple[int, int, int]
EMBEDDING = "embedding.word_embeddings.weight"
OPT_PREFIX = "optimizer.state."
# Optimizer states a catalog may list, and where each lives in megatron's optimizers.
FP32_PARAM, EXP_AVG, EXP_AVG_SQ = "fp32_param", "exp_avg", "exp_avg_sq"
_INT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


class StateError(RuntimeError):
    """A training state does not match the catalog or the shards given to it."""


# -- model pieces ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ParamPiece:
    """One ShardedTensor of the model: elements ``[offset, offset + numel)`` of a parameter's
    flattened local tensor are box ``[lo, hi)`` (row-major) of catalog tensor ``key``.

    ``alias`` marks the second name of the same memory: with tied embeddings and one pipeline
    stage, the output layer *is* the word embedding, and the catalog lists it under both keys.
    """

    key: str
    param: Any
    offset: int
    numel: int
    lo: Box3
    hi: Box3
    alias: bool = False


def _box(sh: Any) -> tuple[Box3, Box3]:
    """Box of a ShardedTensor in the catalog's three-axis index space."""
    p = sh.prepend_axis_num
    lo = list(sh.global_offset)
    hi = [o + 1 for o in lo[:p]] + [o + n for o, n in zip(lo[p:], sh.local_shape)]
    if len(lo) > 3:
        raise StateError(f"{sh.key}: {len(lo)} axes, the catalog has at most 3")
    lo += [0] * (3 - len(lo))
    hi += [1] * (3 - len(hi))
    return tuple(lo), tuple(hi)  # type: ignore[return-value]


def _locate(data: torch.Tensor, params: Sequence[torch.Tensor], key: str) -> tuple[Any, int]:
    """(parameter, element offset) of a contiguous view ``data`` of one of ``params``."""
    if not data.is_contiguous():
        raise StateError(f"{key}: the sharded tensor is not a contiguous view of a parameter")
    ptr, storage = data.data_ptr(), data.untyped_storage().data_ptr()
    for p in params:
        if p.untyped_storage().data_ptr() != storage or p.dtype != data.dtype:
            continue
        off, rem = divmod(ptr - p.data_ptr(), p.element_size())
        if rem == 0 and 0 <= off and off + data.numel() <= p.numel():
            if not p.is_contiguous():
                raise StateError(f"{key}: parameter is not contiguous")
            return p, off
    raise StateError(f"{key}: sharded tensor data is not part of any model parameter")


def param_pieces(state: TrainingState) -> list[ParamPiece]:
    """Every model ShardedTensor of this rank as a piece of one of its parameters."""
    gpt = state.gpt
    params = [p for p in gpt.parameters()]
    out_layer = getattr(gpt, "output_layer", None)
    out_weight = getattr(out_layer, "weight", None) if out_layer is not None else None
    tied = state.model_desc.tied_embeddings
    pieces = []
    for _path, sh in iter_sharded_tensors(gpt.sharded_state_dict()):
        param, offset = _locate(sh.data, params, sh.key)
        key = sh.key
        if tied and key == EMBEDDING and out_weight is not None and param is out_weight:
            key += TIED_SUFFIX  # the last stage's copy of the embedding (pp > 1)
        lo, hi = _box(sh)
        pieces.append(ParamPiece(key, param, offset, sh.data.numel(), lo, hi))
        if tied and key == EMBEDDING and state.config.pp == 1:
            pieces.append(ParamPiece(key + TIED_SUFFIX, param, offset, sh.data.numel(), lo, hi,
                                     alias=True))
    return pieces


# -- optimizer state ------------------------------------------------------------------------

@dataclass
class _OptEntry:
    """Where one model parameter's optimizer state lives.

    ``main`` is the tensor the inner torch optimizer steps (the fp32 main parameter, or the
    parameter itself for fp32 models without the distributed optimizer); its state is
    ``inner.state[main]``. ``[start, end)`` is the part of the flattened parameter it covers
    (all of it, except with the distributed optimizer).
    """

    inner: Any
    main: torch.Tensor
    start: int
    end: int
    separate_main: bool  # main is an fp32 copy (mixed precision): the 'fp32_param' state


def _sub_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _opt_entries(state: TrainingState) -> dict[int, _OptEntry]:
    """id(model parameter) -> its optimizer entry, for every parameter with state here."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    entries: dict[int, _OptEntry] = {}
    for sub in _sub_optimizers(state.optimizer):
        inner = sub.optimizer
        if isinstance(sub, DistributedOptimizer):
            for param, (gi, go) in sub.model_param_group_index_map.items():
                main = inner.param_groups[gi]["params"][go]
                r = sub._get_model_param_range_map(param)["param"]
                entries[id(param)] = _OptEntry(inner, main, r.start, r.end,
                                               main.dtype != param.dtype or
                                               main.untyped_storage().data_ptr() !=
                                               param.untyped_storage().data_ptr())
        elif isinstance(sub, Float16OptimizerWithFloat16Params):
            for group16, group32 in zip(sub.float16_groups, sub.fp32_from_float16_groups):
                for param, main in zip(group16, group32):
                    entries[id(param)] = _OptEntry(inner, main, 0, param.numel(), True)
            for group in sub.fp32_from_fp32_groups:
                for param in group:
                    entries[id(param)] = _OptEntry(inner, param, 0, param.numel(), False)
        elif isinstance(sub, FP32Optimizer):
            for group in inner.param_groups:
                for param in group["params"]:
                    entries[id(param)] = _OptEntry(inner, param, 0, param.numel(), False)
        else:
            raise StateError(f"unsupported optimizer {type(sub).__name__}; supported: "
                             "FP32Optimizer, Float16OptimizerWithFloat16Params, "
                             "DistributedOptimizer")
    return entries


def _opt_name(state_key: str, param_key: str) -> str | None:
    """'exp_avg' for 'optimizer.state.exp_avg.<param_key>', None for the parameter itself."""
    if state_key == param_key:
        return None
    suffix = "." + param_key
    if not (state_key.startswith(OPT_PREFIX) and state_key.endswith(suffix)):
        raise StateError(f"catalog state {state_key!r} of {param_key!r} is neither the "
                         "parameter nor an optimizer.state.<name> entry")
    name = state_key[len(OPT_PREFIX):-len(suffix)]
    if name not in (FP32_PARAM, EXP_AVG, EXP_AVG_SQ):
        raise StateError(f"unknown optimizer state {name!r} in {state_key!r}")
    return name


def _catalog_states(catalog: Catalog) -> dict[str, list[tuple[str, bool]]]:
    """param key -> [(state key, in a distributed-optimizer group)] of its groups."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for g in catalog.groups:
        out.setdefault(g.param, []).extend((st.key, g.dist) for st in g.states)
    return out


class _Target:
    """One tensor of the live state that shards map into: a model parameter (``kind``
    'param'), an fp32 main parameter ('fp32_param') or an Adam moment ('exp_avg',
    'exp_avg_sq'), which may not exist yet in a fresh optimizer."""

    def __init__(self, kind: str, param: Any = None, entry: _OptEntry | None = None) -> None:
        self.kind, self.param, self.entry = kind, param, entry

    @property
    def shape(self) -> torch.Size:
        return self.param.shape if self.kind == "param" else self.entry.main.shape

    @property
    def numel(self) -> int:
        return self.param.numel() if self.kind == "param" else self.entry.main.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype if self.kind == "param" else torch.float32

    def base(self) -> torch.Tensor | None:
        """The live tensor (None: no Adam state yet)."""
        if self.kind == "param":
            return self.param
        if self.kind == FP32_PARAM:
            return self.entry.main
        return self.entry.inner.state.get(self.entry.main, {}).get(self.kind)

    def flat(self, key: Any) -> torch.Tensor:
        base = self.base()
        if base is None:
            raise StateError(f"{key}: the optimizer has no {self.kind!r} yet (build with "
                             "steps >= 1)")
        return base.detach().view(-1)

    def can_adopt(self) -> bool:
        """Whether the tensor may be replaced by another one (not a view into a buffer,
        such as the DistributedOptimizer's contiguous parameter buffer)."""
        base = self.base()
        if base is None:
            return True
        return (base.storage_offset() == 0
                and base.untyped_storage().nbytes() == base.numel() * base.element_size())

    def adopt(self, src: torch.Tensor) -> None:
        value = src.detach().view(self.shape)
        if self.kind == "param":
            self.param.data = value
        elif self.kind == FP32_PARAM:
            self.entry.main.data = value
        else:
            self.entry.inner.state[self.entry.main][self.kind] = value

    def allocate(self) -> None:
        """Fresh (uninitialised) Adam moment; every element is then written."""
        if self.base() is None:
            self.entry.inner.state[self.entry.main][self.kind] = torch.empty(
                self.shape, dtype=torch.float32)


@dataclass(frozen=True)
class _Slot:
    """One shard's place in the live state: flat elements ``[a, b)`` of ``target``."""

    key: tuple[str, Box3, Box3, int]
    target: _Target
    a: int
    b: int
    alias: bool


def _slots(state: TrainingState, catalog: Catalog, model_only: bool = False) -> list[_Slot]:
    """Where every shard of this rank lives (``model_only``: leave the optimizer out)."""
    if catalog.distributed_optimizer != state.config.distributed_optimizer:
        raise StateError("the catalog and the training state disagree on the distributed "
                         "optimizer")
    states = _catalog_states(catalog)
    entries = _opt_entries(state)
    targets: dict[tuple[int, str], _Target] = {}

    def target(kind: str, param: Any, entry: _OptEntry | None) -> _Target:
        ident = (id(param), kind)
        if ident not in targets:
            targets[ident] = _Target(kind, param, entry)
        return targets[ident]

    slots: list[_Slot] = []
    for pc in param_pieces(state):
        if pc.key not in states:
            raise StateError(f"model tensor {pc.key!r} is not in the catalog of "
                             f"{catalog.model.name}")
        for state_key, dist in states[pc.key]:
            name = _opt_name(state_key, pc.key)
            if name is None:
                slots.append(_Slot((state_key, pc.lo, pc.hi, 0), target("param", pc.param, None),
                                   pc.offset, pc.offset + pc.numel, pc.alias))
                continue
            if model_only:
                continue
            entry = entries.get(id(pc.param))
            if entry is None:
                if dist:
                    continue  # this dp rank owns no part of the parameter
                raise StateError(f"{pc.key}: parameter has no optimizer state")
            if name == FP32_PARAM and not entry.separate_main:
                raise StateError(f"{state_key}: the catalog lists an fp32 main parameter, the "
                                 "optimizer has none (model not in mixed precision?)")
            tgt = target(name, pc.param, entry)
            if dist:
                a, b = max(pc.offset, entry.start), min(pc.offset + pc.numel, entry.end)
                if a < b:
                    slots.append(_Slot((state_key, pc.lo, pc.hi, a - pc.offset), tgt,
                                       a - entry.start, b - entry.start, pc.alias))
            else:
                slots.append(_Slot((state_key, pc.lo, pc.hi, 0), tgt, pc.offset,
                                   pc.offset + pc.numel, pc.alias))
    return slots


def local_shards(state: TrainingState, catalog: Catalog, *,
                 model_only: bool = False) -> list[LocalShard]:
    """This rank's shards of every catalog tensor, as views of the live state (no copies);
    ``model_only``: the parameters alone.

    Raises:
        StateError: the state has a tensor the catalog does not know, or lacks Adam state.
    """
    out = []
    for sl in _slots(state, catalog, model_only=model_only):
        out.append(LocalShard(sl.key[0], sl.key[1], sl.key[2], sl.key[3],
                              sl.target.flat(sl.key)[sl.a:sl.b]))
    return out


def check_shards(catalog: Catalog, config: ParallelConfig, rank: int,
                 shards: Iterable[LocalShard]) -> list[str]:
    """Differences between ``shards`` and what the catalog says rank ``rank`` holds
    (missing, unexpected, wrong element count); empty when they match."""
    expect = {sp.key: sp for sp in shard_specs(catalog, region_table(catalog, config), rank)}
    got = {sh.key: sh for sh in shards}
    out = [f"missing shard {k}" for k in sorted(set(expect) - set(got))]
    out += [f"unexpected shard {k}" for k in sorted(set(got) - set(expect))]
    for k in sorted(set(expect) & set(got)):
        sp, t = expect[k], got[k].tensor
        if t.numel() != sp.numel or t.element_size() != sp.itemsize:
            out.append(f"shard {k}: {t.numel()} elements of {t.element_size()} bytes, the "
                       f"catalog says {sp.numel} of {sp.itemsize}")
    return out


def install_shards(state: TrainingState, catalog: Catalog, shards: Sequence[LocalShard],
                   resume: ResumeState | None, *, adopt: bool = True) -> dict:
    """Write a new layout's shards (and step, RNG) into ``state``, built for that layout.

    Call after the migration committed. A tensor that one shard covers whole *adopts* the
    shard's memory (no copy: the received tensor becomes the Adam moment, the fp32 main
    parameter or the parameter's data), unless it is a view into a larger buffer (the
    DistributedOptimizer's parameter buffer) or ``adopt`` is False; every other tensor is
    copied into, Adam moments allocated first where the optimizer has none. With one
    pipeline stage and tied embeddings the output-layer copy must equal the embedding bit for
    bit (it is the same memory). Every element of every target is written exactly once.

    Returns:
        ``{"tensors": shards installed, "adopted": tensors adopted, "copied_bytes": ...}``.

    Raises:
        StateError: a shard is missing, unexpected, misshapen, an alias disagrees, or the
            shards do not cover a tensor.
    """
    by_key = {sh.key: sh for sh in shards}
    if len(by_key) != len(shards):
        raise StateError("a shard was given twice")
    slots = _slots(state, catalog)
    wanted = {sl.key for sl in slots}
    extra = sorted(set(by_key) - wanted)
    if extra:
        raise StateError(f"{len(extra)} shard(s) have no place in this state, e.g. {extra[0]}")
    per_target: dict[int, list[_Slot]] = {}
    for sl in slots:
        sh = by_key.get(sl.key)
        if sh is None:
            raise StateError(f"no shard received for {sl.key}")
        if sh.tensor.numel() != sl.b - sl.a or sh.tensor.dtype != sl.target.dtype:
            raise StateError(f"shard {sl.key}: {sh.tensor.numel()} x {sh.tensor.dtype}, the "
                             f"state needs {sl.b - sl.a} x {sl.target.dtype}")
        if not sl.alias:
            per_target.setdefault(id(sl.target), []).append(sl)
    adopted = copied = 0
    with torch.no_grad():
        for group in per_target.values():
            tgt = group[0].target
            covered = sum(sl.b - sl.a for sl in group)
            if covered != tgt.numel:
                raise StateError(f"shards cover {covered} of {tgt.numel} elements of the "
                                 f"{tgt.kind} behind {group[0].key[0]}")
            src = by_key[group[0].key].tensor
            if (adopt and len(group) == 1 and src.is_contiguous() and tgt.can_adopt()):
                tgt.adopt(src)
                adopted += 1
                continue
            if tgt.kind in (EXP_AVG, EXP_AVG_SQ):
                tgt.allocate()
            flat = tgt.flat(group[0].key)
            for sl in group:
                flat[sl.a:sl.b].copy_(by_key[sl.key].tensor.detach().reshape(-1))
                copied += (sl.b - sl.a) * flat.element_size()
        for sl in slots:
            if sl.alias and not torch.equal(_bits(sl.target.flat(sl.key)[sl.a:sl.b]),
                                            _bits(by_key[sl.key].tensor)):
                raise StateError(f"{sl.key} differs from the embedding it aliases")
        if resume is not None:
            step = torch.tensor(float(resume.step), dtype=torch.float32)
            entries = {id(e.main): e for sl in slots if (e := sl.target.entry) is not None}
            for entry in entries.values():
                entry.inner.state[entry.main]["step"] = step.clone()
            torch.set_rng_state(torch.frombuffer(bytearray(resume.rng), dtype=torch.uint8))
    return {"tensors": len(slots), "adopted": adopted, "copied_bytes": copied}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    return t.view(_INT_DTYPES[t.element_size()])


# -- step and RNG ---------------------------------------------------------------------------

RNG_BYTES = 5056  # torch's CPU (mt19937) generator state


@dataclass(frozen=True)
class ResumeState:
    """What a resumed rank needs besides the tensors: the Adam step and its RNG state.

    Attributes:
        step: optimizer steps taken (the same on every rank of a synchronous job).
        rng: ``torch.get_rng_state()`` of the CPU generator, as bytes.
    """

    step: int
    rng: bytes

    def __post_init__(self) -> None:
        if len(self.rng) != RNG_BYTES:
            raise ValueError(f"CPU generator state has {len(self.rng)} bytes, expected "
                             f"{RNG_BYTES}")


def optimizer_step(state: TrainingState) -> int:
    """The Adam step of this rank's optimizer (every parameter's state must agree)."""
    steps = set()
    for sub in _sub_optimizers(state.optimizer):
        for st in sub.optimizer.state.values():
            if "step" in st:
                steps.add(int(float(st["step"])))
    if len(steps) > 1:
        raise StateError(f"parameters of one rank are at different Adam steps {sorted(steps)}")
    return steps.pop() if steps else 0


def set_optimizer_step(state: TrainingState, step: int) -> None:
    """Set the Adam step of every parameter's state on this rank."""
    value = torch.tensor(float(step), dtype=torch.float32)
    for sub in _sub_optimizers(state.optimizer):
        for st in sub.optimizer.state.values():
            if "step" in st:
                st["step"] = value.clone()


def resume_state(state: TrainingState) -> ResumeState:
    return ResumeState(optimizer_step(state), bytes(torch.get_rng_state().numpy().tobytes()))


_RESUME_HEADER = 16  # has-state flag (8 bytes) + step (8 bytes)


def rng_source(old: ParallelConfig, new: ParallelConfig, new_rank: int,
               num_layers: int) -> int:
    """The old rank whose generator a new rank continues: same tp and dp coordinates (modulo
    the old degrees), on the old stage that held the new stage's first layer."""
    t, d, p = new.coords(new_rank)
    first_layer = p * (num_layers // new.pp)
    return old.rank(t % old.tp, d % old.dp, first_layer // (num_layers // old.pp))


def exchange_resume_state(plan: Any, transport: Any, device: int, local: ResumeState | None,
                          timeout_s: float = 120.0) -> ResumeState | None:
    """Share step and RNG over the migration group; returns this process's new ResumeState.

    Collective over the migration group (one fixed-size allgather on its control channel).
    Every old rank contributes its state; the steps must all be equal. A new rank gets that
    step and the generator of its :func:`rng_source`; departing processes get None.

    Raises:
        StateError: old ranks disagree on the step (they were not paused at one boundary).
    """
    payload = np.zeros(_RESUME_HEADER + RNG_BYTES, np.uint8)
    if local is not None:
        payload[:16] = np.frombuffer(np.array([1, local.step], "<i8").tobytes(), np.uint8)
        payload[16:] = np.frombuffer(local.rng, np.uint8)
    table = transport.allgather(torch.from_numpy(payload), timeout_s).numpy()
    devices = tuple(sorted(set(plan.old.devices) | set(plan.new.devices)))
    heads = table[:, :16].copy().view("<i8")
    old_steps = {}
    for old_rank, dev in enumerate(plan.old.devices):
        flag, step = heads[devices.index(dev)]
        if not flag:
            raise StateError(f"old rank {old_rank} (device {dev}) sent no step/RNG state")
        old_steps[old_rank] = int(step)
    if len(set(old_steps.values())) != 1:
        raise StateError(f"old ranks are at different steps: {old_steps}")
    if device not in plan.new.devices:
        return None
    new_rank = plan.new.devices.index(device)
    src = rng_source(plan.old.config, plan.new.config, new_rank, plan.catalog.model.num_layers)
    row = table[devices.index(plan.old.devices[src])]
    return ResumeState(old_steps[src], row[16:].tobytes())


# -- building views for a new layout --------------------------------------------------------

def build_empty_state(model: ModelDesc, config: ParallelConfig) -> TrainingState:
    """Model, DDP wrapper and optimizer for ``config``, without drawing initial weights.

    What a resize needs on the new layout: the structures, to be filled by
    :func:`install_shards` (or a checkpoint load). Same wiring as
    ``build.build_training_state`` (which also re-draws every weight and trains), with
    ``perform_initialization=False``; call inside an initialised default group of
    ``config.world`` ranks; :func:`build.teardown` undoes it. If megatron's model parallel
    state is already initialised for the same tp and pp, it is shared.
    """
    from megatron.core import parallel_state

    from . import build

    config.validate_for(model, devices=torch.distributed.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        # A second state in the same layout (e.g. a checkpoint loaded beside a migrated one)
        # shares megatron's groups.
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if have != (config.tp, config.pp):
            raise StateError(f"megatron is initialised for tp={have[0]}, pp={have[1]}, not "
                             f"{config}: tear it down first")
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=config.tp,
                                                 pipeline_model_parallel_size=config.pp)
    try:
        return build.build_modules(model, config, seed=None)
    except BaseException:
        build.teardown()
        raise


# -- resize in place ------------------------------------------------------------------------

@dataclass
class PreparedResize:
    """One process's side of a resize, connected and allocated before the pause.

    Attributes:
        plan: the MigrationPlan.
        device: this process's device.
        store, tag: the rendezvous store and this resize's key prefix (the new training
            group starts from them).
        group: the migration group (gloo backends of its own, outside the training groups).
        program: this process's part of the plan.
        destinations: the new shards' tensors, pages touched (empty on a departing process).
        options: the executor's options.
        memory: peak memory measurement, started here, stopped at the commit.
        group_timeout_s: timeout of the migration and new training groups.
        seconds: wall time of the preparation steps (``group``, ``allocate``).
    """

    plan: Any
    device: int
    store: Any
    tag: str
    group: Any
    program: Any
    destinations: list[torch.Tensor]
    options: Any
    memory: Any
    group_timeout_s: float
    seconds: dict = field(default_factory=dict)


def prepare_resize(plan: Any, device: int, store: Any, *, tag: str, options: Any = None,
                   group_timeout_s: float = 300.0, prefault: bool = True) -> PreparedResize:
    """What an in-place resize can do while the old layout still trains (collective over
    old ∪ new): connect the migration group from ``store`` (keys under ``tag``; the training
    groups stay untouched), compile this process's part of the plan, allocate the tensors the
    new shards arrive in and touch their pages (``prefault``). Nothing of the training state
    is read: training may go on until the pause. Memory is measured from here to the commit:
    the destinations are the new state the two-phase migration holds beside the old one.
    """
    import torch.distributed as dist

    from slurm_etc.migrate.executor import MigrationOptions, allocate_destinations
    from slurm_etc.migrate.group import connect_migration_group
    from slurm_etc.migrate.memory import PeakMemory
    from slurm_etc.migrate.program import compile_program

    options = options or MigrationOptions()
    seconds: dict[str, float] = {}
    memory = PeakMemory(torch.device("cpu"))
    if options.measure_memory:
        memory.start()
    t = time.perf_counter()
    group = connect_migration_group(plan, device, dist.PrefixStore(f"{tag}/migrate", store),
                                    timeout_s=group_timeout_s)
    seconds["group"] = time.perf_counter() - t
    t = time.perf_counter()
    program = compile_program(plan, device, options.staging_bytes, options.direct_min_bytes)
    destinations = allocate_destinations(program, options, prefault=prefault)
    seconds["allocate"] = time.perf_counter() - t
    return PreparedResize(plan, device, store, tag, group, program, destinations, options,
                          memory, group_timeout_s, seconds)


@dataclass
class ResizeOutcome:
    """One process's side of an in-place resize.

    Attributes:
        state: the new TrainingState (None on a departing process).
        resume: the step and RNG state installed (None when departing).
        stats: the executor's MigrationStats as a dict (memory: from the preparation to the
            commit).
        seconds: wall time of each phase on this process (``pause`` is when it started,
            ``ready`` when it finished, both ``time.time()``).
    """

    state: TrainingState | None
    resume: ResumeState | None
    new_shards: list[LocalShard]
    stats: dict
    seconds: dict = field(default_factory=dict)


def resize_in_place(prepared: PreparedResize, state: TrainingState | None, *,
                    keep_shards: bool = False, faults: Any = None) -> ResizeOutcome:
    """Move this process's training state from ``plan.old`` to ``plan.new``: the pause.

    Every process of old ∪ new calls it at the same step boundary after
    :func:`prepare_resize`: old ranks with their ``state`` (built under ``plan.old.config``
    in the current default group), joining processes with None. Phases: read the shards
    (views) and ResumeState; exchange step and RNG; run the executor into the prepared
    destinations (two-phase: raises ``MigrationAborted`` everywhere if anything failed, the
    old state and its training groups untouched, training can go on); drop the old training
    groups and state; on new ranks start the new training group, build the new model and
    optimizer around the received tensors (adopted where megatron allows, else copied).

    Args:
        prepared: this process's :func:`prepare_resize`.
        state: this process's TrainingState under ``plan.old.config``, or None.
        keep_shards: keep a copy of the executor's new shards, as received, in the outcome
            (verification); otherwise they live on only inside the installed state.
        faults: a ``FaultInjector`` for the executor (tests).

    Raises:
        MigrationAborted: on every process if any failed; ``state`` and its training groups
            are untouched and the job can train on in the old layout.
    """
    import torch.distributed as dist

    from slurm_etc.migrate.executor import execute_migration

    plan, device, options = prepared.plan, prepared.device, prepared.options
    seconds: dict[str, float] = {"pause": time.time()}
    t = time.perf_counter()
    catalog = plan.catalog
    old_shards = local_shards(state, catalog) if state is not None else []
    resume = resume_state(state) if state is not None else None
    transport = prepared.group.transport()
    new_resume = exchange_resume_state(plan, transport, device, resume)
    seconds["resume"] = time.perf_counter() - t
    t = time.perf_counter()
    try:
        result = execute_migration(plan, transport, device, old_shards,
                                   options=dataclasses.replace(options, measure_memory=False),
                                   program=prepared.program,
                                   destinations=prepared.destinations, faults=faults)
    finally:
        prepared.destinations = []
        prepared.group.destroy()
        if options.measure_memory:
            prepared.memory.stop()
    seconds["migrate"] = time.perf_counter() - t
    stats = result.stats
    stats.memory_base, stats.memory_peak = prepared.memory.base, prepared.memory.peak
    stats.memory_peak_delta = prepared.memory.peak_delta
    stats.memory_reset = prepared.memory.reset
    # committed: the old layout is gone
    del old_shards, state
    t = time.perf_counter()
    _drop_training_groups()
    new_state = None
    if result.new_rank is not None:
        cfg = plan.new.config
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{prepared.tag}/train",
                                                               prepared.store),
                                rank=result.new_rank, world_size=cfg.world,
                                timeout=_timedelta(prepared.group_timeout_s))
        seconds["train_group"] = time.perf_counter() - t
        t = time.perf_counter()
        new_state = build_empty_state(catalog.model, cfg)
        seconds["rebuild"] = time.perf_counter() - t
        # verification keeps what arrived apart from what install adopts or copies
        kept = ([LocalShard(sh.state_key, sh.lo, sh.hi, sh.s, sh.tensor.clone())
                 for sh in result.new_shards] if keep_shards else [])
        t = time.perf_counter()
        installed = install_shards(new_state, catalog, result.new_shards, new_resume)
        seconds["install"] = time.perf_counter() - t
    else:
        kept, installed = [], {}
    result.new_shards = []
    seconds["ready"] = time.time()
    return ResizeOutcome(new_state, new_resume, kept, {**stats.as_dict(), **installed},
                         seconds)


def _drop_training_groups() -> None:
    """Destroy every process group of this process (the default group included) and reset
    megatron's parallel state, in one go: cheaper than ``build.teardown`` (no per-group
    destroy, no garbage collection), for the moment when downtime counts."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized():
        dist.destroy_process_group()
    parallel_state.destroy_model_parallel()


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


# -- oracles --------------------------------------------------------------------------------

def shard_bits(shards: Iterable[LocalShard]) -> dict[tuple, np.ndarray]:
    """Shard key -> its raw bits as a numpy integer array (bf16 as int16), a copy."""
    return {sh.key: _bits(sh.tensor).numpy().copy() for sh in shards}


@dataclass
class Globals:
    """Full global tensors assembled from a layout's shards (raw bits, three axes)."""

    tensors: dict[str, np.ndarray]
    problems: list[str]


def _padded_shape(catalog: Catalog, key: str) -> tuple[tuple[int, int, int], int]:
    for g in catalog.groups:
        for st in g.states:
            if st.key == key:
                shape = tuple(g.shape) + (1,) * (3 - len(g.shape))
                return shape, st.itemsize  # type: ignore[return-value]
    raise KeyError(key)


def _box_view(arr: np.ndarray, lo, hi) -> np.ndarray:
    return arr[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]


def assemble_globals(catalog: Catalog, per_rank: Iterable[Mapping[tuple, np.ndarray]]
                     ) -> Globals:
    """Put every rank's shards (``shard_bits``) together into global tensors.

    Independent of the executor: only boxes and intervals. Checks that every copy of an
    element (dp and tp replicas, tied copies) has the same bits and that every element of
    every tensor is held by some rank.
    """
    tensors: dict[str, np.ndarray] = {}
    filled: dict[str, np.ndarray] = {}
    problems: list[str] = []
    for rank, shards in enumerate(per_rank):
        for (key, lo, hi, s), bits in shards.items():
            if key not in tensors:
                shape, itemsize = _padded_shape(catalog, key)
                tensors[key] = np.zeros(shape, _NP_INT[itemsize])
                filled[key] = np.zeros(shape, bool)
            idx = _box_indices(tensors[key].shape, lo, hi)[s:s + len(bits)]
            _merge(tensors[key].reshape(-1), filled[key].reshape(-1), idx, bits, key, rank,
                   problems)
    for key, f in filled.items():
        if not f.all():
            problems.append(f"{key}: {int((~f).sum())} of {f.size} elements held by no rank")
    return Globals(tensors, problems)


def _box_indices(shape, lo, hi) -> np.ndarray:
    grids = np.ix_(*[np.arange(a, b) for a, b in zip(lo, hi)])
    return np.ravel_multi_index(grids, shape).reshape(-1)


def _merge(dst: np.ndarray, have: np.ndarray, idx: np.ndarray, bits: np.ndarray, key: str,
           rank: int, problems: list[str]) -> None:
    seen = have[idx]
    differ = seen & (dst[idx] != bits)
    if differ.any() and len(problems) < 20:
        problems.append(f"{key}: rank {rank} holds {int(differ.sum())} elements whose bits "
                        "differ from another rank's copy")
    dst[idx] = bits
    have[idx] = True


def expected_shards(catalog: Catalog, config: ParallelConfig, rank: int,
                    globals_: Globals) -> dict[tuple, np.ndarray]:
    """The shards rank ``rank`` of ``config`` must hold, cut out of the global tensors."""
    out = {}
    for sp in shard_specs(catalog, region_table(catalog, config), rank):
        arr = globals_.tensors[sp.state_key]
        box = np.ascontiguousarray(_box_view(arr, sp.lo, sp.hi)).reshape(-1)
        out[sp.key] = box[sp.s:sp.e]
    return out


def compare_shards(got: Mapping[tuple, np.ndarray], want: Mapping[tuple, np.ndarray],
                   limit: int = 10) -> list[dict]:
    """Shards whose bits differ (or that are missing on either side), first element named."""
    out = []
    for key in sorted(set(got) | set(want)):
        a, b = got.get(key), want.get(key)
        if a is None or b is None:
            out.append({"state_key": key[0], "lo": list(key[1]), "hi": list(key[2]),
                        "s": key[3], "problem": "missing" if a is None else "unexpected"})
        elif a.shape != b.shape or a.dtype != b.dtype:
            out.append({"state_key": key[0], "lo": list(key[1]), "hi": list(key[2]),
                        "s": key[3], "problem": f"{a.size} x {a.dtype} vs {b.size} x {b.dtype}"})
        else:
            bad = np.flatnonzero(a != b)
            if len(bad):
                i = int(bad[0])
                out.append({"state_key": key[0], "lo": list(key[1]), "hi": list(key[2]),
                            "s": key[3], "differing": int(len(bad)), "of": int(a.size),
                            "first": i, "got": int(a[i]), "expected": int(b[i])})
        if len(out) >= limit:
            break
    return out

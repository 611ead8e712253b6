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
* :func:`build_empty_state`: the model and optimizer of a new layout, to be filled.

:mod:`.resize` strings these together into an in-place resize; :mod:`.oracles` holds the
references ``slurm-etc verify`` checks a migrated state against.

megatron-core is imported lazily; on CPU install :mod:`.cpu_compat` first.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slurm_etc.migrate.shards import LocalShard, shard_specs
from slurm_etc.plan.catalog import EXPERT_PREFIX, TIED_SUFFIX, Catalog
from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.model import ModelDesc
from slurm_etc.plan.plan import MigrationPlan
from slurm_etc.plan.regions import chunk_layers, layer_place, region_table

from ..errors import InternalError
from .build import TrainingState
from .shards import iter_sharded_tensors

logger = logging.getLogger(__name__)

Box3 = tuple[int, int, int]
EMBEDDING = "embedding.word_embeddings.weight"
OPT_PREFIX = "optimizer.state."
# Optimizer states a catalog may list, and where each lives in megatron's optimizers.
FP32_PARAM, EXP_AVG, EXP_AVG_SQ = "fp32_param", "exp_avg", "exp_avg_sq"
_INT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class StateError(InternalError, RuntimeError):
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
    if sh.key.startswith(EXPERT_PREFIX):
        # SequentialMLP's (layer, expert, ...) folded into the catalog's first axis: one
        # expert of one layer a piece (catalog.py)
        experts = sh.global_shape[1]
        lo = [lo[0] * experts + lo[1], *lo[2:]]
        hi = [lo[0] + 1, *hi[2:]]
    if len(lo) > 3:
        raise StateError(f"{sh.key}: {len(lo)} axes, the catalog has at most 3")
    lo += [0] * (3 - len(lo))
    hi += [1] * (3 - len(hi))
    return (lo[0], lo[1], lo[2]), (hi[0], hi[1], hi[2])


class _ParamIndex:
    """Finds the parameter a contiguous view lies in, by address: the parameters grouped by
    storage and dtype, sorted by their first element (one bisection per view instead of a
    scan over every parameter sharing DDP's one buffer)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        groups: dict[tuple[int, torch.dtype], list[tuple[int, int, torch.Tensor]]] = {}
        for i, p in enumerate(params):
            groups.setdefault((p.untyped_storage().data_ptr(), p.dtype), []).append(
                (p.data_ptr(), i, p))
        self._groups = {k: sorted(v, key=lambda e: (e[0], e[1])) for k, v in groups.items()}
        self._starts = {k: [e[0] for e in v] for k, v in self._groups.items()}

    def locate(self, data: torch.Tensor, key: str) -> tuple[Any, int]:
        """(parameter, element offset) of ``data``, a contiguous view of one parameter."""
        if not data.is_contiguous():
            raise StateError(f"{key}: the sharded tensor is not a contiguous view of a "
                             "parameter")
        group = (data.untyped_storage().data_ptr(), data.dtype)
        ptr = data.data_ptr()
        starts = self._starts.get(group, [])
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0:
            start, _, p = self._groups[group][i]
            off, rem = divmod(ptr - start, p.element_size())
            if rem == 0 and off + data.numel() <= p.numel():
                if not p.is_contiguous():
                    raise StateError(f"{key}: parameter is not contiguous")
                return p, off
        raise StateError(f"{key}: sharded tensor data is not part of any model parameter")


# A rewrite of a live state's pieces before the shards are cut from them (what this process
# tells the plan it holds): where tests plant bugs (:mod:`slurm_etc.testing.plants`); None in
# real runs.
Relabel = Callable[[TrainingState, list[ParamPiece]], list[ParamPiece]]


def param_pieces(state: TrainingState) -> list[ParamPiece]:
    """Every model ShardedTensor of this rank as a piece of one of its parameters, over
    every virtual pipeline chunk (each chunk's ShardedTensors carry global layer offsets)."""
    tied = state.model_desc.tied_embeddings
    pieces = []
    for gpt in state.gpts:
        out_layer = getattr(gpt, "output_layer", None)
        out_weight = getattr(out_layer, "weight", None) if out_layer is not None else None
        sharded = list(iter_sharded_tensors(gpt.sharded_state_dict()))
        # plain tensor queries (addresses, sizes): without the CPU compatibility mode's
        # Python wrapper around each of them
        with torch._C.DisableTorchFunction():
            index = _ParamIndex(list(gpt.parameters()))
            for _path, sh in sharded:
                param, offset = index.locate(sh.data, sh.key)
                key = sh.key
                if tied and key == EMBEDDING and out_weight is not None and param is out_weight:
                    key += TIED_SUFFIX  # the last stage's copy of the embedding (pp > 1)
                lo, hi = _box(sh)
                pieces.append(ParamPiece(key, param, offset, sh.data.numel(), lo, hi))
                if tied and key == EMBEDDING and state.config.pp == 1:
                    pieces.append(ParamPiece(key + TIED_SUFFIX, param, offset,
                                             sh.data.numel(), lo, hi, alias=True))
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


def sub_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers inside megatron's chained optimizer (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _opt_entries(state: TrainingState) -> dict[int, _OptEntry]:
    """id(model parameter) -> its optimizer entry, for every parameter with state here."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    entries: dict[int, _OptEntry] = {}
    for sub in sub_optimizers(state.optimizer):
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
        # fixed at construction: release() may empty the tensor until adopt() refills it
        self._shape = param.shape if kind == "param" else self.opt.main.shape

    @property
    def opt(self) -> _OptEntry:
        """The optimizer entry of an optimizer-state target."""
        if self.entry is None:
            raise StateError(f"a {self.kind} target without an optimizer entry")
        return self.entry

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def numel(self) -> int:
        return self._shape.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype if self.kind == "param" else torch.float32

    @property
    def device(self) -> torch.device:
        """Where the tensor lives (a parameter's device: its optimizer state is beside it)."""
        return self.param.device if self.kind == "param" else self.opt.main.device

    def base(self) -> torch.Tensor | None:
        """The live tensor (None: no Adam state yet)."""
        if self.kind == "param":
            return self.param
        if self.kind == FP32_PARAM:
            return self.opt.main
        return self.opt.inner.state.get(self.opt.main, {}).get(self.kind)

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
            self.opt.main.data = value
        else:
            self.opt.inner.state[self.opt.main][self.kind] = value

    def release(self) -> None:
        """Give the tensor's memory back until :meth:`adopt` puts another one in (an empty
        tensor stands in; an Adam moment is simply not created)."""
        if self.kind == "param":
            self.param.data = torch.empty(0, dtype=self.param.dtype, device=self.param.device)
        elif self.kind == FP32_PARAM:
            self.opt.main.data = torch.empty(0, dtype=self.opt.main.dtype,
                                             device=self.opt.main.device)

    def allocate(self) -> None:
        """Fresh (uninitialised) Adam moment; every element is then written."""
        if self.base() is None:
            self.opt.inner.state[self.opt.main][self.kind] = torch.empty(
                self.shape, dtype=torch.float32, device=self.opt.main.device)


@dataclass(frozen=True)
class _Slot:
    """One shard's place in the live state: flat elements ``[a, b)`` of ``target``."""

    key: tuple[str, Box3, Box3, int]
    target: _Target
    a: int
    b: int
    alias: bool


def _slots(state: TrainingState, catalog: Catalog, model_only: bool = False,
           relabel: Relabel | None = None) -> list[_Slot]:
    """Where every shard of this rank lives (``model_only``: leave the optimizer out;
    ``relabel``: rewrites the pieces first, a planted bug)."""
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
    pieces = param_pieces(state)
    for pc in (pieces if relabel is None else relabel(state, pieces)):
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


def local_shards(state: TrainingState, catalog: Catalog, *, model_only: bool = False,
                 relabel: Relabel | None = None) -> list[LocalShard]:
    """This rank's shards of every catalog tensor, as views of the live state (no copies);
    ``model_only``: the parameters alone; ``relabel``: rewrites the state's pieces before
    the shards are cut from them (tests plant bugs there; None in real runs).

    Raises:
        StateError: the state has a tensor the catalog does not know, or lacks Adam state.
    """
    out = []
    for sl in _slots(state, catalog, model_only=model_only, relabel=relabel):
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
            entries = {id(e.main): e for sl in slots if (e := sl.target.entry) is not None}
            for entry in entries.values():
                st = entry.inner.state[entry.main]
                st["step"] = _step_tensor(resume.step, st.get("step"))
            torch.set_rng_state(_host_bytes(resume.rng))
    return {"tensors": len(slots), "adopted": adopted, "copied_bytes": copied}


@dataclass
class Destinations:
    """A new layout's state, built before the pause, as the executor's destinations.

    Attributes:
        tensors: one per ``program.new_specs`` entry: a contiguous view of the live tensor
            the shard belongs in (a parameter, an fp32 main parameter, an Adam moment, or a
            slice of the DistributedOptimizer's flat parameter buffer); a separate tensor
            for the second name of tied embeddings (checked equal at install); None for a
            shard kept whole (the executor hands back the old tensor).
        adopt: kept shard index -> the target that takes the old tensor over at install
            (its own memory was released here: no copy, no second allocation).
        copy: kept shard index -> the view the old tensor is copied into at install.
        alias: shard index -> (target, start, end): the live elements a received second
            name must equal (read at install, after any adoption).
        bytes: bytes of live tensors the shards are received into.
    """

    tensors: list[torch.Tensor | None]
    adopt: dict[int, _Target]
    copy: dict[int, torch.Tensor]
    alias: dict[int, tuple[_Target, int, int]]
    bytes: int = 0


def receive_into(state: TrainingState, catalog: Catalog, specs: Sequence[Any],
                 kept: Collection[int] = (), *, prefault: bool = True) -> Destinations:
    """The executor's destinations inside ``state`` (built for the new layout, not trained):
    the migration writes the new shards straight into the model and optimizer, no copy at
    install. Adam moments are created here. A shard in ``kept`` (an old shard of this
    process, whole) gets no destination: at install it is adopted where it alone covers a
    tensor that may be replaced (that tensor's memory is released now), else copied.
    ``prefault`` writes every destination page once (fresh memory halves the receive rate).

    Raises:
        StateError: the specs and the state's slots differ (missing, unexpected, misshapen).
    """
    slots = {sl.key: sl for sl in _slots(state, catalog)}
    want = {sp.key for sp in specs}
    if set(slots) != want:
        missing, extra = sorted(want - set(slots)), sorted(set(slots) - want)
        raise StateError(f"the new state's shards differ from the program's: "
                         f"{len(missing)} missing (e.g. {missing[:1]}), {len(extra)} "
                         f"unexpected (e.g. {extra[:1]})")
    per_target: dict[int, list[_Slot]] = {}
    for sl in slots.values():
        if not sl.alias:
            per_target.setdefault(id(sl.target), []).append(sl)
    index = {sp.key: j for j, sp in enumerate(specs)}
    adopt: dict[int, _Target] = {}
    released: set[int] = set()
    for group in per_target.values():
        j = index[group[0].key]
        tgt = group[0].target
        if (len(group) == 1 and j in kept and tgt.can_adopt()
                and group[0].b - group[0].a == tgt.numel):
            adopt[j] = tgt
            released.add(id(tgt))
            tgt.release()
    out: list[torch.Tensor | None] = []
    copy: dict[int, torch.Tensor] = {}
    alias: dict[int, tuple[_Target, int, int]] = {}
    nbytes = 0
    with torch.no_grad():
        for group in per_target.values():
            tgt = group[0].target
            if id(tgt) in released:
                continue
            if tgt.kind in (EXP_AVG, EXP_AVG_SQ):
                tgt.allocate()
            if prefault:
                tgt.flat(group[0].key).view(torch.uint8).zero_()
        for j, sp in enumerate(specs):
            sl = slots[sp.key]
            if sl.alias:
                alias[j] = (sl.target, sl.a, sl.b)
                if j in kept:
                    out.append(None)
                    continue
                t = torch.empty(sp.numel, dtype=sl.target.dtype, device=sl.target.device)
                if prefault:
                    t.view(torch.uint8).zero_()
                out.append(t)
                continue
            if j in kept:
                out.append(None)
                if j not in adopt:
                    copy[j] = sl.target.flat(sl.key)[sl.a:sl.b]
                continue
            view = sl.target.flat(sl.key)[sl.a:sl.b]
            out.append(view)
            nbytes += view.numel() * view.element_size()
    return Destinations(out, adopt, copy, alias, nbytes)


def finish_install(state: TrainingState, dest: Destinations, shards: Sequence[LocalShard],
                   resume: ResumeState | None) -> dict:
    """After the commit, on a state the migration wrote into (:func:`receive_into`): adopt or
    copy the kept shards, check every second name of tied embeddings, set step and RNG.

    Returns:
        ``{"tensors": shards, "adopted": tensors adopted, "copied_bytes": bytes copied}``.

    Raises:
        StateError: a tied output layer differs from the embedding it aliases.
    """
    copied = 0
    with torch.no_grad():
        for j, tgt in dest.adopt.items():
            tgt.adopt(shards[j].tensor)
        for j, view in dest.copy.items():
            src = shards[j].tensor.detach().reshape(-1)
            if src.data_ptr() == view.data_ptr():
                continue  # placed there before the pause (placement.py)
            view.copy_(src)
            copied += view.numel() * view.element_size()
        for j, (tgt, a, b) in dest.alias.items():
            if not torch.equal(_bits(tgt.flat(shards[j].key)[a:b]), _bits(shards[j].tensor)):
                raise StateError(f"{shards[j].key} differs from the embedding it aliases")
        if resume is not None:
            set_resume(state, resume)
    return {"tensors": len(shards), "adopted": len(dest.adopt), "copied_bytes": copied}


def set_resume(state: TrainingState, resume: ResumeState) -> None:
    """Install step (every parameter's Adam state) and the CPU generator."""
    for sub in sub_optimizers(state.optimizer):
        for st in sub.optimizer.state.values():
            st["step"] = _step_tensor(resume.step, st.get("step"))
    torch.set_rng_state(_host_bytes(resume.rng))


def _step_tensor(step: int, like: Any) -> torch.Tensor:
    """Adam's step as a float32 tensor where the optimizer keeps it: beside the one it
    replaces (a fused or capturable Adam keeps it on the GPU), else on the host (torch's
    Adam)."""
    device = like.device if isinstance(like, torch.Tensor) else torch.device("cpu")
    return torch.tensor(float(step), dtype=torch.float32, device=device)


def _host_bytes(payload: bytes) -> torch.Tensor:
    """``payload`` as a uint8 host tensor (a generator's state is one)."""
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


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
    for sub in sub_optimizers(state.optimizer):
        for st in sub.optimizer.state.values():
            if "step" in st:
                steps.add(int(float(st["step"])))
    if len(steps) > 1:
        raise StateError(f"parameters of one rank are at different Adam steps {sorted(steps)}")
    return steps.pop() if steps else 0


def set_optimizer_step(state: TrainingState, step: int) -> None:
    """Set the Adam step of every parameter's state on this rank."""
    for sub in sub_optimizers(state.optimizer):
        for st in sub.optimizer.state.values():
            if "step" in st:
                st["step"] = _step_tensor(step, st["step"])


def resume_state(state: TrainingState) -> ResumeState:
    return ResumeState(optimizer_step(state), bytes(torch.get_rng_state().numpy().tobytes()))


_RESUME_HEADER = 16  # has-state flag (8 bytes) + step (8 bytes)


def rng_source(old: ParallelConfig, new: ParallelConfig, new_rank: int,
               num_layers: int, *, lost_ranks: Collection[int] = ()) -> int:
    """The old rank whose generator a new rank continues: same tp and dp coordinates (modulo
    the old degrees), on the old stage that held the new stage's first layer (the first
    layer of its first virtual pipeline chunk).

    If that old rank is in ``lost_ranks`` (its device died: it sent no generator), the new
    rank continues the generator of the surviving old rank with the same tp and pp
    coordinates and the lowest dp coordinate.

    Raises:
        StateError: every old rank with those tp and pp coordinates is lost (the planner
            refuses such a resize first: their model shard is lost too).
    """
    t, d, p = new.coords(new_rank)
    first_layer = chunk_layers(num_layers, new.pp, new.vpp, p, 0)[0]
    ot, op = t % old.tp, layer_place(num_layers, old.pp, old.vpp, first_layer)[0]
    src = old.rank(ot, d % old.dp, op)
    if src not in lost_ranks:
        return src
    for od in range(old.dp):
        if old.rank(ot, od, op) not in lost_ranks:
            return old.rank(ot, od, op)
    raise StateError(f"new rank {new_rank}: every old rank with tp={ot}, pp={op} of {old} is "
                     f"lost (old ranks {sorted(lost_ranks)}): no generator to continue")


def plan_rng_source(plan: MigrationPlan, new_rank: int) -> int:
    """:func:`rng_source` of a new rank of ``plan``, around the plan's lost devices."""
    return rng_source(plan.old.config, plan.new.config, new_rank,
                      plan.catalog.model.num_layers,
                      lost_ranks=frozenset(getattr(plan, "lost_old_ranks", ())))


def exchange_resume_state(plan: MigrationPlan, transport: Any, device: int,
                          local: ResumeState | None,
                          timeout_s: float = 120.0) -> ResumeState | None:
    """Share step and RNG over the migration group; returns this process's new ResumeState.

    Collective over the migration group (one fixed-size allgather on its control channel).
    Every surviving old rank contributes its state; the steps must all be equal. Lost old
    ranks (``plan.lost``) take no part and send nothing. A new rank gets that step and the
    generator of its :func:`plan_rng_source` (a surviving old rank); departing processes
    get None.

    Raises:
        StateError: old ranks disagree on the step (they were not paused at one boundary).
    """
    payload = np.zeros(_RESUME_HEADER + RNG_BYTES, np.uint8)
    if local is not None:
        payload[:16] = np.frombuffer(np.array([1, local.step], "<i8").tobytes(), np.uint8)
        payload[16:] = np.frombuffer(local.rng, np.uint8)
    table = transport.allgather(torch.from_numpy(payload), timeout_s).numpy()
    devices = tuple(plan.participants)
    lost = set(getattr(plan, "lost", ()))
    heads = table[:, :16].copy().view("<i8")
    old_steps = {}
    for old_rank, dev in enumerate(plan.old.devices):
        if dev in lost:
            continue
        flag, step = heads[devices.index(dev)]
        if not flag:
            raise StateError(f"old rank {old_rank} (device {dev}) sent no step/RNG state")
        old_steps[old_rank] = int(step)
    if len(set(old_steps.values())) != 1:
        raise StateError(f"old ranks are at different steps: {old_steps}")
    if device not in plan.new.devices:
        return None
    new_rank = plan.new.devices.index(device)
    src = plan_rng_source(plan, new_rank)
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
        if not build.parallel_state_matches(config):
            have = (parallel_state.get_tensor_model_parallel_world_size(),
                    parallel_state.get_pipeline_model_parallel_world_size(),
                    parallel_state.get_expert_model_parallel_world_size())
            raise StateError(f"megatron is initialised for tp={have[0]}, pp={have[1]}, "
                             f"ep={have[2]}, not {config}: tear it down first")
    else:
        build.initialize_parallel_state(config)
    try:
        return build.build_modules(model, config, seed=None)
    except BaseException:
        build.teardown()
        raise

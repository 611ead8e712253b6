"""Move a live megatron-core state to a layout with other ep / vpp (and dp / tp / pp) degrees,
in the same processes, over torch.distributed point to point: no checkpoint, no restart.

The shard catalog and region tables of :mod:`slurm_etc.plan` (which the executor path of
:mod:`.resize` runs on) describe dp/tp/pp layouts of dense models; experts sharded over ep and
vpp's chunks are not in them yet. This module moves such states with the one description
megatron-core itself gives of every layout: the ``ShardedTensor`` boxes of each rank's
``sharded_state_dict()`` (global key, offset and shape, in as many axes as the tensor has:
experts are ``(layer, expert, rows, cols)`` boxes held by their ep rank; a vpp chunk's layers
carry their global layer offsets), for the model and, with the non-distributed optimizer, its
Adam moments (the same boxes). The steps, on every process of the one default group both
layouts span (same world size):

1. read the old state's pieces (zero-copy views, kept alive) and its Adam step;
2. drop the old modules and megatron's groups (:func:`.build.teardown`), build the empty new
   state (:func:`.state.build_empty_state`, Adam state allocated);
3. every rank publishes its pieces' metadata (JSON bytes over an all-gather, no pickle);
   every rank computes the same list of moves (:func:`.shards.plan_box_moves`: each new box
   from the intersecting main-replica old boxes, covered exactly once);
4. one coalesced message per (source, destination) pair, ``batch_isend_irecv``; a move
   inside one process is a copy.

What it does not do (yet): the distributed optimizer's flat buffers (refused: ConfigError),
mixed precision's fp32 main parameters (refused), cp (megatron's local attention has none),
joiners or leavers (old and new layouts on the same processes), and the prepared-world overlap
of :mod:`.world` (the new state is built during the pause).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import ModelDesc

from .build import TrainingState
from .shards import BoxMove, PieceMeta, plan_box_moves

logger = logging.getLogger(__name__)

OPT_PREFIX = "optimizer.state."
ADAM_STATES = ("exp_avg", "exp_avg_sq")
# A hook over one old rank's piece metadata before it is published: where planted bugs go
# (tests); None in real runs.
Relabel = Callable[[list[PieceMeta]], list[PieceMeta]]


@dataclass
class Piece:
    """One box of one state tensor held by this rank: ``tensor`` viewed with the box's shape."""

    meta: PieceMeta
    tensor: torch.Tensor


def refuse(model: ModelDesc, old: ParallelConfig, new: ParallelConfig) -> None:
    """One line for the transitions this mover cannot do.

    Raises:
        ConfigError: different world sizes, the distributed optimizer, or mixed precision.
    """
    if old.world != new.world:
        raise ConfigError(f"{old} -> {new}: the live reshard keeps the processes "
                          f"({old.world} -> {new.world} ranks)")
    if old.distributed_optimizer or new.distributed_optimizer:
        raise ConfigError(f"{old} -> {new}: the live reshard moves model-space optimizer "
                          "state only (not the distributed optimizer's flat buffers)")
    if model.mixed_precision:
        raise ConfigError(f"{model.name}: the live reshard moves fp32 states only "
                          f"(param_dtype {model.param_dtype})")


def _adam_states(state: TrainingState) -> dict[int, dict[str, torch.Tensor]]:
    """id(parameter) -> its Adam moments, for every sub-optimizer's torch Adam."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for sub in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                moments = sub.optimizer.state.get(param, {})
                out[id(param)] = {n: moments[n] for n in ADAM_STATES if n in moments}
    return out


def _allocate_adam_states(state: TrainingState) -> None:
    """Give every parameter of a fresh (never stepped) torch Adam its moments and step, as its
    first step would, so that they can be received into."""
    for sub in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                sub.optimizer.state[param] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}


def local_pieces(state: TrainingState) -> list[Piece]:
    """This rank's pieces: every model ShardedTensor, and each parameter's Adam moments in the
    same box (keys ``optimizer.state.<moment>.<param key>``)."""
    from .shards import iter_sharded_tensors

    moments = _adam_states(state)
    params = {p.data_ptr(): p for gpt in state.gpts for p in gpt.parameters()}
    pieces: list[Piece] = []
    for path, sh in iter_sharded_tensors(state.model_sharded_state_dict()):
        if sh.flattened_range is not None:
            raise ConfigError(f"{sh.key}: flattened shards cannot be moved live")
        meta = PieceMeta.of(path, sh)
        pieces.append(Piece(meta, sh.data.view(meta.shape)))
        param = params.get(sh.data.data_ptr())
        if param is None or param.numel() != sh.data.numel():
            continue  # a view of part of a parameter (no optimizer state of its own)
        for name, tensor in moments.get(id(param), {}).items():
            pieces.append(Piece(meta.renamed(f"{OPT_PREFIX}{name}.{sh.key}",
                                             f"{OPT_PREFIX}{name}.{path}"),
                                tensor.view(meta.shape)))
    return pieces


def _coords(state: TrainingState) -> dict:
    """megatron's tp and dp rank of this process and the (1-based) layers it holds."""
    from megatron.core import parallel_state

    return {"tp": parallel_state.get_tensor_model_parallel_rank(),
            "dp": parallel_state.get_data_parallel_rank(),
            "layers": [int(layer.layer_number) for gpt in state.gpts
                       for layer in gpt.decoder.layers]}


def rng_source(old: Sequence[dict], new: dict) -> int:
    """The old rank whose CPU generator a new rank continues: same tp and dp rank (modulo the
    old degrees) on the rank that held the new rank's first layer.

    Raises:
        ConfigError: no single old rank matches (a layout without layers on some rank).
    """
    old_tp = 1 + max(c["tp"] for c in old)
    old_dp = 1 + max(c["dp"] for c in old)
    first = min(new["layers"])
    match = [r for r, c in enumerate(old) if c["tp"] == new["tp"] % old_tp
             and c["dp"] == new["dp"] % old_dp and first in c["layers"]]
    if len(match) != 1:
        raise ConfigError(f"{len(match)} old ranks match new coordinates {new}")
    return match[0]


def _allgather_json(obj: Any) -> list[Any]:
    """Every rank's JSON-able ``obj``, by rank: bytes over the default group (no pickle)."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, padded)
    return [json.loads(bytes(t[:int(n.item())].tolist()).decode()) for t, n in zip(out, sizes)]


def _region(piece: Piece, lo: Sequence[int], hi: Sequence[int]) -> torch.Tensor:
    index = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, piece.meta.lo))
    return piece.tensor[index]


def execute_moves(moves: Sequence[BoxMove], old: Sequence[Piece], new: Sequence[Piece],
                  rank: int) -> dict:
    """This rank's part of ``moves``: one message per peer each way, copies inside the rank."""
    sends: dict[int, list[BoxMove]] = {}
    recvs: dict[int, list[BoxMove]] = {}
    local = 0
    with torch.no_grad():
        for m in moves:
            if m.src == rank and m.dst == rank:
                _region(new[m.dst_piece], m.lo, m.hi).copy_(_region(old[m.src_piece], m.lo, m.hi))
                local += m.numel
            elif m.src == rank:
                sends.setdefault(m.dst, []).append(m)
            elif m.dst == rank:
                recvs.setdefault(m.src, []).append(m)
        ops, inbox = [], {}
        for peer, ms in sorted(sends.items()):
            buf = torch.cat([_region(old[m.src_piece], m.lo, m.hi).reshape(-1) for m in ms])
            ops.append(dist.P2POp(dist.isend, buf, peer))
        for peer, ms in sorted(recvs.items()):
            inbox[peer] = torch.empty(sum(m.numel for m in ms), dtype=torch.float32)
            ops.append(dist.P2POp(dist.irecv, inbox[peer], peer))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for peer, ms in recvs.items():
            at = 0
            for m in ms:
                dst = _region(new[m.dst_piece], m.lo, m.hi)
                dst.copy_(inbox[peer][at:at + m.numel].view(dst.shape))
                at += m.numel
    sent = sum(m.numel for ms in sends.values() for m in ms)
    received = sum(m.numel for ms in recvs.values() for m in ms)
    return {"local_elements": local, "sent_elements": sent, "received_elements": received,
            "messages_out": len(sends), "messages_in": len(recvs)}


def reshard_live(state: TrainingState, new_config: ParallelConfig, *,
                 relabel: Relabel | None = None) -> tuple[TrainingState, dict]:
    """Move ``state`` to ``new_config`` in these processes (see module docstring).

    Collective over the default group. ``state`` is unusable afterwards (its modules are
    dropped); the caller must hold no other reference to them.

    Raises:
        ConfigError: a transition this mover refuses (:func:`refuse`).
    """
    from . import build
    from .state import build_empty_state, optimizer_step, set_optimizer_step

    model = state.model_desc
    refuse(model, state.config, new_config)
    t0 = time.perf_counter()
    step = optimizer_step(state)
    old_pieces = local_pieces(state)
    if relabel is not None:
        # a wrong label is read the way a right one is: the box is cut from the tensor by it
        old_pieces = [Piece(m, p.tensor)
                      for m, p in zip(relabel([p.meta for p in old_pieces]), old_pieces)]
    old_meta = [p.meta for p in old_pieces]
    old_coords = _coords(state)
    # before anything is built: building the new modules draws from the CPU generator
    rng = torch.get_rng_state().tolist()
    del state
    build.teardown()
    t1 = time.perf_counter()
    new_state = build_empty_state(model, new_config)
    _allocate_adam_states(new_state)
    new_pieces = local_pieces(new_state)
    t2 = time.perf_counter()
    rank = dist.get_rank()
    published = _allgather_json({"old": [m.to_json() for m in old_meta],
                                 "new": [p.meta.to_json() for p in new_pieces],
                                 "old_coords": old_coords, "new_coords": _coords(new_state),
                                 "rng": rng})
    moves = plan_box_moves([[PieceMeta.from_json(m) for m in r["old"]] for r in published],
                           [[PieceMeta.from_json(m) for m in r["new"]] for r in published])
    t3 = time.perf_counter()
    stats = execute_moves(moves, old_pieces, new_pieces, rank)
    del old_pieces
    set_optimizer_step(new_state, step)
    source = rng_source([r["old_coords"] for r in published], published[rank]["new_coords"])
    torch.set_rng_state(torch.tensor(published[source]["rng"], dtype=torch.uint8))
    t4 = time.perf_counter()
    stats.update(moves=len(moves), step=step, rng_source=source, seconds={
        "read_and_teardown": t1 - t0, "build": t2 - t1, "plan": t3 - t2, "data": t4 - t3,
        "total": t4 - t0})
    logger.info("live reshard %s -> %s: %d moves, %.3f s", model.name, new_config, len(moves),
                t4 - t0)
    return new_state, stats


def w_reshard(ctx: Any, new_config: ParallelConfig, *, relabel: Relabel | None = None
              ) -> dict | None:
    """Worker phase: :func:`reshard_live` of live state ``state`` (every worker holding one)."""
    from . import cpu_compat

    state = ctx.objects.pop("state", None)
    if state is None:
        return None
    cpu_compat.install()
    new_state, stats = reshard_live(state, new_config, relabel=relabel)
    del state
    ctx.objects["state"] = new_state
    return stats

"""The GPU-side parts of slurm-etc on one device, in one process: ``python bench/gpu_check.py``.

For each model (a preset) it builds megatron-core's GPT (world size 1) on the device and
trains a few steps (losses finite, step time); takes the shard adapter's views of the
parameters, fp32 main parameters and Adam moments (``state.local_shards``: no copies, on the
device); packs and unpacks the send buffers of a real plan (tp=1 -> tp=2) with the executor's
own pack/unpack, against a plain ``copy_`` of the same bytes; then resizes tp=1 -> tp=2 -> tp=1
with the real executor (``execute_migration``, its destinations allocated on the device by
``allocate_destinations``; the two devices of the tp=2 layout are two threads of this process
on the same device, joined by an in-process transport) and installs the result into an
empty megatron state (``state.install_shards``). The check: every tensor of megatron's own
``sharded_state_dict()`` of the round-tripped state is bit-equal to the original's (read
through megatron, never through the adapter), and the next training step gives the same loss.

What one process cannot show: NCCL between ranks (needs two GPUs) and the multi-process
``resize_in_place`` (rendezvous, votes over the control group). Runs on CPU too (small models,
megatron's CPU patches), which is how the unit test keeps it from rotting.

Prints a table (``--json``: the results as JSON); with ``--out DIR`` (default ``$OUT`` when
set) writes ``gpu_check.json`` there.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurm_etc.megatron import build
from slurm_etc.megatron.state import (
    check_shards,
    install_shards,
    local_shards,
    resume_state,
)
from slurm_etc.migrate.executor import (
    MigrationOptions,
    MigrationStats,
    _check_old_shards,
    _Run,
    allocate_destinations,
    execute_migration,
)
from slurm_etc.migrate.faults import FaultInjector
from slurm_etc.migrate.program import compile_program, group_devices
from slurm_etc.migrate.shards import LocalShard
from slurm_etc.migrate.transport import ThreadHub, ThreadTransport
from slurm_etc.plan import (
    Layout,
    ParallelConfig,
    Topology,
    build_catalog,
    default_pool,
    load_model,
    plan_migration,
)
from slurm_etc.plan.model import ModelDesc

GIB = 1 << 30
OLD = ParallelConfig(dp=1)
WIDE = ParallelConfig(dp=1, tp=2)
COPY_REPEATS = 5


# -- building on the device -------------------------------------------------------------

def build_state(model: ModelDesc, device: torch.device, *, seed: int | None) -> Any:
    """``build.build_modules`` with the GPTModel moved onto ``device`` before megatron's DDP
    and optimizer wrap it (the transformer config initialises on the CPU, so the weights are
    the same on every device); ``seed=None``: an empty state for a resize to fill."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                                 pipeline_model_parallel_size=1)
    tf_config = build.transformer_config(model, OLD)
    if seed is None:
        tf_config = dataclasses.replace(tf_config, perform_initialization=False)
    else:
        torch.manual_seed(seed)
    with build.skip_tied_embedding_sync(seed is None):
        gpt = build._gpt_model(model, tf_config)
    if seed is not None:
        build.reinit_global_deterministic(gpt, seed=seed, num_layers=model.num_layers)
    gpt.to(device)
    return build.wrap_for_training(model, OLD, gpt, tf_config, build.optimizer_config(model, OLD))


def train_step(state: Any, device: torch.device, *, seed: int, step: int, seq: int,
               global_batch: int, micro_batch: int, forward_only: bool = False) -> float:
    """One optimizer step over the seeded global batch (the batch of ``build``), on ``device``;
    ``forward_only``: the loss of that batch, the state left as it was."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = build._global_batch_tokens(state.model_desc, seed=seed, step=step,
                                        sequences=global_batch, seq=seq).to(device)
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(tokens.split(micro_batch)),
        model=state.model, num_microbatches=global_batch // micro_batch, seq_length=seq,
        micro_batch_size=micro_batch, forward_only=forward_only)
    if forward_only:
        return sum(float(x["lm loss"]) for x in losses) / len(losses)
    ok, _norm, _zeros = state.optimizer.step()
    if not ok:
        raise RuntimeError(f"step {step}: the optimizer skipped it (non-finite gradients)")
    return sum(float(x["lm loss"]) for x in losses) / len(losses)


def _forward_step(data_iterator: Iterator[torch.Tensor], model: Any) -> tuple:
    tokens = next(data_iterator)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(inputs.shape[1], device=tokens.device).unsqueeze(0).expand_as(inputs)
    output = model(inputs, positions, None, labels=labels)

    def loss_func(per_token_loss: torch.Tensor) -> tuple:
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


# -- the oracle: megatron's own view of the state -----------------------------------------

def megatron_tensors(state: Any) -> dict[str, Any]:
    """Every ShardedTensor of megatron's ``sharded_state_dict()`` (model and optimizer) and
    every plain tensor in it, keyed by its place in the dict; read through megatron alone,
    never through the adapter."""
    out: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k in sorted(node, key=str):
                walk(node[k], f"{path}/{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")
        elif isinstance(getattr(node, "data", None), torch.Tensor) and hasattr(node, "key"):
            if callable(getattr(node, "build", None)):  # a factory (e.g. SwiGLU's fc1 halves)
                walk(node.build(), path)
            else:
                out[f"{path}:{node.key}@{tuple(node.global_offset)}"] = node
        elif isinstance(node, torch.Tensor):
            out[path] = node

    walk(state.sharded_state_dict(), "")
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
                  [t.element_size()])


def megatron_bits(state: Any) -> dict[str, torch.Tensor]:
    """:func:`megatron_tensors` as copies of their raw bits."""
    return {k: _raw(getattr(v, "data", v)).clone() for k, v in megatron_tensors(state).items()}


def view_mismatches(state: Any, shards: list[LocalShard]) -> list[str]:
    """Adapter views of a tp=1 state that are not, bit for bit, megatron's tensors of the same
    key assembled over the shard's box (at their ``global_offset``; padded to three axes)."""
    pieces: dict[str, dict[tuple, Any]] = {}
    for v in megatron_tensors(state).values():
        if hasattr(v, "key"):
            pieces.setdefault(v.key, {})[tuple(v.global_offset)] = v
    out = []
    for sh in shards:
        lo, hi = [int(x) for x in sh.lo], [int(x) for x in sh.hi]
        box = torch.zeros([h - a for a, h in zip(lo, hi)], dtype=_raw(sh.tensor).dtype,
                          device=sh.tensor.device)
        filled = 0
        # the tied output layer's copy ("...@output_layer") is the embedding's memory at pp=1
        for off, v in pieces.get(sh.state_key.split("@")[0], {}).items():
            shape = (1,) * v.prepend_axis_num + tuple(v.data.shape)
            off3 = list(off) + [0] * (3 - len(off))
            shape3 = list(shape) + [1] * (3 - len(shape))
            if all(a <= o and o + n <= h for a, o, n, h in zip(lo, off3, shape3, hi)):
                box[tuple(slice(o - a, o - a + n) for o, n, a in zip(off3, shape3, lo))] = (
                    _raw(v.data).view(shape3))
                filled += v.data.numel()
        if filled != box.numel():
            out.append(f"{sh.key}: megatron's tensors cover {filled} of {box.numel()} elements")
        elif not torch.equal(box.reshape(-1)[sh.s:sh.s + sh.tensor.numel()], _raw(sh.tensor)):
            out.append(f"{sh.key}: not megatron's tensor bit for bit")
    return out


def region_mismatches(old: list[LocalShard], new: list[LocalShard]) -> list[str]:
    """New shards that are not, bit for bit, their box of the whole old tensors (tp=1 holds
    every tensor whole: one shard per tensor and layer, its box in row-major order)."""
    out = []
    for sh in new:
        src = next((o for o in old if o.state_key == sh.state_key
                    and all(a <= b and d <= c for a, b, c, d in zip(o.lo, sh.lo, o.hi, sh.hi))),
                   None)
        if src is None:
            out.append(f"{sh.key}: no old tensor holds its box")
            continue
        whole = _raw(src.tensor).view(*(h - lo for lo, h in zip(src.lo, src.hi)))
        box = whole[tuple(slice(a - lo, b - lo) for a, b, lo in zip(sh.lo, sh.hi, src.lo))]
        n = sh.tensor.numel()
        if not torch.equal(box.reshape(-1)[sh.s:sh.s + n], _raw(sh.tensor)):
            out.append(f"{sh.key}: differs from its box of the old tensor")
    return out


def bit_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose bits differ (or that one side lacks)."""
    out = [f"only in the original: {k}" for k in sorted(set(a) - set(b))]
    out += [f"only after the resize: {k}" for k in sorted(set(b) - set(a))]
    out += [f"differs: {k}" for k in sorted(set(a) & set(b))
            if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    return out


# -- migration inside one process -----------------------------------------------------------

class DeviceThreadTransport(ThreadTransport):
    """The in-process transport with its buffers on ``device`` (threads share the device)."""

    def __init__(self, hub: ThreadHub, rank: int, device: torch.device) -> None:
        super().__init__(hub, rank)
        self.device = device

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)


def run_plan(plan: Any, old: dict[int, list[LocalShard]], device: torch.device,
             options: MigrationOptions) -> tuple[dict[int, Any], float]:
    """Every device of ``plan`` as a thread on ``device``; destinations allocated up front on
    the device (``allocate_destinations``). Returns (results by device, seconds, synced)."""
    devices = group_devices(plan)
    hub = ThreadHub(len(devices))
    programs = {d: compile_program(plan, d, options.staging_bytes, options.direct_min_bytes)
                for d in devices}
    dests = {d: allocate_destinations(programs[d], options, device) for d in devices}
    out: dict[int, Any] = {}

    def work(rank: int, d: int) -> None:
        try:
            out[d] = execute_migration(plan, DeviceThreadTransport(hub, rank, device), d,
                                       old.get(d, []), options=options, program=programs[d],
                                       destinations=dests[d])
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            out[d] = exc

    _sync(device)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(r, d), daemon=True)
               for r, d in enumerate(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(options.vote_timeout * 4)
    _sync(device)
    seconds = time.perf_counter() - t0
    failed = {d: r for d, r in out.items() if isinstance(r, BaseException)}
    if failed or len(out) != len(devices):
        raise RuntimeError(f"migration failed: {failed or 'a device did not finish'}")
    return out, seconds


def pack_figures(plan: Any, shards: list[LocalShard], device: torch.device,
                 options: MigrationOptions) -> dict:
    """The executor's own pack (sender) and unpack (receiver) of every send buffer of
    ``plan``, one staging chunk at a time, timed with the device synchronised, beside a
    plain ``copy_`` of the same number of bytes."""
    sender = plan.old.devices[0]
    prog = compile_program(plan, sender, options.staging_bytes, options.direct_min_bytes)
    steps = [(prog.sends[st.send], st) for st in prog.steps if st.send is not None]
    if not steps:
        return {"packed_bytes": 0}
    receiver = steps[0][0].dst_device
    rprog = compile_program(plan, receiver, options.staging_bytes, options.direct_min_bytes)
    rsteps = [(rprog.recvs[st.recv], st) for st in rprog.steps if st.recv is not None]

    def new_run(p: Any) -> Any:
        stats = MigrationStats(steps=0, rounds=0, chunk_bytes=p.chunk_bytes, messages_sent=0,
                               messages_received=0, sent_bytes=0, received_bytes=0,
                               local_bytes=0, old_state_bytes=0, new_state_bytes=0,
                               staging_budget=options.staging_bytes)
        return _Run(p, ThreadHub(1).transports()[0], options, FaultInjector(), stats)

    run = new_run(prog)
    run.old_bytes = [t.view(torch.uint8) for t in _check_old_shards(prog, shards, device)]
    buf = torch.empty(prog.staging_sizes[0], dtype=torch.uint8, device=device)
    rrun = new_run(rprog)
    rrun.new_bytes = [t.view(torch.uint8) for t in
                      allocate_destinations(rprog, options, device) if t is not None]
    rbuf = torch.empty(rprog.staging_sizes[1], dtype=torch.uint8, device=device)
    nbytes = sum(side.nbytes for side in {id(s): s for s, _ in steps}.values())

    def pack() -> None:
        for side, st in steps:
            run.pack(side, st, buf)

    def unpack() -> None:
        for side, st in rsteps:
            rrun.unpack(side, rrun.receive_into(side, st, rbuf))

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(7)
    dst = torch.empty_like(src)
    pack_s = _best(pack, device)
    unpack_s = _best(unpack, device)
    copy_s = _best(lambda: dst.copy_(src), device)
    return {"packed_bytes": nbytes, "pack_chunks": len(steps), "unpack_chunks": len(rsteps),
            "chunk_bytes": prog.chunk_bytes,
            "pack_gbps": nbytes / pack_s / 1e9, "unpack_gbps": nbytes / unpack_s / 1e9,
            "copy_gbps": nbytes / copy_s / 1e9}


def _best(fn: Callable[[], Any], device: torch.device) -> float:
    """Best of ``COPY_REPEATS`` synchronised runs after one warm-up."""
    fn()
    times = []
    for _ in range(COPY_REPEATS):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- one model ---------------------------------------------------------------------------------

def check_model(model: ModelDesc, device: torch.device, *, steps: int, seed: int, seq: int,
                global_batch: int, staging_bytes: int,
                plant: Callable[[str, list[LocalShard]], None] | None = None) -> dict:
    """Every check on one model (see module docstring); raises on a failed check.

    ``plant`` (tests: a planted bug): called with ``"views"`` and the adapter's views,
    ``"tp2"`` and the shards of the tp=2 layout's second device, ``"tp1"`` and the shards
    resized back, each before they are checked.
    """
    res: dict[str, Any] = {"model": model.name, "device": str(device)}
    t0 = time.perf_counter()
    state = build_state(model, device, seed=seed)
    _sync(device)
    res["build_s"] = time.perf_counter() - t0
    step_of = functools.partial(train_step, seed=seed, seq=seq, global_batch=global_batch,
                                micro_batch=1)
    times, losses = [], []
    for step in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        losses.append(step_of(state, device, step=step))
        _sync(device)
        times.append(time.perf_counter() - t0)
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"{model.name}: non-finite loss {losses}")
    res.update(losses=losses, step_s=times, step_s_last=times[-1],
               tokens_per_s=global_batch * seq / times[-1])

    # the adapter's views
    catalog = build_catalog(model, OLD)
    t0 = time.perf_counter()
    shards = local_shards(state, catalog)
    res["views_s"] = time.perf_counter() - t0
    if plant is not None:
        plant("views", shards)
    problems = check_shards(catalog, OLD, 0, shards)
    problems += [f"{sh.key} on {sh.tensor.device}" for sh in shards if sh.tensor.device != device]
    problems += view_mismatches(state, shards)
    if problems:
        raise RuntimeError(f"{model.name}: {len(problems)} adapter views wrong, e.g. "
                           f"{problems[:3]}")
    kinds: dict[str, int] = {}
    for sh in shards:
        kind = sh.state_key.split(".")[2] if sh.state_key.startswith("optimizer.") else "param"
        kinds[kind] = kinds.get(kind, 0) + sh.tensor.numel() * sh.tensor.element_size()
    res.update(view_shards=len(shards), view_bytes=kinds, state_bytes=sum(kinds.values()))

    # packing on the device
    topo = Topology(gpus_per_node=2)
    old_layout = Layout(OLD, (0,))
    wide = plan_migration(model, old_layout, WIDE, default_pool(old_layout, WIDE, topo), topo,
                          keep_tp_in_node=False)
    options = MigrationOptions(staging_bytes=staging_bytes, measure_memory=False,
                               timeout_s=600.0)
    packing = pack_figures(wide, shards, device,
                           dataclasses.replace(options, direct_min_bytes=1 << 62))
    res["packing"] = packing

    # resize tp=1 -> tp=2 -> tp=1 with the executor, install, compare through megatron
    original = megatron_bits(state)
    resume = resume_state(state)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    there, out_s = run_plan(wide, {0: shards}, device, options)
    if plant is not None:
        plant("tp2", there[1].new_shards)
    wrong = [m for r in there.values() for m in region_mismatches(shards, r.new_shards)]
    res["resize"] = {"tp2_shards_checked": sum(len(r.new_shards) for r in there.values())}
    if wrong:
        raise RuntimeError(f"{model.name}: {len(wrong)} tp=2 shards wrong after the resize, "
                           f"e.g. {wrong[:3]}")
    back = plan_migration(model, wide.new, OLD, default_pool(wide.new, OLD, topo), topo,
                          keep_tp_in_node=False)
    back_res, back_s = run_plan(back, {d: r.new_shards for d, r in there.items()}, device,
                                options)
    if device.type == "cuda":
        res["migration_peak_gib"] = (torch.cuda.max_memory_allocated(device) - base) / GIB
    new_shards = next(r.new_shards for r in back_res.values() if r.new_rank == 0)
    if plant is not None:
        plant("tp1", new_shards)
    moved = [sum(r.stats.received_bytes + r.stats.local_bytes for r in rr.values())
             for rr in (there, back_res)]
    res["resize"].update({
        "tp1_to_tp2_s": out_s, "tp2_to_tp1_s": back_s,
        "tp1_to_tp2_bytes": moved[0], "tp2_to_tp1_bytes": moved[1],
        "tp1_to_tp2_gbps": moved[0] / out_s / 1e9, "tp2_to_tp1_gbps": moved[1] / back_s / 1e9})
    del there, back_res, shards
    t0 = time.perf_counter()
    empty = build_state(model, device, seed=None)
    installed = install_shards(empty, catalog, new_shards, resume)
    _sync(device)
    res["resize"]["empty_build_install_s"] = time.perf_counter() - t0
    res["resize"]["adopted_tensors"] = installed["adopted"]
    diffs = bit_differences(original, megatron_bits(empty))
    res["resize"]["tensors_compared"] = len(original)
    res["resize"]["bit_equal"] = not diffs
    if diffs:
        raise RuntimeError(f"{model.name}: the resized state differs from the original: "
                           f"{len(diffs)} tensors, e.g. {diffs[:3]}")
    del original, new_shards
    # the next step's loss from both (forward only: where a shard was kept whole, both
    # states hold the same memory, so a step of one would change the other), then a step of
    # the resized state
    a, b = (step_of(s, device, step=steps, forward_only=True) for s in (state, empty))
    res["resize"]["next_loss"] = [a, b]
    res["resize"]["next_loss_equal"] = a == b
    res["resize"]["step_after_resize_loss"] = step_of(empty, device, step=steps)
    del state, empty
    build.teardown()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


# -- the product's own path on the device ---------------------------------------------------

def check_trainer(model: str, steps: int) -> dict[str, Any]:
    """The real ``ElasticTrainer`` at world size 1 in a worker process of its own (the test
    pool: its own store, its device chosen as a launched worker's is, its default group
    ``cpu:gloo,cuda:nccl`` on a GPU): ``steps`` steps of ``model``, their losses."""
    from slurm_etc.plan import PRESETS, ParallelConfig
    from slurm_etc.pool.local import LocalWorkers
    from slurm_etc.worker.sequence import PRELOAD, ResizeSequence

    seq = ResizeSequence(PRESETS[model], (ParallelConfig(dp=1),), steps=steps, global_batch=4)
    layouts, digests = seq.layouts()
    t0 = time.perf_counter()
    with LocalWorkers(1, preload=PRELOAD) as pool:
        out = pool.run(_w_trainer, seq, layouts, digests, f"gpu-check-{os.getpid()}")[0]
    losses = [h["loss"] for h in out["history"]]
    return {"model": model, "device": out["device"], "backend": out["backend"],
            "losses": losses, "finite": all(math.isfinite(x) for x in losses),
            "exits": out["exits"], "seconds": time.perf_counter() - t0}


def _w_trainer(ctx: Any, seq: Any, layouts: Any, digests: Any, job: str) -> dict[str, Any]:
    from slurm_etc.migrate import device as compute
    from slurm_etc.worker.sequence import w_elastic

    out = w_elastic(ctx, seq, layouts, digests, job)
    return {**out, "device": str(compute.current().device),
            "backend": compute.current().world_backend}


def check_store_idle(device: torch.device, idle_s: float) -> dict[str, Any]:
    """A one-rank group of the trainer's backends over the project's store, one collective,
    then ``idle_s`` seconds idle: ProcessGroupNCCL's heartbeat calls the store's ``check()``
    from a new thread state about once a second; the client's connections and this
    process's descriptors are counted before and after."""
    import secrets

    from slurm_etc.megatron.world import start_world_group
    from slurm_etc.migrate import device as compute
    from slurm_etc.protocol.store import StoreClient, StoreServer

    secret = secrets.token_bytes(32)
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    with StoreServer(secret, "127.0.0.1", job="gpu-check") as server:
        client = StoreClient("127.0.0.1", server.port, secret)
        backend = compute.current().world_backend
        before = fds()
        pg = start_world_group(1, 0, dist.PrefixStore("idle", client),
                               name=f"gpu-check-idle-{os.getpid()}", timeout_s=60)
        t = torch.ones(1, device=device)
        dist.all_reduce(t, group=pg)
        _sync(device)
        opened = client.open_connections
        time.sleep(idle_s)
        res = {"idle_s": idle_s, "backend": backend, "fds_before": before,
               "fds_after": fds(), "connections_after_collective": opened,
               "connections_after_idle": client.open_connections}
        dist.destroy_process_group(pg)
        client.close()
    return res


def _where_installed(check: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``check(*args)``, or why it was skipped: the store and the trainer need the project's
    own dependencies (pyzmq, msgspec), which a bare GPU machine may lack."""
    try:
        return check(*args)
    except ImportError as exc:
        return {"skipped": f"{exc.name or exc} is not installed"}


def check_preflight(device: torch.device) -> dict[str, Any]:
    """The resize preflight on the real device: what it reads as free, a need that fits and
    one that does not (its one line)."""
    from slurm_etc.migrate.device import DeviceMemoryError, MemoryNeed, check_fits, free_bytes

    free = free_bytes(device)
    if free is None:
        return {"free_bytes": None, "note": "the CPU: nothing is checked"}
    check_fits(MemoryNeed(destinations=free // 2, grads=0, staging=0, free=free), str(device))
    try:
        check_fits(MemoryNeed(destinations=free, grads=free // 4, staging=1 << 28, free=free),
                   str(device))
        refused = None
    except DeviceMemoryError as exc:
        refused = str(exc)
    return {"free_bytes": free, "refused_line": refused}


# -- the whole run -----------------------------------------------------------------------------

def start(device: torch.device, backend: str | None = None) -> None:
    """A one-rank default group (default: gloo for CPU tensors, NCCL for CUDA ones)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    from slurm_etc.migrate import device as compute

    backend = backend or compute.use(compute.Compute(device)).world_backend
    if device.type != "cuda":
        from slurm_etc.megatron import cpu_compat

        cpu_compat.install()
    dist.init_process_group(backend, rank=0, world_size=1)


def table(results: list[dict]) -> str:
    rows = [("model", "state GiB", "step s", "tok/s", "loss", "pack GB/s", "unpack GB/s",
             "copy_ GB/s", "1->2 GB/s", "2->1 GB/s", "bit-equal", "next loss =")]
    for r in results:
        p, z = r["packing"], r["resize"]
        rows.append((r["model"], f"{r['state_bytes'] / GIB:.3f}", f"{r['step_s_last']:.3f}",
                     f"{r['tokens_per_s']:.0f}", f"{r['losses'][-1]:.4f}",
                     f"{p.get('pack_gbps', 0):.1f}", f"{p.get('unpack_gbps', 0):.1f}",
                     f"{p.get('copy_gbps', 0):.1f}", f"{z['tp1_to_tp2_gbps']:.1f}",
                     f"{z['tp2_to_tp1_gbps']:.1f}", "yes" if z["bit_equal"] else "NO",
                     "yes" if z["next_loss_equal"] else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--models", default=None,
                    help="comma-separated presets (default: small,gpt-1.3b on CUDA, tiny on CPU)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=None, help="default: 512 on CUDA, 32 on CPU")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="sequences per step (default: 8 on CUDA, 2 on CPU)")
    ap.add_argument("--staging-mib", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--backend", default=None,
                    help="torch.distributed backend of the one-rank group (default: "
                         "cpu:gloo,cuda:nccl on CUDA, gloo on CPU)")
    ap.add_argument("--trainer-model", default="tiny",
                    help="preset the real ElasticTrainer trains in its own process ('' : skip)")
    ap.add_argument("--idle-s", type=float, default=60.0,
                    help="how long the one-rank group over the store stays idle (0: skip)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="directory for gpu_check.json (default: $OUT)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    try:
        models = [load_model(m) for m in
                  (args.models or ("small,gpt-1.3b" if cuda else "tiny")).split(",")]
    except Exception as exc:  # noqa: BLE001 - one line for the user
        ap.error(str(exc))
    seq = args.seq or (512 if cuda else 32)
    gb = args.global_batch or (8 if cuda else 2)
    start(device, args.backend)
    info: dict[str, Any] = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "backend": str(dist.get_backend()), "seq": seq, "global_batch": gb,
        "steps": args.steps, "staging_mib": args.staging_mib,
        "unmeasured": "NCCL between ranks (one GPU: every peer is a thread of this process); "
                      "the multi-process resize_in_place"}
    try:
        import megatron.core

        info["megatron_core"] = megatron.core.__version__
    except AttributeError:
        pass
    results = []
    for model in models:
        results.append(check_model(model, device, steps=args.steps, seed=args.seed, seq=seq,
                                   global_batch=gb, staging_bytes=args.staging_mib << 20))
        print(f"{model.name}: done ({results[-1]['build_s']:.1f} s build)", file=sys.stderr,
              flush=True)
    extra: dict[str, Any] = {"preflight": check_preflight(device)}
    if args.idle_s > 0:
        extra["store_idle"] = _where_installed(check_store_idle, device, args.idle_s)
        print("store: idle check done", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    if args.trainer_model:
        extra["trainer"] = _where_installed(check_trainer, args.trainer_model, args.steps)
        print("trainer: done", file=sys.stderr, flush=True)
    report = {**info, "results": results, **extra}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{info['device_name']}, torch {info['torch']}, seq {seq}, global batch {gb}")
        print(table(results))
        for name, value in extra.items():
            print(f"{name}: {json.dumps(value)}")
        print(f"unmeasured here: {info['unmeasured']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

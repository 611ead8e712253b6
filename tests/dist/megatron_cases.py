"""Worker-side functions and reference rules for the megatron-core build tests and fixtures.

Everything here is importable both in the pytest process and in the gloo workers of
:mod:`harness` (functions run there are pickled by reference, so they live at module level).

Two kinds of content:

* :func:`describe_build` runs on every rank: builds a configuration with
  :func:`slurm_etc.megatron.build.build_training_state`, reports the shard records, the
  distributed optimizer's buffer layout and (optionally) the main-replica tensor values,
  then tears the configuration down.
* Pure reference rules, the executable form of ``docs/megatron-notes.md``: the parameter
  registration order a ModelDesc gives (:func:`expected_param_order`) and the distributed
  optimizer's flat buffer layout (:func:`dist_opt_buffer_layout`, :func:`dp_rank_ranges`,
  :func:`dp_reshardable_records`). Tests check them against what megatron-core builds.
"""
from __future__ import annotations

import json
import math
from typing import Any

from slurm_etc.plan.config import ParallelConfig
from slurm_etc.plan.model import ModelDesc

# Alignment of each parameter's start in the buffer (elements) and divisor of bucket ends,
# as megatron-core 0.16.1's _ParamAndGradBuffer pads them with the distributed optimizer.
PARAM_START_ALIGN = 64
BUCKET_ALIGN = 128


# -- worker side --------------------------------------------------------------------------------

def describe_build(rank: int, world: int, model: ModelDesc, config: ParallelConfig, *,
                   with_values: bool = False, steps: int = 2) -> dict:
    """Build ``model`` under ``config`` on this rank, describe it, tear it down.

    Returns a dict with the rank's coordinates, the step losses, the model and optimizer
    shard records, the ShardedObject keys, the parameter registration order and, with the
    distributed optimizer, the flat buffer layout and this dp rank's ranges; with
    ``with_values``, ``values``: ``[(record, ndarray)]`` of the main-replica model shards.
    """
    from slurm_etc.megatron import build, cpu_compat, shards

    cpu_compat.install()
    state = build.build_training_state(model, config, steps=steps)
    try:
        model_sd = state.model_sharded_state_dict()
        model_records = shards.shard_records(model_sd)
        values = [
            (record, sh.data.detach().float().numpy().copy())
            for record, (_path, sh) in zip(model_records, shards.iter_sharded_tensors(model_sd))
            if shards.is_main_replica(record)
        ] if with_values else None
        optimizer_sd = state.optimizer_sharded_state_dict(model_sd)
        t, d, p = config.coords(rank)
        out: dict[str, Any] = {
            "rank": rank,
            "coords": {"t": t, "d": d, "p": p},
            "losses": list(state.losses),
            "model_records": model_records,
            "optimizer_records": shards.shard_records(optimizer_sd),
            "sharded_objects": shards.sharded_object_keys(model_sd)
            + shards.sharded_object_keys(optimizer_sd),
            "params": [
                {"name": name, "numel": param.numel(), "dtype": str(param.dtype),
                 "shared_embedding": bool(getattr(param, "shared_embedding", False))}
                for name, param in state.gpt.named_parameters() if param.requires_grad
            ],
        }
        if config.distributed_optimizer:
            out["buffers"] = _buffer_layout(state, model_records)
        if with_values:
            out["values"] = values
        return out
    finally:
        del state
        build.teardown()


def _buffer_layout(state: Any, model_records: list[dict]) -> list[dict]:
    """The DistributedOptimizer's buffers as megatron built them, and this dp rank's ranges."""
    by_path = {}
    for record in model_records:
        path = record["path"]
        if path.endswith((".0", ".1")) and record["key"].endswith("linear_fc1.weight"):
            path = path[:-2]  # the two SwiGLU halves of one parameter
        layer = record["global_offset"][0] if record["prepend_axis_num"] else None
        by_path[path] = {"key": record["key"], "layer": layer}
    names = {param: name for name, param in state.gpt.named_parameters()}
    (dist_opt,) = state.optimizer.chained_optimizers
    layouts = []
    for gbuf_index, buffer in enumerate(dist_opt.buffers):
        params = sorted(((names[p], start, end, bucket)
                         for p, (start, end, bucket) in buffer.param_index_map.items()),
                        key=lambda item: item[1])
        ranges = []
        for dtype_map in dist_opt.gbuf_ranges[gbuf_index].values():
            for bucket_index, bucket_map in enumerate(dtype_map):
                for param, r in bucket_map["param_map"].items():
                    ranges.append({"name": names[param], "bucket": bucket_index,
                                   "world_start": r["gbuf_world"].start,
                                   "world_end": r["gbuf_world"].end,
                                   "param_start": r["param"].start, "param_end": r["param"].end})
        layouts.append({
            "param_dtype": str(buffer.param_dtype).removeprefix("torch."),
            "grad_dtype": str(buffer.grad_dtype).removeprefix("torch."),
            "numel": buffer.numel,
            "numel_unpadded": buffer.numel_unpadded,
            "buckets": [{"offset": b.offset, "numel": b.grad_data.numel(),
                         "numel_unpadded": b.numel_unpadded} for b in buffer.buckets],
            "params": [{"name": name, **by_path[name], "start": start, "end": end,
                        "bucket": bucket} for name, start, end, bucket in params],
            "dp_rank_ranges": sorted(ranges, key=lambda r: r["world_start"]),
        })
    return layouts


# -- reference rules (pure) ---------------------------------------------------------------------

def expected_param_order(model: ModelDesc, config: ParallelConfig, stage: int) -> list[dict]:
    """Parameters of one pipeline stage in megatron's registration order, with tp-local sizes.

    ``named_parameters()`` order of ``GPTModel`` with the local spec: word (and learned
    position) embeddings on the first stage; per layer input norm, ``linear_proj`` (registered
    before ``linear_qkv``), ``linear_qkv``, pre-MLP norm, ``linear_fc1``, ``linear_fc2``, each
    weight before its bias; final norm and ``output_layer`` on the last stage (the output
    layer exists there unless the embeddings are tied and pp is 1). Layer numbers in names are
    stage-local.
    """
    tp, h, v = config.tp, model.hidden, model.padded_vocab
    first, last = stage == 0, stage == config.pp - 1
    bias = model.add_bias_linear
    fc1_rows = (2 if model.swiglu else 1) * model.ffn_hidden
    params: list[tuple[str, int, bool]] = []

    def norm(prefix: str) -> None:
        params.append((f"{prefix}.weight", h, False))
        if not model.rmsnorm:
            params.append((f"{prefix}.bias", h, False))

    def linear(prefix: str, rows: int, cols: int, bias_numel: int) -> None:
        params.append((f"{prefix}.weight", rows * cols, False))
        if bias:
            params.append((f"{prefix}.bias", bias_numel, False))

    if first:
        shared = model.tied_embeddings and config.pp > 1
        params.append(("embedding.word_embeddings.weight", v // tp * h, shared))
        if model.learned_position_embeddings:
            params.append(("embedding.position_embeddings.weight", model.seq_length * h, False))
    for layer in range(model.num_layers // config.pp):
        prefix = f"decoder.layers.{layer}"
        norm(f"{prefix}.input_layernorm")
        linear(f"{prefix}.self_attention.linear_proj", h, h // tp, h)
        linear(f"{prefix}.self_attention.linear_qkv", model.qkv_rows // tp, h,
               model.qkv_rows // tp)
        norm(f"{prefix}.pre_mlp_layernorm")
        linear(f"{prefix}.mlp.linear_fc1", fc1_rows // tp, h, fc1_rows // tp)
        linear(f"{prefix}.mlp.linear_fc2", h, model.ffn_hidden // tp, h)
    if last:
        norm("decoder.final_layernorm")
        if not model.tied_embeddings or not first:
            params.append(("output_layer.weight", v // tp * h,
                           model.tied_embeddings and not first))
    return [{"name": n, "numel": numel, "shared_embedding": s} for n, numel, s in params]


def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def dist_opt_buffer_layout(params: list[dict], dp: int,
                           bucket_size: int | None = None) -> dict:
    """The flat buffer of one (param dtype, grad dtype) group, as megatron-core 0.16.1 lays it out.

    Args:
        params: ``{"name", "numel", "shared_embedding"}`` in registration order.
        dp: data-parallel size.
        bucket_size: ``None`` when ``overlap_grad_reduce`` is off (one bucket, except for the
            shared-embedding split) and on every pipeline stage after the first.

    Returns:
        ``{"numel", "numel_unpadded", "buckets": [{"offset", "numel", "numel_unpadded"}],
        "params": [{"name", "start", "end", "bucket"}]}`` with params in buffer order.
    """
    bucket_align = math.lcm(dp, BUCKET_ALIGN)
    buckets: list[dict] = []
    placed: list[dict] = []
    start = bucket_start = 0
    open_bucket = False

    def close(end: int) -> int:
        nonlocal bucket_start, open_bucket
        padded = _pad(end, bucket_align)
        buckets.append({"offset": bucket_start, "numel": padded - bucket_start,
                        "numel_unpadded": end - bucket_start})
        bucket_start, open_bucket = padded, False
        return padded

    for param in reversed(params):
        start = _pad(start, PARAM_START_ALIGN)
        shared = param["shared_embedding"]
        if shared and open_bucket:
            start = close(start)
        end = start + param["numel"]
        placed.append({"name": param["name"], "start": start, "end": end,
                       "bucket": len(buckets)})
        open_bucket = True
        if shared or (bucket_size is not None and end - bucket_start >= bucket_size):
            start = close(end)
        else:
            start = end
    if open_bucket:
        close(end)
    return {"numel": bucket_start, "numel_unpadded": sum(b["numel_unpadded"] for b in buckets),
            "buckets": buckets, "params": placed}


def dp_rank_ranges(layout: dict, dp: int, dp_rank: int) -> list[dict]:
    """The parts of parameters a dp rank owns: each bucket split into dp equal contiguous shards."""
    ranges = []
    for index, bucket in enumerate(layout["buckets"]):
        shard = bucket["numel"] // dp
        lo = bucket["offset"] + dp_rank * shard
        hi = lo + shard
        for param in layout["params"]:
            if param["bucket"] != index:
                continue
            start, end = max(param["start"], lo), min(param["end"], hi)
            if end > start:
                ranges.append({"name": param["name"], "bucket": index, "world_start": start,
                               "world_end": end, "param_start": start - param["start"],
                               "param_end": end - param["start"]})
    return ranges


def dp_reshardable_records(layout: dict, dp: int, dp_rank: int, *, mp_rank: int,
                           dtype_key: str, state_keys: tuple[str, ...] = (
                               "param", "exp_avg", "exp_avg_sq")) -> list[dict]:
    """The ShardedTensor metadata of a DistributedOptimizer ``dp_reshardable`` state dict.

    One flat global tensor per (model-parallel rank, buffer, bucket, state key), of length
    the bucket's unpadded size; each dp rank contributes one record per owned parameter part
    and per padding gap inside its shard (gaps starting at or beyond the unpadded size are
    dropped). ``dtype_key`` is megatron's ``str((param_dtype, grad_dtype))``, e.g.
    ``"(torch.float32, torch.float32)"``. Only buffer 0 (``gbuf_idx_0``) is modelled.
    """
    records = []
    for index, bucket in enumerate(layout["buckets"]):
        shard = bucket["numel"] // dp
        lo = bucket["offset"] + dp_rank * shard
        pieces = [(r["world_start"] - lo, r["world_end"] - lo)
                  for r in dp_rank_ranges(layout, dp, dp_rank) if r["bucket"] == index]
        filled: list[tuple[int, int]] = []
        cursor = 0
        for start, end in pieces + [(shard, shard)]:
            if start != cursor and dp_rank * shard + cursor < bucket["numel_unpadded"]:
                filled.append((cursor, start))
            if end > start:
                filled.append((start, end))
            cursor = end
        key = (f"optimizer.distributed.dp_group_idx_{mp_rank}.gbuf_idx_0.dtype_{dtype_key}"
               f".bucket_idx_{index}")
        for start, end in filled:
            for state_key in state_keys:
                records.append({"key": f"{key}.{state_key}",
                                "global_shape": [bucket["numel_unpadded"]],
                                "global_offset": [dp_rank * shard + start],
                                "local_shape": [end - start]})
    return records


def model_param_count(model: ModelDesc) -> int:
    """Distinct parameter elements of ``model`` (tied embeddings counted once)."""
    h, f, v = model.hidden, model.ffn_hidden, model.padded_vocab
    bias = model.add_bias_linear
    norm = h if model.rmsnorm else 2 * h
    fc1_rows = (2 if model.swiglu else 1) * f
    layer = (2 * norm
             + model.qkv_rows * h + (model.qkv_rows if bias else 0)
             + h * h + (h if bias else 0)
             + fc1_rows * h + (fc1_rows if bias else 0)
             + h * f + (h if bias else 0))
    total = v * h + model.num_layers * layer + norm
    if model.learned_position_embeddings:
        total += model.seq_length * h
    if not model.tied_embeddings:
        total += v * h
    return total


# -- fixtures -----------------------------------------------------------------------------------

def fixture_payload(model: ModelDesc, config: ParallelConfig, per_rank: list[dict]) -> dict:
    """The JSON fixture of one configuration: per-rank shard records (and buffer layout).

    Optimizer records and the distributed optimizer's buffers are included only when the
    optimizer is distributed (the non-distributed optimizer's records repeat the model's
    boxes under ``optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<key>``).
    """
    from importlib.metadata import version

    ranks = []
    for result in per_rank:
        entry = {"rank": result["rank"], "coords": result["coords"],
                 "model_records": result["model_records"],
                 "sharded_objects": result["sharded_objects"]}
        if config.distributed_optimizer:
            entry["optimizer_records"] = result["optimizer_records"]
            entry["buffers"] = result["buffers"]
        ranks.append(entry)
    return {
        "megatron_core": version("megatron-core"),
        "model": model.to_json(),
        "config": {"dp": config.dp, "tp": config.tp, "pp": config.pp,
                   "distributed_optimizer": config.distributed_optimizer},
        "ranks": ranks,
    }


def dumps_fixture(payload: dict) -> str:
    """JSON with one record (a dict without nested dicts) per line: small and diffable."""
    def flat(value: Any) -> bool:
        return isinstance(value, dict) and not any(
            isinstance(v, dict) or (isinstance(v, list) and any(isinstance(x, dict) for x in v))
            for v in value.values())

    def dump(value: Any, indent: int) -> str:
        pad, inner = " " * indent, " " * (indent + 1)
        if flat(value) or not isinstance(value, (dict, list)):
            return json.dumps(value, separators=(",", ":"))
        if isinstance(value, list):
            if not value:
                return "[]"
            return "[\n" + ",\n".join(inner + dump(v, indent + 1) for v in value) + "\n" + pad + "]"
        items = [f"{inner}{json.dumps(k)}: {dump(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"

    return dump(payload, 0) + "\n"


def save_then_load(rank: int, world: int, model: ModelDesc, save_config: ParallelConfig,
                   load_config: ParallelConfig, checkpoint_dir: str) -> dict:
    """Save a trained ``save_config`` state with dist_checkpointing, load it as ``load_config``.

    The loading build uses another seed, so its weights only match the saved ones if the load
    really happened. Returns the main-replica model shards before saving and after loading.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from slurm_etc.megatron import build, cpu_compat, shards

    cpu_compat.install()

    def main_values(state: Any) -> list:
        model_sd = state.model_sharded_state_dict()
        return [(shards.shard_record(path, sh), sh.data.detach().float().numpy().copy())
                for path, sh in shards.iter_sharded_tensors(model_sd)
                if shards.is_main_replica(shards.shard_record(path, sh))]

    state = build.build_training_state(model, save_config)
    saved = main_values(state)
    dist_checkpointing.save(state.sharded_state_dict(), checkpoint_dir)
    del state
    build.teardown()
    dist.barrier()

    state = build.build_training_state(model, load_config, seed=4321, steps=0)
    try:
        model_sd = state.model_sharded_state_dict()
        loaded = dist_checkpointing.load({"model": model_sd}, checkpoint_dir)
        state.gpt.load_state_dict(loaded["model"])
        return {"saved": saved, "loaded": main_values(state)}
    finally:
        del state
        build.teardown()

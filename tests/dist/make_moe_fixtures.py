"""Record real megatron-core MoE / VPP / CP models' sharded_state_dict on 4 gloo ranks.

Writes ``tests/fixtures/megatron/<case>.json`` (model records only: keys, global shapes and
the box every rank holds) for layouts with ep and vpp, which the dense fixtures of
``make_megatron_fixtures`` do not cover; ``tests/unit/test_catalog_megatron.py`` compares the
catalog with them. The models are built straight from megatron-core (GPTModel with the local
layer spec, ``SequentialMLP`` experts, one GPTModel per virtual pipeline chunk), not through
the trainer, so the records say what megatron-core itself does. Run from the repository root:

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.dist.make_moe_fixtures
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from slurm_etc.plan import PRESETS, ModelDesc, ParallelConfig

FIXTURE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
WORLD = 4

# case name -> (model, config); 4 ranks each
CASES: dict[str, tuple[str, str]] = {
    "tiny-moe_dp2tp1pp2ep2": ("tiny-moe", "dp=2,tp=1,pp=2,ep=2"),
    "tiny-moe_dp1tp2pp2vpp2": ("tiny-moe", "dp=1,tp=2,pp=2,vpp=2"),
    # cp itself cannot be built on CPU (megatron-core's local
    # DotProductAttention refuses context_parallel_size > 1; only TEDotProductAttention runs it)
    "tiny-moe_dp4tp1pp1ep4": ("tiny-moe", "dp=4,tp=1,pp=1,ep=4"),
    # ep with tp needs sequence parallelism, which the local (torch) norms refuse on CPU
    # tiny (LayerNorm with biases) under vpp calls CUDA while building on this machine
}


def _transformer_config(model: ModelDesc, config: ParallelConfig) -> Any:
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe: dict[str, Any] = {}
    if model.moe:
        moe = dict(num_moe_experts=model.num_experts, moe_router_topk=model.topk,
                   moe_ffn_hidden_size=model.expert_ffn_size,
                   moe_shared_expert_intermediate_size=model.shared_expert_ffn,
                   moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                   expert_model_parallel_size=config.ep,
                   # megatron requires sequence parallelism with ep and tp both > 1
                   sequence_parallel=config.tp > 1 and config.ep > 1)
    return TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden, ffn_hidden_size=model.ffn_hidden,
        num_attention_heads=model.num_heads, num_query_groups=model.query_groups,
        kv_channels=model.kv_channels, qk_layernorm=model.qk_layernorm,
        tensor_model_parallel_size=config.tp, pipeline_model_parallel_size=config.pp,
        virtual_pipeline_model_parallel_size=config.vpp if config.vpp > 1 else None,
        context_parallel_size=config.cp,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, use_cpu_initialization=True,
        gated_linear_unit=model.swiglu, activation_func=F.silu if model.swiglu else F.gelu,
        normalization="RMSNorm" if model.rmsnorm else "LayerNorm",
        add_bias_linear=model.add_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, **moe)


def _describe(rank: int, port: int, model_name: str, layout: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from slurm_etc.megatron import shards

    model, config = PRESETS[model_name], ParallelConfig.parse(layout)
    ps.initialize_model_parallel(
        config.tp, config.pp,
        virtual_pipeline_model_parallel_size=config.vpp if config.vpp > 1 else None,
        context_parallel_size=config.cp, expert_model_parallel_size=config.ep)
    tc = _transformer_config(model, config)
    spec = get_gpt_layer_local_spec(num_experts=model.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=model.qk_layernorm,
                                    normalization="RMSNorm" if model.rmsnorm else "LayerNorm")
    records = []
    for chunk in range(config.vpp):
        vp = chunk if config.vpp > 1 else None
        gpt = GPTModel(
            config=tc, transformer_layer_spec=spec, vocab_size=model.vocab_size,
            max_sequence_length=model.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=model.tied_embeddings,
            position_embedding_type=("learned_absolute" if model.learned_position_embeddings
                                     else "rope"),
            vp_stage=vp)
        for record in shards.shard_records(gpt.sharded_state_dict()):
            records.append({**record, "chunk": chunk})
    t, d, p = config.coords(rank)
    result = {"rank": rank, "coords": {"t": t, "d": d, "p": p, "c": config.cp_rank(rank),
                                       "e": config.ep_rank(rank)},
              "groups": {"ep": ps.get_expert_model_parallel_rank(),
                         "expert_dp": ps.get_expert_data_parallel_rank(),
                         "cp": ps.get_context_parallel_rank(),
                         "dp": ps.get_data_parallel_rank()},
              "model_records": records}
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(names: list[str]) -> None:
    import subprocess
    import tempfile

    FIXTURE_DIR.mkdir(parents=True, exist_ok=True)
    for name in names or list(CASES):
        model_name, layout = CASES[name]
        port = _free_port()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [subprocess.Popen([sys.executable, "-m", "tests.dist.make_moe_fixtures",
                                       "--rank", str(r), str(port), model_name, layout,
                                       f"{tmp}/{r}.json"]) for r in range(WORLD)]
            codes = [p.wait(timeout=600) for p in procs]
            if any(codes):
                raise SystemExit(f"{name}: ranks exited {codes}")
            ranks = [json.loads(Path(f"{tmp}/{r}.json").read_text()) for r in range(WORLD)]
        from importlib.metadata import version

        config = ParallelConfig.parse(layout)
        payload = {"megatron_core": version("megatron-core"),
                   "model": PRESETS[model_name].to_json(),
                   "config": {"dp": config.dp, "tp": config.tp, "pp": config.pp,
                              "distributed_optimizer": False, "ep": config.ep,
                              "cp": config.cp, "vpp": config.vpp},
                   "ranks": ranks}
        from tests.dist.megatron_cases import dumps_fixture

        (FIXTURE_DIR / f"{name}.json").write_text(dumps_fixture(payload))
        print(f"wrote {name}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        _describe(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
    else:
        main(sys.argv[1:])

"""`slurm-etc verify --sequence`: the elastic trainer through several resizes against
megatron-core's checkpoint-restart at every resize (see slurm_etc/worker/sequence.py)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from ..plan import load_model
from ..plan.errors import ConfigError
from .cmd_plan import human_bytes


def sequence_from_options(model_spec: str, text: str, distributed_optimizer: bool,
                          param_dtype: str | None, steps: int, global_batch: int | None,
                          seed: int, max_processes: int) -> Any:
    """The ResizeSequence the options describe; ConfigError (exit 2) when it cannot run."""
    from ..worker.sequence import (
        ResizeSequence,
        default_global_batch,
        parse_sequence,
        reference_of,
    )

    model = load_model(model_spec)
    if param_dtype and param_dtype != model.param_dtype:
        model = dataclasses.replace(model, param_dtype=param_dtype,
                                    name=f"{model.name}-{param_dtype}")
    configs = parse_sequence(text, distributed_optimizer)
    seq = ResizeSequence(model, tuple(configs), steps,
                         global_batch or default_global_batch(configs), seed=seed)
    if seq.processes > max_processes:
        raise ConfigError(f"the sequence needs {seq.processes} local processes, more than "
                          f"--max-processes ({max_processes})")
    reference_of(seq)  # what no reference can judge is refused before anything starts
    return seq


def render_sequence(r: dict, console: Console) -> None:
    t = Table(title=f"verify {r['model']}: {' -> '.join(r['sequence'])} "
                    f"({r['processes']} processes, global batch {r['global_batch']}; "
                    f"against {r['reference']})")
    for col in ("step", "layout", "loss elastic", f"loss {r['reference']}", "equal", "lr",
                "consumed"):
        t.add_column(col, justify="right")
    for row in r["per_step"]:
        if "missing" in row:
            t.add_row(str(row["step"]), "-", "-", "-", f"missing on {row['missing']}", "-", "-")
            continue
        t.add_row(str(row["step"]), row["layout"], f"{row['loss_elastic']:.9f}",
                  f"{row['loss_checkpoint']:.9f}",
                  "bit" if row["bit_equal"] else "within tol." if row["ok"] else "NO",
                  f"{row['lr_elastic']:.3e}" + ("" if row["lr_elastic"] == row["lr_checkpoint"]
                                                else " (differs)"),
                  str(row["consumed_elastic"]))
    console.print(t)
    for rz in r["resizes"]:
        console.print(f"resize {rz['from']} -> {rz['to']} at step {rz['at_step']}: moved "
                      f"{human_bytes(rz['moved_bytes'])}, pause {rz['pause_seconds']:.2f} s, "
                      f"{'/'.join(rz['outcomes'])}")
    what = ("shards compared bit for bit" if r["state_tolerance"] is None else
            f"full tensors compared (largest difference {r['state_max_rel_diff']:.2g} of a "
            f"tensor's norm, tolerance {r['state_tolerance']:g})")
    console.print(f"final state: {r['state_shards_compared']} {what}, "
                  f"{r['state_mismatches']} mismatches; result: "
                  + ("[green]VERIFIED[/green]" if r["verified"] else "[red]MISMATCH[/red]"))


def describe_sequence_failure(r: dict) -> str:
    bad = next((row for row in r["per_step"] if not row.get("ok")), None)
    if bad is not None:
        if "missing" in bad:
            return f"step {bad['step']} missing on the {bad['missing']} path"
        return (f"step {bad['step']} ({bad['layout']}): loss {bad['loss_elastic']!r} in place, "
                f"{bad['loss_checkpoint']!r} on the {r['reference']} path")
    if not r["lr_and_consumed_equal"]:
        return f"LR or consumed samples differ from the {r['reference']} path"
    if r["first_state_mismatch"]:
        m = r["first_state_mismatch"]
        return f"final state: shard {m['shard']} of new rank {m['new_rank']} {m['problem']}"
    return "a resize did not commit: " + json.dumps(r["resizes"])

"""`slurm-etc verify`: migrate a real megatron-core training state and check it bit for bit.

Spawns its own local processes (gloo on 127.0.0.1), builds the model under ``--from``
(seeded, trained a few Adam steps), migrates it in place to ``--to`` with the executor (the
elastic trainer's path, for every layout: dp, tp, pp, ep, vpp), and checks the result
through megatron-core's and torch's own interfaces, never through slurm-etc's shard adapter
or planner: full tensors of the old and the new layout, megatron's own checkpoint
resharding, Adam step, RNG, and the losses of three more training steps (see
docs/verify.md). Exit codes: 0 verified, 1 a mismatch (what differs named on stderr), 2 bad
input, 3 the run itself failed.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time

import click
from rich.console import Console
from rich.table import Table

from .. import bounds
from ..plan import ParallelConfig, load_model
from ..plan.errors import ConfigError
from .cmd_plan import human_bytes
from .errors import RunFailed
from .params import Layout, Number, Text


def progress_printer(enabled: bool = True):
    """A progress callback writing ``[  1.2s] message`` lines to stderr."""
    t0 = time.perf_counter()

    def show(message: str) -> None:
        if enabled:
            click.echo(f"[{time.perf_counter() - t0:6.1f}s] {message}", err=True)

    return show


def transition_from_options(model_spec: str, from_spec: str, to_spec: str,
                            distributed_optimizer: bool, param_dtype: str | None,
                            max_processes: int):
    """The Transition the options describe; ConfigError (exit 2) when they cannot run."""
    from ..harness.phases import Transition

    model = load_model(model_spec)
    if param_dtype and param_dtype != model.param_dtype:
        model = dataclasses.replace(model, param_dtype=param_dtype,
                                    name=f"{model.name}-{param_dtype}")
    old = ParallelConfig.parse(from_spec, distributed_optimizer)
    new = ParallelConfig.parse(to_spec, distributed_optimizer)
    from ..megatron.build import refuse_on_local_spec

    for config in (old, new):  # what megatron cannot build here, refused before any process
        refuse_on_local_spec(model, config)
    tr = Transition(model, old, new)
    if tr.processes > max_processes:
        raise ConfigError(f"{old} -> {new} needs {tr.processes} local processes, more than "
                          f"--max-processes ({max_processes})")
    return tr


def run_failed(exc: Exception) -> click.ClickException:
    """A failure of the run itself (not of the state): one line, exit code 3."""
    lines = [x for x in str(exc).strip().splitlines() if x.strip()]
    return RunFailed(f"{lines[0]} ... {lines[-1].strip()}" if len(lines) > 1
                     else (lines[0] if lines else type(exc).__name__))


def describe_mismatch(m: dict) -> str:
    """One line naming the tensor, the rank and the region a mismatch is in."""
    where = ""
    if "lo" in m:
        where = f" (box lo={tuple(m['lo'])} hi={tuple(m['hi'])})"
    if "new_rank" in m:
        where += f" on new rank {m['new_rank']}"
    elif "rank" in m:
        where += f" on {m.get('side', '')} rank {m['rank']}"
    what = m.get("problem") or (f"{m['differing']} of {m['of']} elements differ, first at "
                                f"{m['first']}: bits {m['got']} instead of {m['expected']}")
    return f"{m['state_key']}{where}, checked by {m['oracle']}: {what}"


def describe_failure(r: dict) -> str:
    """What made a report unverified, in one line (the first tensor when one differs)."""
    if r["first_mismatch"]:
        return describe_mismatch(r["first_mismatch"])
    if r["old_state_problems"]:
        p = r["old_state_problems"][0]
        return f"old state: {p['state_key']}: {p['problem']}"
    if r.get("unchecked_tensors"):
        return f"tensors no oracle checked: {', '.join(r['unchecked_tensors'][:5])}"
    step = r["step"]
    if not step["ok"]:
        return (f"Adam step: every parameter must be at step {step['expected']}; old "
                f"{step['old']}, migrated {step['migrated']}, checkpoint "
                f"{step['checkpoint'] or '-'}")
    rng = r.get("rng", {})
    if not r["rng_installed"]:
        wrong = rng.get("wrong_ranks", [])
        sources = {k: v for k, v in rng.get("sources", {}).items() if int(k) in wrong}
        return (f"RNG: new rank(s) {wrong} do not continue the CPU generator of their source "
                f"old rank(s) {sources}")
    loss = r["loss_after"]
    return (f"loss after the resize: migrated {loss.get('migrated')}, "
            f"{loss.get('compared_with')} "
            f"{loss.get('checkpoint', loss.get('old_layout'))} (tolerance "
            f"{loss.get('tolerance')})")


def render(report: dict, console: Console) -> None:
    r = report
    t = Table(title=f"verify {r['model']}: {r['from']} -> {r['to']} "
                    f"({r['processes']} processes)")
    t.add_column("", style="bold")
    t.add_column("value", justify="right")
    t.add_row("state tensors checked", str(r["tensors"]))
    t.add_row("shards compared (new ranks)", str(r["shards"]))
    t.add_row("bytes compared", human_bytes(r["bytes"]))
    t.add_row("bytes moved by the plan", human_bytes(r["moved_bytes"]))
    for oracle, count in sorted(r["oracles"].items()):
        t.add_row(f"checked by {oracle}", f"{count} of {r['tensors']} tensors")
    t.add_row("optimizer state checked by", r["optimizer_oracle"])
    t.add_row("Adam step old / migrated / checkpoint",
              " / ".join(",".join(map(str, r["step"][k])) or "-"
                         for k in ("old", "migrated", "checkpoint")))
    t.add_row("RNG continues the source rank's", "yes" if r["rng_installed"] else "NO")
    loss = r["loss_after"]
    for name in ("migrated", "checkpoint", "old_layout"):
        if loss.get(name):
            t.add_row(f"losses after the resize ({name.replace('_', ' ')})",
                      ", ".join(f"{x:.6f}" for x in loss[name]))
    t.add_row("mismatches", str(r["mismatches"]))
    t.add_row("result", "[green]VERIFIED[/green]" if r["verified"] else "[red]MISMATCH[/red]")
    t.add_row("seconds", f"{r['seconds']:.1f}")
    console.print(t)


@click.command()
@click.option("--model", "model_spec", required=True, type=Text(bounds.PATH_CHARS),
              help="Preset (tiny, tiny-llama, small, ...) or a JSON model description file.")
@click.option("--from", "from_spec", type=Layout(), help="Current layout, e.g. dp=1,tp=2,pp=2.")
@click.option("--to", "to_spec", type=Layout(), help="Next layout, e.g. dp=2,tp=1,pp=2.")
@click.option("--sequence", type=Text(bounds.LINE_CHARS),
              help="Instead of --from/--to: the elastic trainer through "
                                 "several layouts against megatron's checkpoint-restart at "
                                 "every resize, e.g. 'dp=2,tp=1,pp=2 -> dp=1,tp=2,pp=1 -> "
                                 "dp=3,tp=1,pp=1' (--steps: steps in each layout).")
@click.option("--global-batch", type=Number(bounds.BATCH),
              help="With --sequence: the global batch every layout keeps (default: the "
                   "least multiple of every dp that is >= 8).")
@click.option("--distributed-optimizer", is_flag=True, help="ZeRO-1 optimizer over dp.")
@click.option("--param-dtype", type=click.Choice(["fp32", "bf16"]), default=None,
              help="Override the model's parameter dtype (bf16: mixed precision).")
@click.option("--seed", default=1234, show_default=True, type=Number(bounds.SEED))
@click.option("--steps", default=2, show_default=True, type=Number(bounds.STEPS, low=1),
              help="Adam steps before the resize (moments must be non-zero); with "
                   "--sequence, steps in each layout.")
@click.option("--max-processes", default=8, show_default=True,
              type=Number(bounds.PROCESSES),
              help="Refuse transitions that need more local processes.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
@click.option("--corrupt", is_flag=True, hidden=True,
              help="Comparator self-test: flip one bit in the copy of new rank 0's migrated "
                   "state that the oracles read. It shows a difference is reported; it does not "
                   "show that a faulty migration is caught (tests/dist/test_planted_bugs.py "
                   "does).")
@click.pass_context
def verify(ctx, model_spec, from_spec, to_spec, sequence, global_batch, distributed_optimizer,
           param_dtype, seed, steps, max_processes, as_json, corrupt):
    """Migrate a real megatron-core state in place and compare every tensor bit for bit.

    The references read state through megatron-core and torch only: the old layout's full
    tensors, megatron's own checkpoint resharding, Adam step, RNG, and three more training
    steps' losses. With --sequence, the elastic trainer's losses, LR, consumed samples and
    final state against megatron's checkpoint-restart at every resize.
    Exit 0 verified, 1 a mismatch, 2 bad input, 3 the run failed.
    """
    if sequence is not None:
        if from_spec or to_spec:
            raise ConfigError("give either --sequence or --from/--to, not both")
        _verify_sequence(ctx, model_spec, sequence, distributed_optimizer, param_dtype, steps,
                         global_batch, seed, max_processes, as_json)
        return
    if not (from_spec and to_spec):
        raise ConfigError("give --from and --to (one resize) or --sequence (several)")
    tr = transition_from_options(model_spec, from_spec, to_spec, distributed_optimizer,
                                 param_dtype, max_processes)
    from ..harness.experiments import json_default
    from ..harness.verify import verify_transition
    from ..pool.local import WorkerFailed

    level = logging.getLogger().getEffectiveLevel()
    try:
        report = verify_transition(tr, seed=seed, steps=steps, corrupt=corrupt,
                                   progress=progress_printer(), log_level=level)
    except WorkerFailed as exc:
        logging.getLogger(__name__).info("worker failure: %s", exc)
        raise run_failed(exc) from None
    if as_json:
        click.echo(json.dumps(report, indent=2, default=json_default))
    else:
        render(report, Console())
    if not report["verified"]:
        click.echo(f"slurm-etc: verify: MISMATCH: {describe_failure(report)}", err=True)
        ctx.exit(1)


def _verify_sequence(ctx, model_spec, text, distributed_optimizer, param_dtype, steps,
                     global_batch, seed, max_processes, as_json) -> None:
    from ..harness.experiments import json_default
    from ..pool.local import WorkerFailed
    from ..worker.sequence import verify_sequence
    from .verify_sequence import describe_sequence_failure, render_sequence, sequence_from_options

    seq = sequence_from_options(model_spec, text, distributed_optimizer, param_dtype, steps,
                                global_batch, seed, max_processes)
    level = logging.getLogger().getEffectiveLevel()
    try:
        report = verify_sequence(seq, progress=progress_printer(), log_level=level)
    except WorkerFailed as exc:
        logging.getLogger(__name__).info("worker failure: %s", exc)
        raise run_failed(exc) from None
    if as_json:
        click.echo(json.dumps(report, indent=2, default=json_default))
    else:
        render_sequence(report, Console())
    if not report["verified"]:
        click.echo(f"slurm-etc: verify: MISMATCH: {describe_sequence_failure(report)}",
                   err=True)
        ctx.exit(1)

"""`slurm-etc plan`: what a resize would move, before anything moves (dry run); with
``--choose``, the layouts the chooser ranks for a number of nodes."""
from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from .. import bounds
from ..alloc.chooser import (
    EXTRA_DEGREES,
    GIB,
    Candidate,
    Hardware,
    TrainingJob,
    candidates,
    choose_config,
    iteration_time,
)
from ..plan import Layout, ParallelConfig, Topology, default_pool, load_model, plan_migration
from ..plan.errors import ConfigError
from .params import Layout as LayoutText
from .params import Number, Text, check_product

# No job spans more nodes than this; a node list beyond it is a typo, not a plan.
MAX_NODES = int(bounds.NODES.high)


def _node_list(text: str | None) -> list[int]:
    if not text:
        return []
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(lo), int(lo))
        except ValueError:
            raise ConfigError(f"--drop-nodes: cannot parse {part!r}; expected node indices "
                              "like 0,3,5-7") from None
        if not 0 <= first <= last < MAX_NODES:
            raise ConfigError(f"--drop-nodes: {part!r} is not a range of node indices "
                              f"0..{MAX_NODES - 1} (low-high, low <= high)")
        out.extend(range(first, last + 1))
        if len(out) > MAX_NODES:
            raise ConfigError(f"--drop-nodes: more than {MAX_NODES} node indices")
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def render(summary: dict, console: Console) -> None:
    s = summary
    t = Table(title=f"{s['model']}: {s['from']} ({s['old_devices']} devices) -> "
                    f"{s['to']} ({s['new_devices']} devices)", show_header=True)
    t.add_column("", style="bold")
    t.add_column("value", justify="right")
    t.add_column("", justify="right")
    need = max(s["needed_bytes"], 1)
    t.add_row("training state (unique)", human_bytes(s["total_state_bytes"]), "")
    t.add_row("needed by new ranks", human_bytes(s["needed_bytes"]), "100%")
    t.add_row("kept in place", human_bytes(s["kept_bytes"]), f"{100 * s['kept_bytes'] / need:.1f}%")
    t.add_row("moved within nodes", human_bytes(s["moved_intra_node_bytes"]),
              f"{100 * s['moved_intra_node_bytes'] / need:.1f}%")
    t.add_row("moved between nodes", human_bytes(s["moved_inter_node_bytes"]),
              f"{100 * s['moved_inter_node_bytes'] / need:.1f}%")
    t.add_row("byte lower bound", human_bytes(s["lower_bound_moved_bytes"]),
              f"moved / bound {_ratio(s['moved_over_lower_bound'])}")
    t.add_row("identity placement would move", human_bytes(s["naive_moved_bytes"]),
              f"moved / identity {_ratio(s['moved_over_naive'])}")
    t.add_row("messages / rounds", f"{s['messages']} / {s['rounds']}",
              f"{s['transfers']} regions")
    t.add_row("estimated transfer time", f"{s['est_seconds']:.3f} s",
              f"bound {s['lower_bound_seconds']:.3f} s, ratio "
              f"{_ratio(s['seconds_over_lower_bound'])}")
    t.add_row("planning time", f"{s['plan_seconds']:.3f} s", s.get("sketch", ""))
    console.print(t)


# Rows of the ranking shown (the table and --json alike).
SHOWN = 10

# Options of one mode only: (parameter name, option) given to the other mode is refused.
RESIZE_ONLY = (("from_spec", "--from"), ("to_spec", "--to"), ("drop_nodes", "--drop-nodes"),
               ("add_nodes", "--add-nodes"), ("no_tp_in_node", "--no-tp-in-node"))
CHOOSE_ONLY = (("nodes", "--nodes"), ("global_batch", "--global-batch"),
               ("micro_batch", "--micro-batch"), ("consider", "--consider"),
               ("memory_gib", "--memory-gib"))


def _given(options: tuple[tuple[str, str], ...]) -> list[str]:
    """The options of ``options`` given on the command line or in the environment."""
    ctx = click.get_current_context()
    return [flag for name, flag in options
            if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)]


def _degrees(text: str) -> frozenset[str]:
    """``ep,vpp,cp`` (any of them) or ``none``: the degrees --choose may use beyond dp/tp/pp."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["none"]:
        return frozenset()
    unknown = [n for n in names if n not in EXTRA_DEGREES]
    if unknown or not names:
        raise ConfigError(f"--consider: {', '.join(map(repr, unknown)) or 'nothing'} given; "
                          f"expected a comma list of {', '.join(EXTRA_DEGREES)}, or none")
    return frozenset(names)


def _row(c: Candidate, job: TrainingJob, hw: Hardware) -> dict:
    t = iteration_time(job, c.config, hw)
    return {"layout": str(c.config), "devices": c.config.world,
            "tokens_per_s": round(c.tokens_per_s, 1), "memory_bytes": c.memory_bytes,
            "step_seconds": round(t.total, 4), "bubble": round(t.bubble, 4),
            "comm_seconds": {k: round(getattr(t, k), 4) for k in ("tp", "pp", "dp", "ep", "cp")}}


def choose_summary(job: TrainingJob, hw: Hardware, nodes: int) -> dict:
    """The chooser's ranking for ``nodes`` whole nodes: the choice, why, and the best rows."""
    counts = [hw.gpus_per_node] * nodes
    choice = choose_config(job, hw, counts)
    ranked = candidates(job, hw, counts)
    return {"model": job.model.name, "nodes": nodes, "devices": sum(counts),
            "global_batch": job.global_batch, "micro_batch": job.micro_batch,
            "considered_degrees": ["dp", "tp", "pp"] + [n for n in EXTRA_DEGREES
                                                        if n in job.supports],
            "chosen": str(choice.config), "reason": choice.reason,
            "candidates": choice.considered,
            "ranking": [_row(c, job, hw) for c in ranked[:SHOWN]]}


def render_choice(summary: dict, console: Console) -> None:
    s = summary
    t = Table(title=f"{s['model']} on {s['devices']} devices ({s['nodes']} nodes), global batch "
                    f"{s['global_batch']}: {s['candidates']} layouts over "
                    f"{'/'.join(s['considered_degrees'])}", show_header=True)
    for name in ("#", "layout", "tokens/s", "GiB/device", "bubble", "tp s", "pp s", "dp s",
                 "ep s", "cp s"):
        t.add_column(name, justify="left" if name == "layout" else "right")
    for i, r in enumerate(s["ranking"], 1):
        comm = r["comm_seconds"]
        t.add_row(str(i), r["layout"], f"{r['tokens_per_s']:,.0f}",
                  f"{r['memory_bytes'] / GIB:.1f}", f"{r['bubble']:.1%}",
                  *(f"{comm[k]:.3f}" for k in ("tp", "pp", "dp", "ep", "cp")))
    console.print(t)
    console.print(f"chosen: {s['chosen']} ({s['reason']})", highlight=False)


@click.command()
@click.option("--model", "model_spec", required=True, type=Text(bounds.PATH_CHARS),
              help="Preset (tiny, small, gpt-1.3b, llama-7b, llama-13b, llama-70b, gpt-175b, "
                   "tiny-moe, mixtral-8x7b, qwen3-235b-a22b) or a JSON model description "
                   "file.")
@click.option("--from", "from_spec", type=LayoutText(),
              help="Current layout, e.g. dp=4,tp=2,pp=2 (required unless --choose).")
@click.option("--to", "to_spec", type=LayoutText(),
              help="Next layout, e.g. dp=3,tp=2,pp=2 (required unless --choose).")
@click.option("--choose", is_flag=True,
              help="Instead of planning a resize, rank the layouts the chooser considers for "
                   "--nodes whole nodes (estimated tokens/s, memory, bubble, communication) "
                   "and name its choice.")
@click.option("--nodes", type=Number(bounds.NODES), help="--choose: nodes the job holds.")
@click.option("--global-batch", type=Number(bounds.BATCH),
              help="--choose: sequences per optimizer step (kept across layouts).")
@click.option("--micro-batch", type=Number(bounds.BATCH), default=1, show_default=True,
              help="--choose: sequences per micro-batch.")
@click.option("--consider", default=",".join(EXTRA_DEGREES), show_default=True,
              type=Text(bounds.LINE_CHARS),
              help="--choose: degrees beyond dp/tp/pp it may use (a comma list of "
                   + ", ".join(EXTRA_DEGREES) + ", or none: what the elastic worker builds "
                   "today, as `slurm-etc run` chooses).")
@click.option("--memory-gib", default=Hardware.memory_gib, show_default=True,
              type=Number(bounds.MEMORY_GIB), help="--choose: memory per device (GiB).")
@click.option("--gpus-per-node", default=8, show_default=True,
              type=Number(bounds.GPUS_PER_NODE))
@click.option("--drop-nodes", default=None, type=Text(bounds.LINE_CHARS),
              help="Node indices leaving the job (e.g. 0,3,5-7); default: keep the first nodes.")
@click.option("--add-nodes", default=None, type=Number(bounds.NODES, low=0),
              help="Nodes joining the job; default: as many as the new layout needs.")
@click.option("--distributed-optimizer", is_flag=True, help="ZeRO-1 optimizer over dp.")
@click.option("--intra-node-gbps", default=150.0, show_default=True,
              type=Number(bounds.GBPS),
              help="Per-device bandwidth inside a node (GB/s).")
@click.option("--inter-node-gbps", default=25.0, show_default=True,
              type=Number(bounds.GBPS),
              help="Per-device bandwidth between nodes (GB/s).")
@click.option("--no-tp-in-node", is_flag=True,
              help="Allow tensor-parallel groups to span nodes.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def plan(model_spec, from_spec, to_spec, choose, nodes, global_batch, micro_batch, consider,
         memory_gib, gpus_per_node, drop_nodes, add_nodes, distributed_optimizer,
         intra_node_gbps, inter_node_gbps, no_tp_in_node, as_json):
    """Plan a resize: bytes kept and moved, messages, rounds, time, against lower bounds.

    With --choose: rank the layouts for --nodes nodes as the layout chooser does.
    """
    if choose:
        given = _given(RESIZE_ONLY)
        if given:
            raise click.UsageError(f"--choose ranks layouts for --nodes; it takes no "
                                   f"{', '.join(given)}")
        for option, value in (("--nodes", nodes), ("--global-batch", global_batch)):
            if value is None:
                raise click.UsageError(f"--choose needs {option}")
        check_product("the devices to choose for",
                      {"--nodes": nodes, "--gpus-per-node": gpus_per_node}, bounds.DEVICES)
        hw = Hardware(gpus_per_node=gpus_per_node, memory_gib=memory_gib,
                      intra_node_gbps=intra_node_gbps, inter_node_gbps=inter_node_gbps)
        if hw.reserved_gib >= memory_gib:
            raise ConfigError(f"--memory-gib ({memory_gib:g}) must exceed the "
                              f"{hw.reserved_gib:g} GiB reserved per device")
        job = TrainingJob(load_model(model_spec), global_batch, micro_batch,
                          distributed_optimizer, _degrees(consider))
        summary = choose_summary(job, hw, nodes)
        if as_json:
            click.echo(json.dumps(summary, indent=2))
        else:
            render_choice(summary, Console(width=160))
        return
    given = _given(CHOOSE_ONLY)
    if given:
        raise click.UsageError(f"{', '.join(given)} only go with --choose")
    for option, value in (("--from", from_spec), ("--to", to_spec)):
        if value is None:
            raise click.UsageError(f"Missing option '{option}' (or give --choose)")
    model = load_model(model_spec)
    old_cfg = ParallelConfig.parse(from_spec, distributed_optimizer)
    new_cfg = ParallelConfig.parse(to_spec, distributed_optimizer)
    old_cfg.validate_for(model)
    new_cfg.validate_for(model)
    # the devices the plan may use: the old layout's nodes and the added ones, x GPUs
    old_nodes = -(-old_cfg.world // gpus_per_node)
    nodes = old_nodes + (add_nodes or 0)
    check_product("the old layout's nodes + --add-nodes", {"nodes": nodes}, bounds.NODES)
    check_product("the plan's devices", {"nodes": nodes, "--gpus-per-node": gpus_per_node},
                  bounds.DEVICES)
    topo = Topology(gpus_per_node, intra_node_gbps, inter_node_gbps)
    old = Layout(old_cfg, tuple(range(old_cfg.world)))
    pool = default_pool(old, new_cfg, topo, _node_list(drop_nodes), add_nodes)
    result = plan_migration(model, old, new_cfg, pool, topo, keep_tp_in_node=not no_tp_in_node)
    summary = result.summary()
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        render(summary, Console())

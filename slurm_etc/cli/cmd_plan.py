"""`slurm-etc plan`: what a resize would move, before anything moves (dry run)."""
from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from .. import bounds
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


@click.command()
@click.option("--model", "model_spec", required=True, type=Text(bounds.PATH_CHARS),
              help="Preset (tiny, small, gpt-1.3b, llama-7b, llama-13b, llama-70b, gpt-175b) or "
                   "a JSON model description file.")
@click.option("--from", "from_spec", required=True, type=LayoutText(),
              help="Current layout, e.g. dp=4,tp=2,pp=2.")
@click.option("--to", "to_spec", required=True, type=LayoutText(),
              help="Next layout, e.g. dp=3,tp=2,pp=2.")
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
def plan(model_spec, from_spec, to_spec, gpus_per_node, drop_nodes, add_nodes,
         distributed_optimizer, intra_node_gbps, inter_node_gbps, no_tp_in_node, as_json):
    """Plan a resize: bytes kept and moved, messages, rounds, time, against lower bounds."""
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

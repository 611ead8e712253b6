"""Downtime against state size: ``slurm-etc bench migrate`` over a ladder of model sizes.

For each model (default: the ladder in bench/models/, 0.26 to 1.98 GiB of fp32 Adam state)
one ``slurm-etc bench migrate --json`` runs both resize paths side by side (in place, and
megatron's checkpoint save fsynced + stop + cold start + load), ``--repeat`` times, medians.
Each size runs in a process of its own (its memory is returned before the next size starts)
while this driver samples the host's available memory. Written:

* ``bench/results/migrate_scaling.json``: per size the table's figures, where each path's
  time goes, the load average before and after, the host memory's low-water mark and the
  whole ``bench migrate`` summary; the git commit; rewritten after every size
  (``"complete": false`` until the last);
* ``bench/results/migrate_scaling.png``: downtime of both paths against state size, and
  each path's parts per size;
* a table on stdout (or the JSON with ``--json``); progress on stderr.

    .venv/bin/python bench/migrate_scaling.py [--models a.json,b.json,...] \\
        [--from dp=1,tp=2,pp=2] [--to dp=2,tp=1,pp=2] [--repeat 3]

Exit codes: 0 done, 2 bad input (one line, nothing written), 3 a size's run failed (the
sizes done so far stay in the JSON, ``"complete": false``).
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click
import psutil
from rich.console import Console
from rich.table import Table

from slurm_etc.cli.cmd_bench import phase_label
from slurm_etc.cli.cmd_plan import human_bytes
from slurm_etc.cli.cmd_verify import progress_printer, transition_from_options
from slurm_etc.cli.errors import RunFailed
from slurm_etc.plan.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LADDER = ROOT / "bench" / "models"
GIB = 2**30
# Per process: the interpreter with torch and megatron-core imported (measured ~0.5 GiB).
PROCESS_BYTES = 3 * GIB // 4
# Left free for everyone else on the machine.
MEMORY_SPARE = 2 * GIB


def ladder() -> list[str]:
    """The default models: every bench/models/*.json, smallest state first."""
    return [str(p) for p in sorted(LADDER.glob("*.json"))]


def memory_needed(tr, p2p_bytes: int) -> int:
    """A rough upper bound of the host memory one size's ``bench migrate`` takes at its
    peak: the in-place resize, with the old and the new state side by side.

    Every process of both layouts holds its state with its gradients (fp32 gradients: a
    third more than params + main + two moments), counted as if nothing were sharded over
    dp; the staging and the raw probes that follow (the state dropped by then) are bounded
    by the moved bytes and two point-to-point buffers; and each process its interpreter.
    """
    plan = tr.plan()
    held = (tr.old.dp + tr.new.dp) * plan.catalog.total_bytes * 4 // 3
    return held + plan.moved_bytes + 2 * p2p_bytes + tr.processes * PROCESS_BYTES


def check_fits(transitions: list, p2p_bytes: int, workdir: str) -> None:
    """ConfigError (exit 2) when a size cannot fit this machine's memory or disk."""
    available = psutil.virtual_memory().available
    free_disk = shutil.disk_usage(workdir).free
    for spec, tr in transitions:
        need = memory_needed(tr, p2p_bytes)
        if need > available - MEMORY_SPARE:
            raise ConfigError(
                f"{spec}: about {need / GIB:.1f} GiB of memory needed ({tr.processes} "
                f"processes, old and new state with gradients, probes, interpreters), "
                f"{available / GIB:.1f} GiB available ({MEMORY_SPARE / GIB:.0f} GiB of it "
                "kept free); leave it out of --models or free memory")
        ckpt = tr.plan().catalog.total_bytes * 6 // 5
        if ckpt > free_disk:
            raise ConfigError(f"{spec}: its checkpoint needs about {ckpt / GIB:.1f} GiB on "
                              f"{workdir}, {free_disk / GIB:.1f} GiB free; set TMPDIR to a "
                              "disk with room")


def check_output(path: Path, what: str) -> None:
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory; give a file path")
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(f"{what} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{what} {path}: directory {parent} is not writable")


class MemoryWatch:
    """The host's available memory, sampled every ``every`` seconds: its low-water mark."""

    def __init__(self, every: float = 0.25):
        self.every = every
        self.before = psutil.virtual_memory().available
        self.low = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.low = min(self.low, psutil.virtual_memory().available)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"total": psutil.virtual_memory().total, "available_before": self.before,
                "available_min": self.low, "used_at_peak": self.before - self.low}


def run_size(spec: str, label: str, args: list[str], progress) -> tuple[dict | None, str]:
    """One ``slurm-etc bench migrate --json`` in a process of its own; its progress lines
    are passed on to stderr under ``label``. Returns its summary (None when it failed) and
    the last lines it wrote to stderr."""
    cmd = [sys.executable, "-c", "from slurm_etc.cli.main import main; main()",
           "bench", "migrate", "--model", spec, *args, "--json"]
    tail: collections.deque[str] = collections.deque(maxlen=3)
    # a session of its own: the run and the worker processes it starts end together if
    # this driver is interrupted
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(proc.stdout.read()),  # type: ignore[union-attr]
                                  daemon=True)
        reader.start()
        try:
            for line in proc.stderr:  # type: ignore[union-attr]
                line = line.rstrip("\n")
                tail.append(line)
                progress(f"{label} {line}")
            proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        reader.join()
    if proc.returncode != 0:
        return None, " | ".join(tail)
    return json.loads("".join(out)), ""


def size_row(spec: str, s: dict, memory: dict) -> dict:
    """The figures of one size: both downtimes, where each path's time goes, ratio."""
    p = s["checkpoint_parts"]
    return {
        "model": s["model"], "model_spec": spec,
        "state_bytes": s["state_bytes"], "state_gib": s["state_bytes"] / GIB,
        "moved_bytes": s["moved_bytes"], "checkpoint_bytes": p["checkpoint_bytes"],
        "in_place_seconds": s["etc_seconds"],
        "in_place_parts": s["etc_parts"],
        "prepared_before_pause": s["prepare_parts"],
        "checkpoint_seconds": s["checkpoint_seconds"],
        "checkpoint_parts": {"save": p["save"], "stop": p["stop"],
                             "cold_start": p["cold_start"],
                             "group_build_load": p["build_load"]},
        "checkpoint_load_parts": {k: p[k] for k in ("group", "build", "load")},
        "checkpoint_seconds_all_at_once": s["checkpoint_seconds_all_at_once"],
        "ratio": s["ratio"], "ratios": s["ratios"],
        "ratio_all_at_once": s["ratio_all_at_once"],
        "data_seconds": s["data_seconds"],
        "data_over_raw_pattern": s["data_over_raw_pattern"],
        "same_state": s["same_state"], "checkpoint_complete": s["checkpoint_complete"],
        "load_average": s["load_average"], "host_memory": memory,
    }


def git_commit() -> dict:
    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def plot(result: dict, path: Path) -> None:
    """Downtime of both paths against state size, and each path's parts per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["sizes"]
    x = [r["state_gib"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 5.2))
    a.plot(x, [r["checkpoint_seconds"] for r in rows], "o-", color="tab:red",
           label="checkpoint-restart (cold start per process core)")
    a.plot(x, [r["checkpoint_seconds_all_at_once"] for r in rows], "o:", color="tab:red",
           alpha=0.5, label="checkpoint-restart (cold start all at once)")
    a.plot(x, [r["in_place_seconds"] for r in rows], "s-", color="tab:blue", label="in place")
    for r in rows:
        if r["ratio"]:
            a.annotate(f"{r['ratio']:.1f}x", (r["state_gib"], r["checkpoint_seconds"]),
                       textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    a.set_yscale("log")
    a.set_xlabel("training state (GiB, fp32 params + 2 Adam moments)")
    a.set_ylabel("downtime (s, first pause -> last rank ready)")
    a.set_title("downtime against state size (ratio above)")
    a.grid(True, which="both", alpha=0.3)
    a.legend(fontsize=8)
    labels = [f"{g:.2f}" for g in x]
    for ax, key, title in ((b, "checkpoint_parts", "checkpoint-restart: where the time goes"),
                           (c, "in_place_parts", "in place: where the time goes")):
        names: list[str] = []
        for r in rows:
            names += [k for k in r[key] if k not in names]
        bottom = [0.0] * len(rows)
        for name in names:
            h = [r[key].get(name) or 0.0 for r in rows]
            ax.bar(labels, h, bottom=bottom, label=phase_label(name))
            bottom = [u + v for u, v in zip(bottom, h)]
        ax.set_xlabel("training state (GiB)")
        ax.set_ylabel("seconds (medians; slowest rank per part)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    where = result["transition"]
    git = result["git"]
    fig.suptitle(f"slurm-etc bench migrate, {where['from']} -> {where['to']}, "
                 f"{result['processes']} processes on {result['cpus']} cores, medians of "
                 f"{result['repeat']}{'' if result['complete'] else ' (sizes done so far)'}"
                 f"; commit {(git['commit'] or '?')[:10]}"
                 f"{' (dirty)' if git['dirty'] else ''}", fontsize=10)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        plt.close(fig)


def _f(x, unit: str = "", digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def render(result: dict, console: Console) -> None:
    where = result["transition"]
    t = Table(title=f"downtime against state size: {where['from']} -> {where['to']} "
                    f"({result['processes']} processes, medians of {result['repeat']})")
    for col in ("state", "in place", "in place: where it goes", "checkpoint",
                "checkpoint: where it goes", "ratio", "data / raw pattern", "same state",
                "load 1 min"):
        t.add_column(col, justify="left" if "where" in col else "right")
    for r in result["sizes"]:
        load = r["load_average"]
        t.add_row(human_bytes(r["state_bytes"]), _f(r["in_place_seconds"], " s"),
                  ", ".join(f"{phase_label(k)} {_f(v)}" for k, v in r["in_place_parts"].items()),
                  _f(r["checkpoint_seconds"], " s"),
                  ", ".join(f"{phase_label(k)} {_f(v)}"
                            for k, v in r["checkpoint_parts"].items()),
                  _f(r["ratio"], "x", 1), _f(r["data_over_raw_pattern"]),
                  {True: "yes", False: "NO", None: "-"}[r["same_state"]],
                  f"{load['before'][0]:.1f} -> {load['after'][0]:.1f}")
    console.print(t)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--models", default=None,
              help="Comma-separated presets or model JSON files; default: bench/models/*.json.")
@click.option("--from", "from_spec", default="dp=1,tp=2,pp=2", show_default=True)
@click.option("--to", "to_spec", default="dp=2,tp=1,pp=2", show_default=True)
@click.option("--distributed-optimizer", is_flag=True)
@click.option("--repeat", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--p2p-mb", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--max-processes", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--out-json", default=str(RESULTS / "migrate_scaling.json"), show_default=True,
              type=click.Path(path_type=Path))
@click.option("--out-png", default=str(RESULTS / "migrate_scaling.png"), show_default=True,
              type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="The JSON on stdout instead of a table.")
@click.pass_obj
def scaling(argv, models, from_spec, to_spec, distributed_optimizer, repeat, p2p_mb, max_processes,
            out_json, out_png, as_json) -> None:
    """Both resize paths over a ladder of state sizes: table, JSON and PNG."""
    specs = [m.strip() for m in models.split(",")] if models is not None else ladder()
    if not specs or not all(specs):
        raise ConfigError("--models needs one or more comma-separated presets or model "
                          "JSON files, e.g. tiny,bench/models/state-0.5gib.json")
    transitions = [(spec, transition_from_options(spec, from_spec, to_spec,
                                                  distributed_optimizer, None, max_processes))
                   for spec in specs]
    if len({tr.plan().catalog.total_bytes for _, tr in transitions}) < len(transitions):
        raise ConfigError("--models: two models have the same state size; give distinct sizes")
    transitions.sort(key=lambda st: st[1].plan().catalog.total_bytes)
    check_output(out_json, "--out-json")
    check_output(out_png, "--out-png")
    check_fits(transitions, p2p_mb << 20, tempfile.gettempdir())

    progress = progress_printer()
    tr0 = transitions[0][1]
    result: dict = {
        "transition": {"from": str(tr0.old), "to": str(tr0.new),
                       "distributed_optimizer": distributed_optimizer},
        "processes": tr0.processes, "repeat": repeat, "cpus": os.cpu_count(),
        "command": ["bench/migrate_scaling.py", *argv], "git": git_commit(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "complete": False, "sizes": [], "summaries": []}
    args = ["--from", from_spec, "--to", to_spec, "--repeat", str(repeat),
            "--p2p-mb", str(p2p_mb), "--max-processes", str(max_processes)]
    if distributed_optimizer:
        args.append("--distributed-optimizer")
    for i, (spec, tr) in enumerate(transitions):
        size = human_bytes(tr.plan().catalog.total_bytes)
        label = f"[size {i + 1}/{len(transitions)} {size}]"
        progress(f"{label} {tr.model.name}: both paths, {repeat} repeat(s)")
        watch = MemoryWatch()
        summary, why = run_size(spec, label, args, progress)
        memory = watch.stop()
        if summary is None:
            write_atomic(out_json, json.dumps(result, indent=2).encode())
            raise RunFailed(f"{spec} ({size}): bench migrate failed: {why}; the "
                            f"sizes before it are in {out_json} (complete: false)")
        result["sizes"].append(size_row(spec, summary, memory))
        result["summaries"].append(summary)
        if len(result["sizes"]) == len(transitions):
            result["complete"] = True
            result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        plot(result, out_png)
        write_atomic(out_json, json.dumps(result, indent=2).encode())
        r = result["sizes"][-1]
        progress(f"{label} in place {_f(r['in_place_seconds'], ' s')}, checkpoint "
                 f"{_f(r['checkpoint_seconds'], ' s')}, ratio {_f(r['ratio'], 'x', 1)}")
    progress(f"wrote {out_json} and {out_png}")
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        render(result, Console())


def main(argv: list[str] | None = None) -> int:
    """Runs the command; a mistake in what was asked is one line on stderr, exit 2."""
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        scaling.main(argv, prog_name="migrate_scaling.py", standalone_mode=False, obj=argv)
    except ConfigError as exc:
        click.echo(f"migrate_scaling.py: error: {exc}", err=True)
        return 2
    except click.UsageError as exc:
        click.echo(f"migrate_scaling.py: error: {' '.join(exc.format_message().split())}",
                   err=True)
        return exc.exit_code
    except click.ClickException as exc:
        click.echo(f"migrate_scaling.py: error: {exc.format_message()}", err=True)
        return exc.exit_code
    except click.Abort:
        click.echo("Aborted!", err=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

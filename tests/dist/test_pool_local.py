"""The local worker pool: results in worker order, loud failures, restart, no orphans.

Most cases run in the tests' convention (``default_group=True``, ``func(rank, world, ...)``,
through :func:`tests.dist.harness.pool_fixture`); the last ones in the product's
(``func(ctx, ...)`` with a :class:`WorkerContext`, as ``slurm-etc verify`` runs its phases).
"""
from __future__ import annotations

import os
import time

import pytest

from slurm_etc.pool.local import (
    LocalWorkers,
    WorkerContext,
    WorkerDied,
    WorkerError,
    WorkerFailed,
    WorkerTimeout,
)
from tests.dist.harness import pool_fixture

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

pool2 = pool_fixture(2, timeout_s=60)


def _rank_sum(rank: int, world: int, offset: int) -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + offset)])
    dist.all_reduce(value)
    return rank, world, float(value[0])


def _fail_on(rank: int, world: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    return rank


def _hang_on(rank: int, world: int, bad_rank: int) -> int:
    if rank == bad_rank:
        time.sleep(600)
    return rank


def _exit_on(rank: int, world: int, bad_rank: int) -> int:
    if rank == bad_rank:
        os._exit(7)
    return rank


def _pid(rank: int, world: int) -> int:
    return os.getpid()


def test_runs_a_collective_and_returns_results_in_rank_order(pool2):
    assert pool2.run(_rank_sum, 10) == [(0, 2, 21.0), (1, 2, 21.0)]


def test_worker_exception_is_raised_with_rank_and_remote_traceback(pool2):
    with pytest.raises(WorkerError) as info:
        pool2.run(_fail_on, 1)
    assert info.value.index == 1
    assert isinstance(info.value, WorkerFailed)  # what the CLI catches
    assert "deliberate failure on rank 1" in info.value.remote_traceback
    assert "_fail_on" in str(info.value)
    # The other rank finished normally, so the same workers keep serving.
    pids = pool2.pids
    assert pool2.run(_rank_sum, 0) == [(0, 2, 1.0), (1, 2, 1.0)]
    assert pool2.pids == pids


def test_unpicklable_call_is_refused_before_any_rank_runs_it(pool2):
    pids = pool2.pids
    with pytest.raises(TypeError, match="cannot send"):
        pool2.run(lambda rank, world: rank)
    assert pool2.run(_rank_sum, 0) == [(0, 2, 1.0), (1, 2, 1.0)]
    assert pool2.pids == pids


def _unpicklable_result(rank: int, world: int):
    return lambda: rank


def test_unpicklable_result_is_reported_as_a_worker_error(pool2):
    with pytest.raises(WorkerError, match="worker 0 raised"):
        pool2.run(_unpicklable_result)


def test_timeout_names_the_rank_and_the_pool_restarts(pool2):
    old_pids = pool2.pids
    with pytest.raises(WorkerTimeout, match=r"workers \[0\] did not answer .*_hang_on"):
        pool2.run(_hang_on, 0, timeout_s=3)
    assert not any(_alive(pid) for pid in old_pids)
    assert pool2.run(_rank_sum, 1) == [(0, 2, 3.0), (1, 2, 3.0)]
    assert set(pool2.pids).isdisjoint(old_pids)


def test_worker_death_is_reported_and_the_pool_restarts(pool2):
    with pytest.raises(WorkerDied, match=r"worker 1 \(pid \d+\) exited with code 7"):
        pool2.run(_exit_on, 1)
    assert pool2.run(_fail_on, -1) == [0, 1]


def test_close_leaves_no_processes_behind():
    pool = LocalWorkers(2, default_group=True)
    with pool:
        pids = pool.run(_pid)
        assert pids == pool.pids
    assert not any(_alive(pid) for pid in pids)


def _remember(ctx: WorkerContext, value: str) -> tuple[int, int, str | None, bool]:
    import torch.distributed as dist

    previous = ctx.objects.get("value")
    ctx.objects["value"] = value
    return ctx.index, ctx.size, previous, dist.is_initialized()


def _group_sum(ctx: WorkerContext, tag: str) -> float:
    import torch
    import torch.distributed as dist

    ctx.init_group(tag, ctx.index, ctx.size)
    value = torch.tensor([float(ctx.index + 1)])
    dist.all_reduce(value)
    return float(value[0])


def _drop(ctx: WorkerContext) -> bool:
    import torch.distributed as dist

    ctx.objects.clear()  # nothing megatron to tear down
    ctx.drop()
    return dist.is_initialized()


def test_context_workers_keep_objects_and_start_groups_from_the_store():
    with LocalWorkers(2, timeout_s=60) as workers:
        # no default group: each phase starts what it needs
        assert workers.run(_remember, "a") == [(0, 2, None, False), (1, 2, None, False)]
        assert workers.run(_remember, "b") == [(0, 2, "a", False), (1, 2, "a", False)]
        assert workers.run(_group_sum, "first") == [3.0, 3.0]
        assert workers.run(_group_sum, "second") == [3.0, 3.0]  # replaces the first group
        assert workers.run(_drop) == [False, False]
        pids = workers.pids
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); a reaped process does not.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _where(ctx: WorkerContext) -> tuple[str | None, str, str | None, bool]:
    import sys

    return (os.environ.get("SLURM_ETC_POOL_PROBE"), os.getcwd(),
            os.environ.get("OMP_NUM_THREADS"), "/pool-probe-path" in sys.path)


@pytest.mark.parametrize("cold", [False, True], ids=["forkserver", "spawn"])
def test_workers_get_the_parents_environment_cwd_and_path_at_their_start(
        cold, tmp_path, monkeypatch):
    """Forked from the forkserver (started earlier, with another environment) or spawned,
    a worker sees what its parent has when the pool starts."""
    import sys

    with LocalWorkers(1, timeout_s=60) as before:  # the forkserver runs from here on
        assert before.run(_where)[0][0] is None
    monkeypatch.setenv("SLURM_ETC_POOL_PROBE", f"probe-{cold}-{time.time()}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [*sys.path, "/pool-probe-path"])
    with LocalWorkers(2, timeout_s=60, cold=cold) as workers:
        got = workers.run(_where)
    assert got == [(os.environ["SLURM_ETC_POOL_PROBE"], str(tmp_path), "1", True)] * 2


PARENT = """
import sys, time
from slurm_etc.pool.local import LocalWorkers

def main():
    pool = LocalWorkers(2, timeout_s=60)
    pool.start()
    print(" ".join(map(str, pool.pids)), flush=True)
    time.sleep(600)

if __name__ == "__main__":
    main()
"""


def test_workers_of_a_killed_parent_exit():
    """No orphans: the parent SIGKILLed (no close), its forked workers exit on their own."""
    import signal
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), pids


def _say(ctx: WorkerContext, text: str) -> None:
    os.write(2, f"{text} from worker {ctx.index}\n".encode())


@pytest.mark.parametrize("cold", [False, True], ids=["forkserver", "spawn"])
def test_workers_write_to_the_parents_stderr(cold, capfd):
    """What a worker writes to fd 2 (a faulthandler dump on a timeout, a warning) reaches the
    stderr its parent has at the pool's start, not the forkserver's."""
    with capfd.disabled():  # the forkserver starts (if not yet) with another stderr
        with LocalWorkers(1, timeout_s=60) as before:
            before.run(_say, "warm-up")
    with LocalWorkers(2, timeout_s=60, cold=cold) as workers:
        workers.run(_say, f"hello-{cold}")
    err = capfd.readouterr().err
    assert f"hello-{cold} from worker 0" in err and f"hello-{cold} from worker 1" in err, err

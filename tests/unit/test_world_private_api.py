"""The private torch APIs ``slurm_etc/megatron/world.py`` relies on (torch 2.13).

If torch renames or changes them, this fails here, in one process, before the multi-process
tests hang: the helper that starts a group from a store without a default group, the world
registry's tables, ``_update_default_pg``, the group-name registry, ``GroupName``. Then one
real single-rank world: started from a store with no default group, made the default, a
collective and a ``new_group`` inside it, retired and shut down.
"""
from __future__ import annotations

import inspect
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from slurm_etc.megatron import world


def test_private_torch_api_is_there():
    params = inspect.signature(c10d._new_process_group_helper).parameters
    assert list(params)[:6] == ["group_size", "group_rank", "global_ranks_in_group",
                                "backend", "store", "group_name"]
    assert {"timeout", "group_desc"} <= set(params)
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config",
                  "pg_coalesce_state", "pg_to_tag", "tags_to_pg"):
        assert isinstance(getattr(c10d._world, table), dict), table
    assert isinstance(c10d._world.group_count, int)
    assert list(inspect.signature(c10d._update_default_pg).parameters) == ["pg"]
    assert callable(c10d._unregister_process_group)
    assert c10d.GroupName("x") == "x"


@pytest.fixture
def no_default_group():
    if dist.is_initialized():
        pytest.fail("a default process group is already initialized in the test process")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    world.shutdown_retired()


def test_world_group_without_default_group(no_default_group):
    store = dist.HashStore()
    group = world.start_world_group(1, 0, dist.PrefixStore("w", store), name="unit",
                                    timeout_s=10)
    assert not dist.is_initialized()  # started beside nothing: no default group needed
    assert group in c10d._world.pg_map and dist.get_backend(group) == "gloo"
    c10d._update_default_pg(group)
    assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
    t = torch.ones(3)
    dist.all_reduce(t)
    sub = dist.new_group([0], timeout=timedelta(seconds=10))
    dist.all_reduce(t, group=sub)
    assert t.tolist() == [1.0, 1.0, 1.0]
    world._retire(sub)
    assert sub not in c10d._world.pg_map and world._RETIRED == [sub]
    assert world.shutdown_retired() == 1 and world._RETIRED == []


def test_retired_groups_are_shut_down_off_the_calling_thread():
    """A switch leaves the old groups' shutdown (2 ms per gloo group) to a thread of its
    own; wait_retired joins it, and the next start of a world finds nothing left."""
    import threading

    ran_on: list[str] = []

    class Retired:
        def shutdown(self) -> None:
            time.sleep(0.05)
            ran_on.append(threading.current_thread().name)

    world._RETIRED.extend([Retired(), Retired()])
    t0 = time.perf_counter()
    world.retire_in_background()
    assert time.perf_counter() - t0 < 0.05  # the caller did not wait for them
    world.wait_retired()
    assert world._RETIRED == []
    assert ran_on == ["slurm-etc-retire-groups"] * 2 and world._RETIRING is None
    assert world.shutdown_retired() == 0

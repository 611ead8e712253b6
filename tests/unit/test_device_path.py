"""The GPU path checked on the CPU (issue #41): where the runtime creates tensors, how a
migration's rounds are posted, whether a resize fits on the device, which device and
backends a worker takes. Every check is shown to catch a planted bug."""
from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict

import pytest
import torch

from slurm_etc.megatron.resize import memory_need
from slurm_etc.migrate import device as devmod
from slurm_etc.migrate import transport as transport_module
from slurm_etc.migrate.device import (
    Compute,
    DeviceMemoryError,
    MemoryNeed,
    check_fits,
    select,
    to_device,
)
from slurm_etc.migrate.executor import MigrationOptions, execute_migration, staging_bytes
from slurm_etc.migrate.program import compile_program, group_devices
from slurm_etc.migrate.transport import BackendTransport, ThreadHub
from slurm_etc.plan import PRESETS
from slurm_etc.plan.errors import ConfigError
from slurm_etc.testing.device_routing import recording
from slurm_etc.testing.fake_state import fake_shards, shard_mismatches
from tests.unit.plan_helpers import make_plan

pytestmark = pytest.mark.unit

OPTS = MigrationOptions(measure_memory=False, timeout_s=20, staging_bytes=64 << 10)
PLANS = [((1, 2, 2), (2, 2, 2), False), ((2, 2, 2), (2, 1, 2), True),
         ((1, 4, 1), (2, 1, 2), False), ((1, 1, 4), (2, 2, 1), True)]


class Recorded:
    """A transport that logs every exchange call (tag, sends' peers, receives' peers) of its
    rank and passes it on: what the batched-round rule is checked on."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log
        self.rank, self.size, self.device, self.backend = (inner.rank, inner.size,
                                                           inner.device, inner.backend)

    def empty(self, nbytes):
        return self.inner.empty(nbytes)

    def exchange(self, sends, recvs, tag):
        self.log.append((tag, tuple(p for p, _ in sends), tuple(p for p, _ in recvs)))
        return self.inner.exchange(sends, recvs, tag)

    def allgather(self, payload, timeout_s):
        return self.inner.allgather(payload, timeout_s)

    def start_allgather(self, payload):
        return self.inner.start_allgather(payload)


class PostsApart(Recorded):
    """The planted bug: a step's sends and receives posted in two calls (NCCL deadlocks
    when two ranks each wait in a send the other posts its receive for afterwards)."""

    def exchange(self, sends, recvs, tag):
        out = []
        if sends:
            self.log.append((tag, tuple(p for p, _ in sends), ()))
            out += self.inner.exchange(sends, [], tag)
        if recvs:
            self.log.append((tag, (), tuple(p for p, _ in recvs)))
            out += self.inner.exchange([], recvs, tag)
        return out


def batched_round_violations(logs: dict[int, list]) -> list[str]:
    """The rule NCCL needs, over every rank's exchange calls: each call is one round (its
    tag) and a rank posts each round once, rounds in increasing order, and a send of round t
    to a peer is matched by that peer's receive in its own call of round t (so the two ends'
    operations sit in one group call each, issued in the same order on every rank)."""
    out = []
    calls = {r: {} for r in logs}
    for rank, log in logs.items():
        tags = [tag for tag, _, _ in log]
        if len(set(tags)) != len(tags):
            out.append(f"rank {rank} posts a round in more than one call: {tags}")
        if tags != sorted(tags):
            out.append(f"rank {rank} posts rounds out of order: {tags}")
        for tag, sends, recvs in log:
            calls[rank].setdefault(tag, (set(), set()))
            calls[rank][tag][0].update(sends)
            calls[rank][tag][1].update(recvs)
    for rank, by_tag in calls.items():
        for tag, (sends, recvs) in by_tag.items():
            for peer in sends:
                if rank not in calls.get(peer, {}).get(tag, (set(), set()))[1]:
                    out.append(f"round {tag}: rank {rank} sends to {peer}, which receives "
                               "it in no call of that round")
            for peer in recvs:
                if rank not in calls.get(peer, {}).get(tag, (set(), set()))[0]:
                    out.append(f"round {tag}: rank {rank} receives from {peer}, which sends "
                               "it in no call of that round")
    return out


def _run(plan, wrap=Recorded):
    devices = group_devices(plan)
    hub = ThreadHub(len(devices))
    logs = defaultdict(list)
    results = {}

    def work(rank, device, transport):
        rank_of_old = plan.old.devices.index(device) if device in plan.old.devices else None
        results[device] = execute_migration(
            plan, wrap(transport, logs[rank]), device, fake_shards(plan, rank_of_old),
            options=OPTS)

    threads = [threading.Thread(target=work, args=(r, d, t))
               for (r, d), t in zip(enumerate(devices), hub.transports())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(results) == set(devices)
    return results, dict(logs)


@pytest.mark.parametrize("old,new,dist", PLANS)
def test_every_round_is_one_call_matched_at_both_ends(old, new, dist):
    plan = make_plan(PRESETS["tiny"], old, new, dist=dist)
    results, logs = _run(plan)
    for d, res in results.items():
        assert shard_mismatches(plan, res.new_rank, res.new_shards) == [], d
    assert sum(len(log) for log in logs.values()) > 0
    assert batched_round_violations(logs) == []
    # the programs agree with what was posted: a rank's step sends to the peer whose same
    # step receives from it
    progs = {d: compile_program(plan, d, OPTS.staging_bytes) for d in group_devices(plan)}
    for prog in progs.values():
        for st in prog.steps:
            if st.send is not None:
                side = prog.sends[st.send]
                peer = progs[group_devices(plan)[side.peer]]
                back = peer.steps[st.index].recv
                assert back is not None and peer.recvs[back].peer == prog.group_rank


def test_the_round_check_catches_sends_and_receives_posted_apart():
    plan = make_plan(PRESETS["tiny"], (1, 4, 1), (2, 1, 2))  # ranks send and receive at once
    _results, logs = _run(plan, wrap=PostsApart)
    found = batched_round_violations(logs)
    assert found and all("posts a round in more than one call" in f for f in found)


def test_the_round_check_catches_an_unmatched_send():
    logs = {0: [(0, (1,), ())], 1: [(0, (), ())]}
    assert batched_round_violations(logs) == [
        "round 0: rank 0 sends to 1, which receives it in no call of that round"]
    assert batched_round_violations({0: [(1, (), ()), (0, (), ())]}) == [
        "rank 0 posts rounds out of order: [1, 0]"]


# -- where the runtime creates tensors -----------------------------------------------------

@pytest.mark.parametrize("old,new,dist", PLANS[:2])
def test_the_executor_creates_every_tensor_on_a_named_device(old, new, dist):
    plan = make_plan(PRESETS["tiny"], old, new, dist=dist)
    with recording("cpu") as rec:
        _run(plan)
    assert rec.seen > 0  # the executor's and the transports' creations were checked
    assert rec.found == []


def _planted(module, source: str):
    """A function compiled as if it were written in ``module``'s file (a planted bug in the
    runtime, without editing it)."""
    namespace = dict(vars(module))
    exec(compile(source, module.__file__, "exec"), namespace)
    return namespace


def test_the_recorder_catches_a_tensor_made_without_a_device(monkeypatch):
    planted = _planted(transport_module, "def empty(self, nbytes):\n"
                                         "    return torch.empty(int(nbytes), dtype=torch.uint8)\n")
    monkeypatch.setattr(transport_module.ThreadTransport, "empty", planted["empty"])
    plan = make_plan(PRESETS["tiny"], (1, 2, 2), (2, 2, 2))
    with recording("cpu") as rec:
        _run(plan)
    assert rec.found == ["migrate/transport.py:2: torch.empty without a device"]


def test_the_recorder_catches_a_tensor_on_another_device():
    planted = _planted(devmod, "def make():\n    return torch.zeros(2, device='meta')\n")
    with recording("cpu") as rec:
        planted["make"]()
        thread = threading.Thread(target=planted["make"])  # in a thread started inside too
        thread.start()
        thread.join()
    assert rec.found == ["migrate/device.py:2: torch.zeros on meta, the worker's is cpu"]
    assert rec.seen == 2


# -- will it fit -------------------------------------------------------------------------

def test_a_resize_that_does_not_fit_is_refused_in_one_line():
    gib = 2**30
    # a tp 4 -> 2 shrink of a 7B model: 28 GB of new shards + 14 of gradients + 1 of staging
    # beside the old state on an 80 GB card with 30 free
    need = MemoryNeed(destinations=28 * gib, grads=14 * gib, staging=1 * gib, free=30 * gib)
    with pytest.raises(DeviceMemoryError) as err:
        check_fits(need, "cuda:0")
    line = str(err.value)
    assert "\n" not in line and line.startswith("the resize needs 43.00 GiB on cuda:0")
    assert "new shards 28.00 GiB + gradient buffers 14.00 GiB + staging 1.00 GiB" in line
    assert "30.00 GiB is free" in line and isinstance(err.value, ConfigError)
    check_fits(dataclasses.replace(need, free=43 * gib), "cuda:0")  # exactly fits


def test_what_a_program_needs_is_its_new_shards_gradients_and_staging():
    plan = make_plan(PRESETS["tiny"], (1, 2, 2), (2, 2, 2), dist=True)
    device = plan.new.devices[-1]
    prog = compile_program(plan, device, OPTS.staging_bytes)
    need = memory_need(prog, staging_bytes(prog, OPTS), free=0)
    specs = [sp for j, sp in enumerate(prog.new_specs) if j not in prog.kept]
    assert need.destinations == sum(sp.nbytes for sp in specs) > 0
    assert 0 < need.grads == sum(sp.nbytes for sp in prog.new_specs
                                 if not sp.state_key.startswith("optimizer."))
    assert need.grads < need.destinations  # Adam's moments are most of the new state
    send, recv = prog.staging_sizes
    assert need.staging == staging_bytes(prog, OPTS) <= 2 * (send + recv)
    assert need.total == need.destinations + need.grads + need.staging


# -- which device, which backends --------------------------------------------------------

def test_a_worker_takes_its_one_gpu_or_the_cpu():
    assert select({}, cuda=False) == Compute(torch.device("cpu"))
    assert select({"CUDA_VISIBLE_DEVICES": "5"}, cuda=True).device == torch.device("cuda", 0)
    assert select({"CUDA_VISIBLE_DEVICES": "4,5", "LOCAL_RANK": "1"},
                  cuda=True).device == torch.device("cuda", 1)
    assert select({"CUDA_VISIBLE_DEVICES": "4,5", "SLURM_LOCALID": "1"},
                  cuda=True).device == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="sees 2 GPUs and LOCAL_RANK/SLURM_LOCALID is '7'"):
        select({"CUDA_VISIBLE_DEVICES": "4,5", "LOCAL_RANK": "7"}, cuda=True)
    gpu, cpu = Compute(torch.device("cuda", 0)), Compute(torch.device("cpu"))
    assert (gpu.world_backend, gpu.data_backend) == ("cpu:gloo,cuda:nccl", "nccl")
    assert (cpu.world_backend, cpu.data_backend) == ("gloo", "gloo")


def test_nccl_error_handling_is_set_only_where_the_user_did_not(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    env: dict[str, str] = {}
    devmod.use(Compute(torch.device("cuda", 0)), env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_GLOO_LAZY_INIT": "1"}
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_GLOO_LAZY_INIT": "0"}
    devmod.use(Compute(torch.device("cuda", 0)), env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_GLOO_LAZY_INIT": "0"}
    env = {}
    devmod.use(devmod.CPU, env)
    assert devmod.current() is devmod.CPU and env == {}  # the CPU test vehicle: as it was


def test_batches_move_to_the_device_whole():
    batch = {"tokens": torch.ones(2, 3), "meta": [torch.zeros(1), "x"], "n": 3}
    moved = to_device(batch, torch.device("meta"))
    assert moved["tokens"].device.type == "meta" and moved["meta"][0].device.type == "meta"
    assert moved["meta"][1] == "x" and moved["n"] == 3
    same = torch.ones(2)
    assert to_device(same, torch.device("cpu")) is same  # already there: not copied


class _Group:
    """A fake data group recording the coalesced calls a GPU transport makes."""

    def __init__(self):
        self.calls = []

    def rank(self):
        return 0

    def size(self):
        return 2

    def _start_coalescing(self, device):
        self.calls.append("start")

    def send(self, tensors, peer, tag):
        self.calls.append(("send", peer, tag))

    def recv(self, tensors, peer, tag):
        self.calls.append(("recv", peer, tag))

    def _end_coalescing(self, device):
        self.calls.append("end")
        return "work"


def test_on_a_gpu_a_step_is_one_coalesced_group_call():
    data, control = _Group(), _Group()
    t = BackendTransport(data, control, device="meta")  # any non-host device stands in
    assert t.backend == "gloo"  # meta is no GPU: gloo's per-operation posting
    t.device, t.backend = torch.device("meta"), "nccl"
    pending = t.exchange([(1, torch.empty(4, device="meta"))],
                         [(1, torch.empty(4, device="meta"))], tag=7)
    assert data.calls == ["start", ("send", 1, 7), ("recv", 1, 7), "end"]
    assert len(pending) == 2 and pending[0] is pending[1] and pending[0].work == "work"

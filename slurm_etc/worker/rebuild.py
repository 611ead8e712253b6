# mypy: disable-error-code="misc, has-type"
"""A node lost where no data-parallel replica holds its state: the survivors agree on what
they can roll back to, their peer copies (stand-ins for the lost ranks, the plan made as if
they were there) or the last periodic checkpoint (loaded into the new layout), forget the
steps after it, and check the rebuilt state against its fingerprint before training on it.

A mixin of :class:`~slurm_etc.worker.trainer.ElasticTrainer`: a rollback rewinds the
trainer's step, history, state and layout (its whole state)."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from slurm_etc.lifecycle import ProcessOutcome
from slurm_etc.megatron.build import TrainingState
from slurm_etc.plan import Layout, MigrationPlan
from slurm_etc.plan.errors import ConfigError, StateLostError
from slurm_etc.plan.fingerprint import plan_digest
from slurm_etc.protocol.rendezvous import GenerationKeys
from slurm_etc.protocol.store import wait_for_keys
from slurm_etc.protocol.values import decode_value, encode_value

from ..protocol.messages import Exited, Resize
from .checkpoints import checkpoint_fingerprint
from .extras import set_rng_extras
from .process import RebuiltStateMismatch
from .redundancy import (
    PeerCopies,
    fingerprint_mismatch,
    fingerprint_totals,
    shards_fingerprint,
)
from .resizing import cached_plan

if TYPE_CHECKING:
    from .trainer import ElasticTrainer


class Rebuild:
    """Rebuilding a lost node's state for :class:`~slurm_etc.worker.trainer.ElasticTrainer`."""

    # trainer fields these steps set to another type than mypy would infer from them here
    # (ElasticTrainer.__init__ sets them first)
    layout: Layout | None
    _held: tuple[list, Any] | None
    state: TrainingState | None
    peers: PeerCopies | None
    _lost: frozenset[int]

    def _rebuild_lost(self: ElasticTrainer, order: Resize, keys: GenerationKeys, old: Layout,
                      new: Layout, err: StateLostError) -> MigrationPlan | str:
        """No survivor replicates what the lost devices held. Survivors agree on what they
        can roll back to: peer copies (returns the plan, every survivor rolled back, stand-ins
        started) or the last periodic checkpoint (loaded here: returns "stay" / "left").
        Refused (every rank alike: the coordinator stops the job with the reason) when
        neither is enabled or neither exists."""
        from slurm_etc.plan.lost import rollback_step

        if not (self.peer_copy_every or self.checkpoint_every):
            return self._refuse(order, str(err))  # nothing to rebuild from
        lost = set(order.lost)
        lost_ranks = [r for r, d in enumerate(old.devices) if d in lost]
        held = self._holdings(keys, old, lost)
        own = {r: h["own"] for r, h in held.items()}
        copies = {r: h["copies"] for r, h in held.items()}
        last = max(h["step"] for h in held.values())
        back = rollback_step(lost_ranks, own, copies) if self.peer_copy_every else None
        if back is not None:
            self._expected_fp[order.generation] = _expected_fingerprint(held, lost_ranks, back)
            return self._roll_back_to_copies(order, keys, old, new, back, last, lost_ranks,
                                             copies)
        ckpts = [h["checkpoint"] for h in held.values()]
        if any(c is None for c in ckpts):
            return self._refuse(order, f"no peer copy of the lost ranks {lost_ranks} (none "
                                       "refreshed in this layout, or their holders lost too) "
                                       f"and no periodic checkpoint: {err}")
        return self._load_lost_from_checkpoint(order, old, new, min(ckpts), last)

    def _holdings(self: ElasticTrainer, keys: GenerationKeys, old: Layout, lost: set[int]
                  ) -> dict[int, dict]:
        """Every survivor's step, snapshots, peer copies and last checkpoint (the store)."""
        proc = self._proc()
        peers = self.peers if self.peers and self._peers_gen == self.generation else None
        mine = {"step": self.step, "checkpoint": self._latest_checkpoint(),
                **(peers.holdings() if peers else {"own": [], "copies": {}}),
                "fp": peers.fingerprints() if peers else {"own": {}, "copies": {}}}
        proc.store.set(keys.holdings(proc.vrank), encode_value(mine))
        survivors = [(r, d) for r, d in enumerate(old.devices) if d not in lost]
        theirs = [keys.holdings(d) for _r, d in survivors]
        if not wait_for_keys(proc.store, theirs, proc.timeout_s):
            raise RuntimeError(f"survivors of {old.config} did not publish what they hold "
                               f"within {proc.timeout_s:.0f} s")
        return {r: decode_value(v) for (r, _d), v in zip(
            survivors, proc.store.multi_get(theirs), strict=True)}

    def _roll_back_to_copies(self: ElasticTrainer, order: Resize, keys: GenerationKeys,
                             old: Layout, new: Layout, back: int, last: int,
                             lost_ranks: list[int], copies: dict[int, dict]) -> MigrationPlan:
        """Restore this rank's snapshot of step ``back`` (state, RNG, data position), plan
        the resize as if the lost ranks were there, and start a stand-in for each lost rank
        whose copy this rank keeps (the lowest surviving holder stands in)."""
        from slurm_etc.megatron.state import local_shards, set_optimizer_step
        from slurm_etc.migrate.executor import MigrationOptions

        proc = self._proc()
        peers = self.peers
        survivor = self.state is not None  # a joiner of this resize holds nothing
        if survivor and peers is None:
            raise RuntimeError("rolling back to peer copies this rank does not have")
        if survivor and peers is not None:
            state, _cfg = self._live()
            meta = peers.restore(local_shards(state, self._catalog()), back)
            set_optimizer_step(state, meta["adam_step"])
            torch.set_rng_state(torch.frombuffer(bytearray(meta["rng"]), dtype=torch.uint8))
            set_rng_extras(meta["extras"])
            self._restore_trainer_state(meta["trainer"])
        self._rebuilt_from[order.generation] = "peer-copies"
        self._forget_steps_after(back, order.generation, last)
        self._lost = frozenset()
        topology = (dataclasses.replace(proc.topology, gpus_per_node=order.gpus_per_node)
                    if order.gpus_per_node else proc.topology)
        lost = set(order.lost)
        pool = tuple(d for d in sorted(order.pool or new.devices) if d not in lost)
        catalog = self._catalog_for(keys, old)
        plan = cached_plan(catalog, old, new.config, pool, topology, proc.keep_tp_in_node, ())
        if tuple(plan.new.devices) != tuple(new.devices):
            raise ConfigError(f"rebuilt from peer copies, the plan places the new ranks on "
                              f"{list(plan.new.devices)}, the order on {list(new.devices)}")
        if order.plan_digest and order.plan_digest != plan_digest(plan):
            raise ConfigError("rebuilt from peer copies, this worker's plan differs from the "
                              f"coordinator's ({plan_digest(plan)[:12]} != "
                              f"{order.plan_digest[:12]})")
        if not survivor or peers is None:
            return plan
        me = old.devices.index(proc.vrank)
        for ward in lost_ranks:
            holders = sorted(r for r, c in copies.items() if back in c.get(ward, ()))
            if holders and holders[0] == me:
                peers.start_stand_in(
                    ward, back, plan=plan, device=old.devices[ward], store=proc.store,
                    tag=keys.prefix, options=MigrationOptions(timeout_s=proc.timeout_s),
                    timeout_s=proc.timeout_s,
                    publish=lambda m, w=ward: self._publish_for(keys, old, w, m))
        return plan

    def _check_rebuilt(self: ElasticTrainer, keys: GenerationKeys, new: Layout,
                       expected: dict[str, int], source: str = "peer copies") -> None:
        """Before the first step on a state rebuilt from peer copies: every new rank
        publishes its shards' fingerprints, every rank adds them up per state tensor and
        compares with what the copies were when taken (the same verdict everywhere). A
        mismatch stops this process with one line (RebuiltStateMismatch), never training."""
        from slurm_etc.megatron.state import local_shards

        proc = self._proc()
        state, _cfg = self._live()
        t0 = time.perf_counter()
        rank = new.devices.index(proc.vrank)
        proc.store.set(keys.fingerprint(rank),
                       encode_value(shards_fingerprint(local_shards(state, self._catalog()))))
        theirs = [keys.fingerprint(r) for r in range(len(new.devices))]
        if not wait_for_keys(proc.store, theirs, proc.timeout_s):
            raise RuntimeError(f"the ranks of {new.config} did not publish the fingerprint of "
                               f"their rebuilt state within {proc.timeout_s:.0f} s")
        got = fingerprint_totals(row for v in proc.store.multi_get(theirs)
                                 for row in decode_value(v))
        bad = fingerprint_mismatch(expected, got)
        if bad is not None:
            line = (f"the state rebuilt from {source} of step {self.step} does not match "
                    f"their fingerprint, not training on it: {bad}")
            self._log("%s", line)
            proc.control.report(Exited(proc.job, self.generation, proc.vrank, line[:1000],
                                       self.step))
            raise RebuiltStateMismatch(line)
        self._log("the state rebuilt from %s at step %d matches its fingerprint (%d state "
                  "tensors, checked in %.3f s)", source, self.step, len(expected),
                  time.perf_counter() - t0)

    def _publish_for(self: ElasticTrainer, keys: GenerationKeys, old: Layout, ward: int,
                     meta: dict) -> None:
        """What old rank ``ward`` would publish in a resize, from its peer copy."""
        proc = self._proc()
        if ward == 0:  # the publisher when no device counts as lost
            proc.store.set(keys.trainer, encode_value(meta["trainer"]))
            if self.catalog is not None:
                proc.store.set(keys.model, json.dumps(self.catalog.model.to_json()))
        proc.store.set(keys.rng(ward), encode_value(meta["extras"]))

    def _forget_steps_after(self: ElasticTrainer, back: int, generation: int, last: int) -> None:
        """Steps after ``back`` are lost: out of the history, reported, replayed."""
        self.lost_history += [h for h in self.history if h.step > back]
        self.history = [h for h in self.history if h.step <= back]
        self._rollback = (generation, back + 1, last) if last > back else None
        if last > back:
            self._log("lost steps %d-%d, replaying from step %d", back + 1, last, back)
        else:
            self._log("no step lost: the copies are of step %d", back)

    def _load_lost_from_checkpoint(self: ElasticTrainer, order: Resize, old: Layout, new: Layout,
                                   step: int, last: int) -> str:
        """Neither replicas nor peer copies: the new layout loads the last periodic
        checkpoint (every survivor leaves its old groups; the others exit)."""
        from slurm_etc.megatron.build import teardown_world

        proc = self._proc()
        t0 = time.time()
        self._rebuilt_from[order.generation] = "checkpoint"
        self._forget_steps_after(step, order.generation, last)
        self.state, self.peers, self._held = None, None, None
        teardown_world()
        # a new generation's agreements start at attempt 0 on every rank (a survivor that
        # counted an aborted resize meets joiners that counted none: soak seed 102)
        self.generation, self._attempt = order.generation, 0
        if proc.vrank not in new.devices:
            self.layout = None
            self._record(order, ProcessOutcome.LEFT, 0, 0.0, 0.0, "")
            return "left"
        self.layout = new
        self._start_group(GenerationKeys(proc.job, order.generation).train_group,
                          new.devices.index(proc.vrank), new.config.world)
        self.state = self._build(new.config, empty=True)
        where = os.path.join(str(self.checkpoint_dir), f"step-{step}")
        self._load_checkpoint(where)
        self._record(order, ProcessOutcome.COMMITTED, 0, time.time() - t0, 0.0,
                     f"restored from the checkpoint of step {step}")
        self._log("restored %s from the checkpoint of step %d", new.config, step)
        expected = checkpoint_fingerprint(where)
        if expected is not None:
            self._check_rebuilt(GenerationKeys(proc.job, order.generation), new, expected,
                                "the checkpoint")
        return "stay"


def _expected_fingerprint(held: dict[int, dict], lost_ranks: list[int], back: int
                          ) -> dict[str, int]:
    """What a layout rebuilt from the copies of step ``back`` must add up to: the
    survivors' own snapshots and, for each lost rank, its copy (the lowest holder's: every
    rank reads the same), as fingerprinted when taken."""
    rows: list = []
    for r in sorted(held):
        rows += _steps(held[r]["fp"]["own"]).get(back, [])
    for w in lost_ranks:
        for r in sorted(held):
            kept = _steps(_steps(held[r]["fp"]["copies"]).get(w, {}))
            if back in kept:
                rows += kept[back]
                break
    return fingerprint_totals(rows)


def _steps(d: dict) -> dict:
    """A dict read back from the store with its int keys (they may travel as text)."""
    return {int(k): v for k, v in d.items()}

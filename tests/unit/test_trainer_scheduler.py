"""The trainer refuses a learning-rate schedule megatron-core's scheduler would assert on
(warmup not shorter than the decay), in one line before anything is built; the presets
shorten their warmup for short runs (``slurm-etc verify --steps 1`` trains 2 steps)."""
from __future__ import annotations

import pytest

from slurm_etc.plan.errors import ConfigError
from slurm_etc.plan.model import PRESETS
from slurm_etc.worker.gpt import preset_trainer
from slurm_etc.worker.trainer import ElasticTrainer, SchedulerConfig

pytestmark = pytest.mark.unit


def _trainer(scheduler: SchedulerConfig, train_steps: int) -> ElasticTrainer:
    return ElasticTrainer(model_provider=lambda *a, **k: None,
                          forward_step=lambda it, m: None, dataset_provider=list,
                          transformer_config=None, optimizer_config=None,
                          scheduler=scheduler, global_batch_size=8, micro_batch_size=1,
                          seq_length=16, train_steps=train_steps)


@pytest.mark.parametrize("warmup, decay, steps", [(2, None, 2), (5, 3, 100), (1, 0, 0)])
def test_a_warmup_as_long_as_the_decay_is_refused_in_one_line(warmup, decay, steps):
    with pytest.raises(ConfigError) as got:
        _trainer(SchedulerConfig(max_lr=1e-3, warmup_steps=warmup, decay_steps=decay), steps)
    assert f"warmup_steps ({warmup}) must be fewer than its decay steps" in str(got.value)
    assert "\n" not in str(got.value)


@pytest.mark.parametrize("warmup, decay, steps", [(0, None, 0), (1, None, 2), (2, 3, 1),
                                                  (2, None, 0)])  # describes the model
def test_a_warmup_shorter_than_the_decay_is_taken(warmup, decay, steps):
    _trainer(SchedulerConfig(max_lr=1e-3, warmup_steps=warmup, decay_steps=decay), steps)


@pytest.mark.parametrize("steps, warmup", [(1, 0), (2, 1), (3, 2), (40, 2)])
def test_a_preset_shortens_its_warmup_below_the_steps(steps, warmup):
    got = preset_trainer(PRESETS["tiny"], distributed_optimizer=False, train_steps=steps)
    assert got.scheduler_config.warmup_steps == warmup

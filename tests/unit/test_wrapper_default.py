"""scripts/elastic.sbatch works as shipped: its default TRAIN_CMD is the example, which is a
worker when the coordinator starts it; MODEL, GLOBAL_BATCH and MICRO_BATCH are empty by
default (the coordinator plans with what the workers build) and passed on only when set.
examples/train_gpt.model.json (for MODEL=) describes what the example really builds: its
own trainer is built and compared, field by field."""
from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

from slurm_etc.plan import load_model

REPO = Path(__file__).resolve().parents[2]
WRAPPER = REPO / "scripts" / "elastic.sbatch"


def _default(name: str) -> str:
    m = re.search(rf'^{name}=\$\{{{name}:-"?(.*?)"?\}}$', WRAPPER.read_text(), re.M)
    assert m, f"no default for {name} in {WRAPPER}"
    return m.group(1)


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" /
                                                  "train_gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_train_cmd_is_the_example_as_a_worker():
    argv = shlex.split(_default("TRAIN_CMD"))
    assert argv[:2] == ["python", "examples/train_gpt.py"], argv
    example = _example()
    assert example.started_by_coordinator({"SLURM_ETC_JOB": "7",
                                           "SLURM_ETC_SECRET_FILE": "/x/secret"})
    assert not example.started_by_coordinator({})  # run by hand: its local sequence
    assert "run_worker(make_trainer(" in (REPO / "examples" / "train_gpt.py").read_text()


def test_model_and_batch_are_optional_and_passed_on_only_when_set():
    for name in ("MODEL", "GLOBAL_BATCH", "MICRO_BATCH"):
        assert _default(name) == "", name
    text = WRAPPER.read_text()
    assert '${MODEL:+--model "$MODEL"}' in text
    assert '${GLOBAL_BATCH:+--global-batch "$GLOBAL_BATCH"}' in text
    assert '${MICRO_BATCH:+--micro-batch "$MICRO_BATCH"}' in text


def test_example_model_file_describes_the_example():
    example = _example()
    trainer = example.make_trainer(10)
    tf = trainer.tf_template
    desc = load_model(str(REPO / "examples" / "train_gpt.model.json"))
    assert (desc.num_layers, desc.hidden, desc.ffn_hidden, desc.num_heads) == \
        (tf.num_layers, tf.hidden_size, tf.ffn_hidden_size, tf.num_attention_heads)
    assert (desc.vocab_size, desc.seq_length) == (example.VOCAB, trainer.seq_length)
    assert desc.param_dtype == "fp32"
    # the example passes its vocabulary unpadded: the description must not pad it either
    assert desc.vocab_divisor == 1
    assert (example.GLOBAL_BATCH, example.MICRO_BATCH) == \
        (trainer.global_batch, trainer.micro_batch)


def test_peer_copies_are_on_by_default_and_a_checkpoint_dir_is_optional():
    """Redundancy follows `slurm-etc run`'s default: peer copies every "auto" steps (the
    variable run reads), a checkpoint directory passed on only when set."""
    m = re.search(r'^export SLURM_ETC_RUN_PEER_COPY_EVERY=\$\{SLURM_ETC_RUN_PEER_COPY_EVERY:-'
                  r'(.*?)\}$', WRAPPER.read_text(), re.M)
    assert m and m.group(1) == "auto", m
    assert _default("CHECKPOINT_DIR") == ""
    assert '${CHECKPOINT_DIR:+--checkpoint-dir "$CHECKPOINT_DIR"}' in WRAPPER.read_text()

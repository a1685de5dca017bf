"""auto_find_batch_size with an injected out-of-memory error (CPU)."""

from __future__ import annotations

import pytest

from checkpointing.serialize import load_state
from core.autobatch import halved, is_oom, with_batch
from core.callbacks import TrainerCallback
from core.config import load_config
from core.trainer import Trainer
from tests import oom_model
from tests.launch import SMALL, read_metrics

ARGS = [
    *SMALL,
    "--model.name",
    "tests.oom_model:factory",
    "--model.kwargs",
    "{max_batch: 4}",
    "--train.per_device_batch_size",
    "16",
    "--train.auto_find_batch_size",
    "true",
    "--train.max_steps",
    "6",
    "--checkpoint.save_steps",
    "2",
]


class CrashAt(TrainerCallback):
    def on_step_end(self, config, state, control):
        if state.global_step == 3:
            raise RuntimeError("simulated crash")


def test_search_halves_keeps_global_batch_and_records_size(tmp_path):
    oom_model.OOM_RAISED.clear()
    config = load_config(None, [*ARGS, "--run.output_dir", str(tmp_path)])
    result = Trainer(args=config).train()
    assert result.global_step == 6
    assert oom_model.OOM_RAISED == [16, 8]  # then 4 fits
    assert [m["samples"] for m in read_metrics(tmp_path)][:2] == [16, 32]  # 4 x 4 per step
    state = load_state(tmp_path / "checkpoint-6", "train_state")
    assert (state["per_device_batch_size"], state["gradient_accumulation_steps"]) == (4, 4)


def test_resume_starts_at_the_recorded_size(tmp_path):
    config = load_config(None, [*ARGS, "--run.output_dir", str(tmp_path)])
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(args=config, callbacks=[CrashAt()]).train()
    oom_model.OOM_RAISED.clear()
    result = Trainer(args=config).train()  # resumes checkpoint-2
    assert result.global_step == 6
    assert oom_model.OOM_RAISED == []  # no search again


def test_without_auto_the_error_propagates(tmp_path):
    config = load_config(
        None, [*ARGS, "--run.output_dir", str(tmp_path), "--train.auto_find_batch_size", "false"]
    )
    with pytest.raises(Exception) as err:
        Trainer(args=config).train()
    assert is_oom(err.value)


def test_halving_keeps_the_product():
    config = load_config(None, ["--train.per_device_batch_size", "12"])
    seen = []
    while config.train.per_device_batch_size > 1:
        config = halved(config)
        tc = config.train
        seen.append((tc.per_device_batch_size, tc.gradient_accumulation_steps))
    assert seen == [(6, 2), (3, 4), (1, 12)]
    with pytest.raises(RuntimeError, match="even at per_device_batch_size 1"):
        halved(with_batch(config, 1, 12))

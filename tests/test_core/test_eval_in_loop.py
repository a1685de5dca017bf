"""Evaluation inside the loop: it never disturbs training, resumes exactly, and drives best-
checkpoint retention, load_best_model_at_end and early stopping (whose state survives a crash)."""

from __future__ import annotations

import shutil

import pytest
import torch

from core.callbacks import EarlyStoppingCallback, TrainerCallback
from core.config import ConfigError, load_config
from core.loop import DistInfo
from core.run import UserParts, build_trainer
from tests.checkpoints import load_entry
from tests.launch import SMALL, read_metrics

EVAL = ["--eval.strategy", "steps", "--eval.steps", "2", "--eval.holdout_samples", "40"]


def trainer(run_dir, *overrides, callbacks=None):
    config = load_config(None, [*SMALL, "--run.output_dir", str(run_dir), *overrides])
    return build_trainer(config, DistInfo(), torch.device("cpu"), callbacks=callbacks)


def train_losses(run_dir):
    return [(m["step"], m["loss"]) for m in read_metrics(run_dir) if "loss" in m]


def eval_records(run_dir):
    return [m for m in read_metrics(run_dir) if "eval_loss" in m]


def test_eval_does_not_change_training_and_is_logged(tmp_path):
    eval_file = tmp_path / "eval.txt"
    eval_file.write_text("def evaluate(model):\n    return model\n" * 40)
    external = ["--eval.source", str(eval_file)]
    trainer(tmp_path / "no", "--train.max_steps", "6", *external).train()
    trainer(tmp_path / "yes", "--train.max_steps", "6", *EVAL, *external).train()
    evals = eval_records(tmp_path / "yes")
    assert [e["step"] for e in evals] == [2, 4, 6]
    assert evals[0]["eval_samples"] == len(eval_file.read_bytes()) // 32
    assert not eval_records(tmp_path / "no")
    assert train_losses(tmp_path / "no") == train_losses(tmp_path / "yes")  # bit-identical


def test_holdout_is_taken_from_the_training_data(tmp_path):
    t = trainer(tmp_path, "--train.max_steps", "2", *EVAL)
    assert len(t.dataset) == 625 - 40
    t.train()
    assert eval_records(tmp_path)[0]["eval_samples"] == 40


def test_an_iterable_eval_dataset_is_refused_before_the_model_is_built(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"input_ids": torch.zeros(32, dtype=torch.long)}

    def model_init():
        raise AssertionError("the model was built before the eval data was checked")

    config = load_config(None, [*SMALL, "--run.output_dir", str(tmp_path), *EVAL])
    parts = UserParts(model_init=model_init, eval_dataset=Stream())
    with pytest.raises(ConfigError, match="eval_dataset: needs a map-style dataset"):
        build_trainer(config, DistInfo(), torch.device("cpu"), parts=parts)


def test_resume_with_eval_is_exact(tmp_path):
    ref, res = tmp_path / "ref", tmp_path / "res"
    args = ("--train.max_steps", "8", "--checkpoint.save_steps", "4", *EVAL)
    trainer(ref, *args).train()
    res.mkdir()
    shutil.copytree(ref / "checkpoint-4", res / "checkpoint-4")
    shutil.copy(ref / "metrics.jsonl", res / "metrics.jsonl")
    trainer(res, *args).train()
    timing = ("step_time_s", "eval_runtime", "eval_samples_per_second")
    runs = [
        [{k: v for k, v in m.items() if k not in timing} for m in read_metrics(d)]
        for d in (ref, res)
    ]
    assert runs[0] == runs[1]
    assert any("eval_loss" in m for m in runs[1][4:])


def test_best_checkpoint_kept_and_loaded_at_end(tmp_path):
    # greater_is_better on eval_loss: the *worst* loss, i.e. the earliest checkpoint, is best.
    t = trainer(
        tmp_path,
        "--train.max_steps",
        "8",
        "--checkpoint.save_steps",
        "2",
        "--checkpoint.save_total_limit",
        "1",
        "--checkpoint.best_metric",
        "eval_loss",
        "--checkpoint.greater_is_better",
        "true",
        "--checkpoint.load_best_model_at_end",
        "true",
        *EVAL,
    )
    t.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-8"]
    best = load_entry(tmp_path / "checkpoint-2", "model")
    live = t.engine.model.state_dict()
    for name, tensor in best.items():
        assert torch.equal(live[name], tensor), name


class CrashAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, config, state, control):
        if state.global_step == self.step:
            raise RuntimeError("simulated crash")


def test_early_stopping_state_survives_a_crash(tmp_path):
    def stopper():  # the loss falls, so with greater_is_better every eval is "no improvement"
        return EarlyStoppingCallback(patience=3, metric="eval_loss", greater_is_better=True)

    args = ("--train.max_steps", "40", "--checkpoint.save_steps", "2", *EVAL)
    ref = trainer(tmp_path / "ref", *args, callbacks=[stopper()])
    ref.train()
    stopped_at = ref.state.global_step
    assert stopped_at == 8  # evals at 2 (best), 4, 6, 8 -> 3 bad evaluations
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer(run, *args, callbacks=[stopper(), CrashAt(5)]).train()
    again = trainer(run, *args, callbacks=[stopper()])
    again.train()
    assert again.state.global_step == stopped_at
    assert train_losses(run) == train_losses(tmp_path / "ref")

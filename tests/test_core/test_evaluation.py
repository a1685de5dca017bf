"""core.evaluation: per-sample eval loss and metrics, independent of batching and world size,
leaving the training RNG streams and the model's modes untouched."""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.callbacks import TrainerCallback
from core.config import load_config
from core.data import collate
from core.evaluation import evaluate
from core.loop import DistInfo
from core.run import build_trainer
from tests.eval_worker import argmax_logits, make_dataset, make_model, next_token_metrics
from tests.launch import BIN, REPO, SMALL, read_metrics, run

CPU = torch.device("cpu")


def run_eval(model, ds, batch_size, **kwargs):
    return evaluate(model, ds, collate, batch_size, rank=0, world_size=1, device=CPU, **kwargs)


def hand_losses(model, ds):
    """Each sample alone through the model, its loss by F.cross_entropy (float32)."""
    losses = []
    with torch.no_grad():
        for row in ds["input_ids"]:
            ids = torch.tensor([row])
            logits = model(ids)["logits"]
            losses.append(F.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).item())
    return losses


def test_eval_loss_equals_hand_computation():
    model, ds = make_model().eval(), make_dataset()
    expected = float(np.mean(np.asarray(hand_losses(model, ds), dtype=np.float64)))
    one = run_eval(model, ds, 1)
    assert one["eval_loss"] == expected  # exactly: the same logits, the same reduction
    assert run_eval(model, ds, 4)["eval_loss"] == pytest.approx(expected, abs=1e-6)
    assert one["eval_samples"] == len(ds)
    assert {"eval_runtime", "eval_samples_per_second"} <= set(one)
    assert all(isinstance(v, (int, float)) for v in one.values())


def test_compute_metrics_gets_index_ordered_padded_rows_and_is_prefixed():
    model, ds = make_model().eval(), make_dataset()
    seen = []

    def metrics(p):
        seen.append(p)
        return next_token_metrics(p)

    result = run_eval(
        model, ds, 4, compute_metrics=metrics, preprocess_logits_for_metrics=argmax_logits
    )
    preds, labels = seen[0]
    longest = max(map(len, ds["input_ids"]))
    assert preds.shape == labels.shape == (len(ds), longest)
    correct = total = 0
    with torch.no_grad():
        for i, row in enumerate(ds["input_ids"]):
            n = len(row)
            assert labels[i, :n].tolist() == row and (labels[i, n:] == -100).all()
            assert (preds[i, n:] == -100).all()  # padding stripped per sample, re-padded
            alone = model(torch.tensor([row]))["logits"][0].argmax(-1).numpy()
            correct += int((alone[:-1] == np.asarray(row[1:])).sum())
            total += n - 1
    assert result["eval_accuracy"] == pytest.approx(correct / total)
    assert {"eval_accuracy", "eval_order"} <= set(result) and "accuracy" not in result


class DrawsRandomness(nn.Module):
    """Wraps a model and draws from every global RNG on each forward, even in eval mode."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **batch):
        random.random()
        np.random.rand()
        torch.rand(1)
        return self.inner(**batch)


def rng_snapshot():
    _, keys, pos, *_ = np.random.get_state()
    return random.getstate(), keys.copy(), pos, torch.get_rng_state()


def test_rng_and_modes_undisturbed():
    model = DrawsRandomness(make_model(dropout=0.1)).train()
    model.inner.drop.eval()  # a mixed state: restored per module, not by model.train()
    modes = [m.training for m in model.modules()]
    before = rng_snapshot()
    run_eval(model, make_dataset(), 4, num_workers=2)
    after = rng_snapshot()
    assert before[0] == after[0] and np.array_equal(before[1], after[1])
    assert before[2] == after[2] and torch.equal(before[3], after[3])
    assert [m.training for m in model.modules()] == modes


def test_evaluation_between_steps_keeps_training_losses_bit_identical(tmp_path):
    eval_ds = make_dataset(9)

    class EvalEvery2(TrainerCallback):
        def __init__(self) -> None:
            self.trainer, self.results = None, []

        def on_step_end(self, config, state, control):
            if state.global_step % 2 == 0:
                model = DrawsRandomness(self.trainer.engine.model)
                self.results.append(run_eval(model, eval_ds, 4))

    def losses(run_dir, callbacks):
        args = [*SMALL, "--run.output_dir", str(run_dir), "--model.dropout", "0.1"]
        config = load_config(None, [*args, "--train.max_steps", "6"])
        trainer = build_trainer(config, DistInfo(), CPU, callbacks=callbacks)
        for cb in callbacks:
            cb.trainer = trainer
        trainer.train()
        return [m["loss"] for m in read_metrics(run_dir)]

    cb = EvalEvery2()
    assert losses(tmp_path / "with", [cb]) == losses(tmp_path / "without", [])
    assert len({r["eval_loss"] for r in cb.results}) == 3  # evaluated the model as it trained


def test_workers_give_the_same_result():
    model, ds = make_model().eval(), make_dataset()
    a, b = run_eval(model, ds, 3), run_eval(model, ds, 3, num_workers=2)
    assert a["eval_loss"] == b["eval_loss"]


def test_should_stop_returns_none():
    model, ds = make_model(), make_dataset()
    assert run_eval(model, ds, 2, should_stop=lambda: True, poll_every=3) is None
    assert model.training  # modes restored on the early exit too
    assert run_eval(model, ds, 2, should_stop=lambda: False, poll_every=3) is not None


def test_loss_only_model_falls_back_to_batch_loss():
    inner, ds = make_model().eval(), make_dataset(6)

    class LossOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, **batch):
            return self.inner(**batch)["loss"]

    with torch.no_grad():
        batch_losses = [
            inner(**collate(ds.select(r))).get("loss").item() for r in ([0, 1, 2, 3], [4, 5])
        ]
    expected = float(np.mean(np.asarray(np.repeat(batch_losses, [4, 2]), dtype=np.float64)))
    assert run_eval(LossOnly(), ds, 4)["eval_loss"] == expected


def test_classifier_loss_per_sample_ignores_unlabelled():
    torch.manual_seed(0)
    net = nn.Linear(5, 3)

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x, labels):
            logits = self.net(x)
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    xs, ys = torch.randn(7, 5), torch.tensor([0, 1, 2, -100, 1, 0, 2])
    ds = [{"x": x, "labels": y} for x, y in zip(xs, ys, strict=True)]

    def stack(rows):
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    result = evaluate(Classifier(), ds, stack, 3, rank=0, world_size=1, device=CPU)
    with torch.no_grad():
        losses = [
            F.cross_entropy(net(x[None]), y[None]).item()
            for x, y in zip(xs, ys, strict=True)
            if y >= 0
        ]
    assert result["eval_loss"] == float(np.mean(np.asarray(losses, dtype=np.float64)))


def run_worker(cmd: list[str], cwd, timeout: float = 120) -> dict:
    out = cwd / "metrics.json"
    result = run([*cmd, str(REPO / "tests" / "eval_worker.py"), str(out)], cwd, timeout)
    assert result.returncode == 0, result.output
    return json.loads(out.read_text())


def test_two_processes_equal_one(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = run_worker([sys.executable], tmp_path / "one")
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    two = run_worker(torchrun, tmp_path / "two")
    assert (one["nproc"], two["nproc"]) == (1, 2)
    for key in ("eval_loss", "eval_accuracy", "eval_order", "eval_samples"):
        assert two["bs1"][key] == one["bs1"][key], key  # exactly, with batch size 1
    assert two["bs1"]["eval_samples"] == len(make_dataset())  # each sample once, unpadded
    assert two["bs4"]["eval_loss"] == pytest.approx(one["bs1"]["eval_loss"], abs=1e-6)
    assert two["stopped_on_every_rank"]  # one rank's request, past its short shard's end

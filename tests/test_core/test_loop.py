"""The inner loop in one process: epochs, accumulation, callbacks, data workers, checkpointing."""

from __future__ import annotations

import pytest
import torch

from core.callbacks import TrainerCallback
from core.config import load_config
from core.engines.ddp import DDPEngine
from core.loop import DistInfo
from core.run import build_trainer
from tests.launch import SMALL, read_metrics


def train(tmp_path, *overrides, callbacks=None):
    config = load_config(None, [*SMALL, "--run.output_dir", str(tmp_path), *overrides])
    trainer = build_trainer(config, DistInfo(), torch.device("cpu"), callbacks=callbacks)
    state = trainer.train()
    return trainer, state, read_metrics(tmp_path)


def losses(metrics):
    return [m["loss"] for m in metrics]


def test_num_epochs_runs_whole_epochs(tmp_path):
    trainer, state, metrics = train(
        tmp_path, "--train.max_steps", "null", "--train.num_epochs", "2"
    )
    # 20000 bytes / 32 = 625 samples -> 78 batches of 8 per epoch (drop_last)
    assert trainer.steps_per_epoch == 78
    assert state.global_step == 156 and state.epoch == 2
    assert state.samples_seen == 156 * 8
    assert metrics[77]["epoch"] == 1.0 and metrics[-1]["epoch"] == 2.0


def test_partial_last_batch_and_accumulation_at_epoch_end(tmp_path):
    trainer, state, metrics = train(
        tmp_path,
        "--train.max_steps",
        "null",
        "--train.num_epochs",
        "1",
        "--data.drop_last",
        "false",
        "--train.gradient_accumulation_steps",
        "3",
    )
    # 625 samples: 78 full batches + one of 1 = 79 micro-batches = 26 steps of 3 + one of 1
    assert trainer.steps_per_epoch == 27
    assert state.global_step == 27 and state.samples_seen == 625
    assert [m["samples"] for m in metrics][-2:] == [624, 625]


def test_max_steps_wins_over_epochs(tmp_path):
    _, state, _ = train(tmp_path, "--train.max_steps", "5", "--train.num_epochs", "3")
    assert state.global_step == 5


def test_callback_can_stop(tmp_path):
    class StopAt(TrainerCallback):
        def on_step_end(self, config, state, control):
            control.should_training_stop = state.global_step == 4

    _, state, metrics = train(tmp_path, "--train.max_steps", "50", callbacks=[StopAt()])
    assert state.global_step == 4 and [m["step"] for m in metrics] == [1, 2, 3, 4]


def test_callback_events_and_logs(tmp_path):
    events = []

    class Recorder(TrainerCallback):
        def on_train_begin(self, config, state, control):
            events.append("begin")

        def on_log(self, config, state, control, logs):
            events.append(("summary" if "train_runtime" in logs else "log", logs["step"]))

        def on_train_end(self, config, state, control):
            events.append("end")

    train(tmp_path, "--train.max_steps", "4", "--train.logging_steps", "2", callbacks=[Recorder()])
    assert events == ["begin", ("log", 2), ("log", 4), ("summary", 4), "end"]


def test_dataloader_workers_do_not_change_the_trajectory(tmp_path):
    _, _, plain = train(tmp_path / "a", "--train.max_steps", "8")
    _, _, workers = train(tmp_path / "b", "--train.max_steps", "8", "--data.num_workers", "2")
    assert losses(plain) == losses(workers)


def test_gradient_checkpointing_same_losses(tmp_path):
    _, _, plain = train(tmp_path / "a", "--train.max_steps", "6")
    _, _, ckpt = train(
        tmp_path / "b", "--train.max_steps", "6", "--model.gradient_checkpointing", "true"
    )
    assert losses(plain) == losses(ckpt)


def test_seed_changes_the_trajectory(tmp_path):
    _, _, a = train(tmp_path / "a", "--train.max_steps", "3")
    _, _, b = train(tmp_path / "b", "--train.max_steps", "3", "--run.seed", "7")
    assert losses(a) != losses(b)


def test_bf16_autocast_trains(tmp_path):
    _, _, metrics = train(tmp_path, "--train.max_steps", "20", "--train.bf16", "true")
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def test_engine_forward_autocasts_only_for_bf16():
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def engine(bf16):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return DDPEngine(model, opt, None, torch.device("cpu"), bf16, loss_fn=lambda m, b: m(b))

    fp32, bf16 = engine(False), engine(True)
    assert fp32.forward(x).dtype == torch.float32
    assert bf16.forward(x).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a caller's autocast: fp32 stays fp32
        assert fp32.forward(x).dtype == torch.float32


@pytest.mark.parametrize("name", ["cosine", "reduce_lr_on_plateau", "inverse_sqrt"])
def test_logged_lr_follows_schedule(tmp_path, name):
    _, _, metrics = train(
        tmp_path,
        "--train.max_steps",
        "6",
        "--scheduler.name",
        name,
        "--scheduler.warmup_steps",
        "2" if name != "reduce_lr_on_plateau" else "0",
    )
    lrs = [m["lr"] for m in metrics]
    if name == "reduce_lr_on_plateau":
        assert lrs == [0.003] * 6  # default patience 10: no drop within 6 observations
    else:
        assert lrs[0] == 0.0 and lrs[1] == 0.003 / 2 and lrs[2] == 0.003


def test_fresh_run_starts_a_fresh_metrics_file(tmp_path):
    train(tmp_path, "--train.max_steps", "4")
    _, _, metrics = train(
        tmp_path,
        "--train.max_steps",
        "2",
        "--checkpoint.resume_from",
        "none",
        "--run.overwrite",
        "true",
    )
    assert [m["step"] for m in metrics] == [1, 2]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


def test_label_smoothing_changes_loss_and_zero_matches_plain(tmp_path):
    _, _, plain = train(tmp_path / "a", "--train.max_steps", "3")
    _, _, zero = train(tmp_path / "b", "--train.max_steps", "3")
    _, _, smooth = train(
        tmp_path / "c", "--train.max_steps", "3", "--train.label_smoothing_factor", "0.1"
    )
    assert losses(plain) == losses(zero)
    assert losses(smooth)[0] > losses(plain)[0]  # smoothing raises the loss of a fresh model


def test_python_api_with_user_dataset_and_model_init(tmp_path):
    import datasets

    from core.models.tiny_gpt import TinyGPT
    from core.trainer import Trainer

    rows = {"input_ids": [[i % 256] * 32 for i in range(64)], "text": ["x"] * 64}
    ds = datasets.Dataset.from_dict(rows)
    config = load_config(
        None, [*SMALL, "--run.output_dir", str(tmp_path), "--train.max_steps", "4"]
    )
    inits = []

    def model_init():
        inits.append(1)
        return TinyGPT(n_layer=1, n_embd=32, n_head=2, block_size=64)

    first = Trainer(args=config, train_dataset=ds, model_init=model_init).train(False)
    (tmp_path / "again").mkdir()
    config2 = load_config(
        None, [*SMALL, "--run.output_dir", str(tmp_path / "again"), "--train.max_steps", "4"]
    )
    second = Trainer(args=config2, train_dataset=ds, model_init=model_init).train(False)
    assert len(inits) == 2
    assert first.global_step == second.global_step == 4
    assert first.training_loss == second.training_loss  # model_init reseeded: identical runs
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "checkpoint-4").is_dir()


def test_closing_summary_has_speed_memory_and_flops(tmp_path):
    trainer, _, _ = train(tmp_path, "--train.max_steps", "4")
    summary = read_metrics(tmp_path, summary=True)[-1]
    assert "init_mem_cpu_peak_mb" not in summary  # build_trainer alone has no init stage
    assert summary["step"] == 4
    for key in (
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "train_tokens_per_second",
        "train_mem_cpu_peak_mb",
        "save_mem_cpu_peak_mb",
        "total_flos",
    ):
        assert summary[key] > 0, key
    assert trainer.summary == {k: v for k, v in summary.items() if k != "step"}


def test_python_api_reports_every_stage(tmp_path):
    from core.trainer import Trainer

    config = load_config(
        None,
        [
            *SMALL,
            "--run.output_dir",
            str(tmp_path),
            "--train.max_steps",
            "4",
            "--eval.strategy",
            "steps",
            "--eval.steps",
            "2",
        ],
    )
    metrics = Trainer(args=config).train().metrics
    for stage in ("init", "train", "eval", "save"):
        assert metrics[f"{stage}_mem_cpu_peak_mb"] > 0, stage


def test_full_determinism_switches_on_deterministic_algorithms(tmp_path):
    try:
        config = load_config(
            None,
            [
                *SMALL,
                "--run.output_dir",
                str(tmp_path),
                "--run.full_determinism",
                "true",
                "--train.max_steps",
                "2",
            ],
        )
        build_trainer(config, DistInfo(), torch.device("cpu"))
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False

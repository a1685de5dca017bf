"""End to end: the launcher as a subprocess, alone and under torchrun with 2 processes (gloo)."""

from __future__ import annotations

import yaml

from core.config import load_config
from tests.launch import read_metrics, run_launcher


def test_torchrun_two_processes_trains_and_is_reproducible(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    args = ("--train.max_steps", "40", "--train.logging_steps", "1")
    for run_dir in (a, b):
        result = run_launcher(run_dir, 2, *args)
        assert result.returncode == 0, result.output
    metrics = read_metrics(a)
    assert [m["step"] for m in metrics] == list(range(1, 41))
    for m in metrics:
        assert {"step", "loss", "lr", "epoch", "samples", "tokens", "step_time_s"} <= set(m)
        assert m["samples"] == m["step"] * 16 * 2  # batch 16 on each of 2 ranks
        assert m["tokens"] == m["samples"] * 64
    first, last = metrics[0]["loss"], metrics[-1]["loss"]
    assert last < first - 1.0, (first, last)
    # Two identical runs: bit-identical losses (json keeps full float precision).
    assert [m["loss"] for m in read_metrics(b)] == [m["loss"] for m in metrics]
    resolved = load_config(a / "config.yaml")
    assert resolved.train.max_steps == 40 and resolved.run.output_dir == str(a)
    assert yaml.safe_load((a / "config.yaml").read_text())["engine"]["name"] == "ddp"


def test_single_process_without_torchrun(tmp_path):
    result = run_launcher(
        tmp_path / "run", None, "--train.max_steps", "6", "--train.logging_steps", "3"
    )
    assert result.returncode == 0, result.output
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [3, 6]
    assert "step 6/6 loss" in result.output  # plain log lines when not on a terminal


def test_bad_config_exits_2_with_one_line_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = run_launcher(run_dir, None, "--train.per_device_batch_size", "-1")
    assert result.returncode == 2
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "train.per_device_batch_size: must be > 0" in errors[0]
    assert not run_dir.exists()


def test_bad_data_exits_2_and_writes_nothing(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"body": "hello world"}\n')
    run_dir = tmp_path / "run"
    result = run_launcher(run_dir, None, "--data.source", str(data))
    assert result.returncode == 2, result.output
    assert "Traceback" not in result.output and "data.text_field" in result.output
    assert not run_dir.exists()


def test_bad_config_under_torchrun_fails_without_hanging(tmp_path):
    """Workers exit 2 before any collective; torchrun itself then exits 1 (its own report).
    Every worker ends by itself (launcher.dist.await_peers_ending_early): none is stopped by
    torchrun because a peer exited first, so rank 0 always says why."""
    result = run_launcher(tmp_path / "run", 2, "--optim.name", "adam", timeout=120)
    assert result.returncode == 1
    worker_errors = [ln for ln in result.output.splitlines() if ln.startswith("[rank")]
    assert len(worker_errors) == 1 and "optim.name: unknown value 'adam'" in worker_errors[0]
    assert "(exitcode: 2)" in result.output
    assert result.output.count("exitcode  : 2") == 2 and "exitcode  : -15" not in result.output
    assert not (tmp_path / "run").exists()


def test_help_lists_every_command(tmp_path):
    from tests.launch import launcher_cmd, run

    result = run(launcher_cmd(None, ["--help"]), cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.output
    for command in ("prepare --config FILE", "prepare --verify STORE", "status RUN_DIR", "plot"):
        assert command in result.output

"""examples/train_custom.py under torchrun with 2 processes: trains, evaluates, resumes exactly."""

from __future__ import annotations

import json

from tests.checkpoints import assert_tensors_equal, load_entry, seed_resume_dir
from tests.launch import BIN, REPO, read_metrics, run

TIMING = ("step_time_s", "eval_runtime", "eval_samples_per_second")


def run_example(run_dir):
    cmd = [
        str(BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        str(REPO / "examples" / "train_custom.py"),
        "--run.output_dir",
        str(run_dir),
        "--train.progress_bar",
        "never",
    ]
    result = run(cmd, cwd=run_dir.parent)
    assert result.returncode == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def untimed(run_dir):
    return [{k: v for k, v in m.items() if k not in TIMING} for m in read_metrics(run_dir)]


def test_custom_example_resumes_bit_exactly(tmp_path):
    ref, res = tmp_path / "ref", tmp_path / "res"
    final = run_example(ref)
    assert final["global_step"] == 60 and 0 <= final["eval_accuracy"] <= 1
    assert final["eval_samples"] == 500
    seed_resume_dir(ref, res, 20)
    again = run_example(res)
    assert untimed(ref) == untimed(res)
    assert again["eval_loss"] == final["eval_loss"]
    for name in ("model", "optimizer"):
        assert_tensors_equal(
            load_entry(ref / "checkpoint-60", name), load_entry(res / "checkpoint-60", name), name
        )

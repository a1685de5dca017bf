"""Exact resume: run N steps uninterrupted; separately resume from a checkpoint of that run;
every logged loss after the resume point, the final weights and the optimizer state are
bit-identical (torch.equal), for each configuration of the matrix."""

from __future__ import annotations

import pytest

from tests.checkpoints import assert_same_checkpoint, assert_same_losses, seed_resume_dir
from tests.launch import read_metrics, run_launcher

STEPS = 24
COMMON = (
    "--train.max_steps",
    str(STEPS),
    "--train.logging_steps",
    "1",
    "--checkpoint.save_steps",
    "8",
)
SMALL_DATA = ("--data.max_bytes", "40000", "--train.max_steps", "null", "--train.num_epochs", "3")

CASES = {
    "1proc": (None, ()),
    "2proc": (2, ()),
    "2proc-workers": (2, ("--data.num_workers", "2")),
    "2proc-accum3": (2, ("--train.gradient_accumulation_steps", "3")),
    "2proc-plateau": (
        2,
        (
            "--scheduler.name",
            "reduce_lr_on_plateau",
            "--scheduler.kwargs",
            "{patience: 1, factor: 0.5}",
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_resume(tmp_path, case):
    nproc, extra = CASES[case]
    ref, res = tmp_path / "ref", tmp_path / "res"
    result = run_launcher(ref, nproc, *COMMON, *extra)
    assert result.returncode == 0, result.output
    seed_resume_dir(ref, res, 8)  # mid-epoch, mid-schedule
    result = run_launcher(res, nproc, *COMMON, *extra)
    assert result.returncode == 0, result.output
    assert "resumed from" in result.output
    assert [m["step"] for m in read_metrics(res)] == list(range(1, STEPS + 1))
    assert_same_losses(ref, res)
    assert_same_checkpoint(ref / f"checkpoint-{STEPS}", res / f"checkpoint-{STEPS}")
    if case == "2proc-plateau":
        lrs = {m["lr"] for m in read_metrics(ref)}
        assert len(lrs) > 1, "the plateau schedule never reduced the lr: the case tests nothing"


def test_resume_across_epoch_boundaries(tmp_path):
    """625 samples, 32 per step: 19 steps an epoch. Resume from the checkpoint taken exactly at
    the end of epoch 0 and from one in the middle of epoch 1."""
    ref = tmp_path / "ref"
    args = (*SMALL_DATA, "--train.logging_steps", "1", "--checkpoint.save_steps", "19")
    result = run_launcher(ref, 2, *args)
    assert result.returncode == 0, result.output
    assert [m["epoch"] for m in read_metrics(ref)][18] == 1.0
    for step, extra in ((19, ()), (25, ("--checkpoint.save_steps", "25"))):
        src = ref
        if extra:  # a mid-epoch checkpoint at step 25: save it in a run of its own
            src = tmp_path / "ref25"
            assert run_launcher(src, 2, *args, *extra).returncode == 0
            assert_same_losses(ref, src)
        res = tmp_path / f"res{step}"
        seed_resume_dir(src, res, step)
        result = run_launcher(res, 2, *args, *extra)
        assert result.returncode == 0, result.output
        assert_same_losses(ref, res)
        assert_same_checkpoint(ref / "checkpoint-57", res / "checkpoint-57")

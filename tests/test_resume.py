"""Exact resume: run N steps uninterrupted; separately resume from a checkpoint of that run;
every logged loss after the resume point, the final weights and the optimizer state are
bit-identical (torch.equal), for each configuration of the matrix."""

from __future__ import annotations

from pathlib import Path

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
    # Accumulation and the plateau schedule (its state: the best loss, bad epochs) in one run.
    "2proc-accum3-plateau": (
        2,
        (
            "--train.gradient_accumulation_steps",
            "3",
            "--scheduler.name",
            "reduce_lr_on_plateau",
            "--scheduler.kwargs",
            "{patience: 1, factor: 0.5}",
        ),
    ),
}


# Cases whose uninterrupted run is another case's: data loader workers change nothing trained
# (data.num_workers is neutral to a resume), so "2proc-workers" resumes "2proc"'s run.
SAME_RUN = {"2proc-workers": "2proc"}


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Path]:
    """One uninterrupted run per case, made when a case first asks (shared by SAME_RUN)."""
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        case = SAME_RUN.get(case, case)
        if case not in made:
            nproc, extra = CASES[case]
            ref = tmp_path_factory.mktemp(f"ref-{case}") / "ref"
            result = run_launcher(ref, nproc, *COMMON, *extra)
            assert result.returncode == 0, result.output
            made[case] = ref
        return made[case]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_resume(tmp_path, case, references):
    nproc, extra = CASES[case]
    ref, res = references(case), tmp_path / "res"
    seed_resume_dir(ref, res, 8)  # mid-epoch, mid-schedule
    result = run_launcher(res, nproc, *COMMON, *extra)
    assert result.returncode == 0, result.output
    assert "resumed from" in result.output
    assert [m["step"] for m in read_metrics(res)] == list(range(1, STEPS + 1))
    assert_same_losses(ref, res)
    assert_same_checkpoint(ref / f"checkpoint-{STEPS}", res / f"checkpoint-{STEPS}")
    if "plateau" in case:
        lrs = {m["lr"] for m in read_metrics(ref)}
        assert len(lrs) > 1, "the plateau schedule never reduced the lr: the case tests nothing"


def test_resume_across_epoch_boundaries(tmp_path):
    """625 samples, 32 per step: 19 steps an epoch. Resume from the checkpoint taken exactly at
    the end of epoch 0 and from one in the middle of epoch 1 (the reference saves every step;
    checkpoint.save_steps is neutral to a resume)."""
    ref = tmp_path / "ref"
    args = (*SMALL_DATA, "--train.logging_steps", "1")
    result = run_launcher(ref, 2, *args, "--checkpoint.save_steps", "1")
    assert result.returncode == 0, result.output
    assert [m["epoch"] for m in read_metrics(ref)][18] == 1.0
    for step in (19, 25):
        res = tmp_path / f"res{step}"
        seed_resume_dir(ref, res, step)
        result = run_launcher(res, 2, *args, "--checkpoint.save_steps", str(step))
        assert result.returncode == 0, result.output
        assert f"resumed from {res / f'checkpoint-{step}'}" in result.output
        assert_same_losses(ref, res)
        assert_same_checkpoint(ref / "checkpoint-57", res / "checkpoint-57")

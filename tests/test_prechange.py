"""A checkpoint written before the redesign of a run's path (tests/prechange.py) resumes with
today's code and ends bit-identical to the run that wrote it: the on-disk format and the
trajectory did not change with the code's layout."""

from __future__ import annotations

import shutil

import pytest
import torch

from core.trainer import Trainer
from tests import prechange
from tests.checkpoints import assert_same_checkpoint, assert_same_losses

# What computed the fixture's final checkpoint; another torch may differ in the last bits of an
# uninterrupted run as well, so there the resumed run is held to today's uninterrupted one alone.
FIXTURE_TORCH = "2.13.0"


@pytest.fixture
def in_fixture_copy(tmp_path, monkeypatch):
    return prechange.enter_copy(tmp_path, monkeypatch)


def test_prechange_checkpoint_resumes_bit_identically(in_fixture_copy):
    fixture = in_fixture_copy
    resumed = fixture / "resumed"
    resumed.mkdir()
    step = prechange.STEP
    shutil.copytree(fixture / f"checkpoint-{step}", resumed / f"checkpoint-{step}")
    shutil.copy(fixture / "metrics.jsonl", resumed / "metrics.jsonl")  # truncated on resume
    began = prechange.began_at()
    out = Trainer(args=prechange.config(resumed), callbacks=[began]).train()
    assert (began.step, out.global_step) == (step, 6)

    fresh = fixture / "fresh"
    Trainer(args=prechange.config(fresh)).train()
    assert_same_checkpoint(fresh / "checkpoint-6", resumed / "checkpoint-6")
    assert_same_losses(fresh, resumed)
    if torch.__version__.split("+")[0] == FIXTURE_TORCH:
        assert_same_checkpoint(fixture / "final", resumed / "checkpoint-6")
        assert_same_losses(fixture, resumed)

"""The resume plan (core/plan.py) is made once, before the build; a checkpoint committed after it
and before this job took the run's lease (the previous holder's last save, right before it
released) is still the one resumed."""

from __future__ import annotations

import logging
import shutil

import pytest

from core.trainer import Trainer
from tests import prechange
from tests.checkpoints import assert_same_checkpoint


@pytest.fixture
def in_fixture_copy(tmp_path, monkeypatch):
    return prechange.enter_copy(tmp_path, monkeypatch)


def test_a_checkpoint_committed_before_the_lease_is_the_one_resumed(
    in_fixture_copy, monkeypatch, caplog
):
    run = in_fixture_copy / "run"
    take_lease = Trainer._acquire_lease

    def commit_then_take(self, config):
        # Planned on an empty run; the job that held it commits checkpoint-3, then lets go.
        assert self.loop is not None and self.loop.state.global_step == 0
        shutil.copytree(in_fixture_copy / "checkpoint-3", run / "checkpoint-3")
        shutil.copy(in_fixture_copy / "metrics.jsonl", run / "metrics.jsonl")
        return take_lease(self, config)

    monkeypatch.setattr(Trainer, "_acquire_lease", commit_then_take)
    run.mkdir()
    began = prechange.began_at()
    with caplog.at_level(logging.INFO, logger="core.trainer"):
        out = Trainer(args=prechange.config(run), callbacks=[began]).train()
    assert (began.step, out.global_step) == (3, 6)
    assert "the run changed before taking its lease: building it again" in caplog.text
    monkeypatch.setattr(Trainer, "_acquire_lease", take_lease)
    fresh = in_fixture_copy / "fresh"
    Trainer(args=prechange.config(fresh)).train()
    assert_same_checkpoint(fresh / "checkpoint-6", run / "checkpoint-6")

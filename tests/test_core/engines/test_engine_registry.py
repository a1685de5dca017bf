"""Engines register by name: a trivial engine defined here, outside core/, becomes a value of
engine.name through the public registry, trains, checkpoints and resumes bit-identically."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from typing import Any

import pytest
import torch

from checkpointing.manifest import read_manifest
from core.config import ConfigError
from core.engines import EngineInputs, engine_names, register_engine, unregister_engine
from core.engines.base import Engine
from core.engines.ddp import move_to_device
from core.engines.registry import crosses
from core.trainer import Trainer
from tests import prechange
from tests.checkpoints import assert_same_checkpoint, assert_same_losses


class PlainEngine(Engine):
    """One process, the model as it is: forward, backward, clip, step."""

    def __init__(self, inputs: EngineInputs) -> None:
        self.device = inputs.device
        self._model = inputs.model
        self._loss_fn = inputs.loss_fn
        self.optimizer = inputs.make_optimizer(inputs.model)
        self.schedule = inputs.make_schedule(self.optimizer)

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def train(self, mode: bool = True) -> None:
        self._model.train(mode)

    def accumulate(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def forward(self, batch: Any) -> torch.Tensor:
        return self._loss_fn(self._model, move_to_device(batch, self.device))

    def backward(self, loss: torch.Tensor, num_micro_batches: int) -> None:
        (loss / num_micro_batches).backward()

    def optimizer_step(self, max_grad_norm: float) -> torch.Tensor | None:
        norm = None
        if max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self._model.parameters(), max_grad_norm)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


@pytest.fixture
def plain_engine():
    register_engine("plain", PlainEngine)
    yield "plain"
    unregister_engine("plain")


def _config(run, engine: str):
    base = prechange.config(run)
    return dataclasses.replace(base, engine=dataclasses.replace(base.engine, name=engine))


def test_a_registered_engine_trains_and_resumes_bit_identically(
    tmp_path, monkeypatch, plain_engine
):
    prechange.enter_copy(tmp_path, monkeypatch)
    assert "plain" in engine_names()
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    Trainer(args=_config(whole, plain_engine)).train()
    assert read_manifest(whole / "checkpoint-6").engine == "plain"

    resumed.mkdir()
    shutil.copytree(whole / "checkpoint-3", resumed / "checkpoint-3")
    shutil.copy(whole / "metrics.jsonl", resumed / "metrics.jsonl")  # truncated on resume
    out = Trainer(args=_config(resumed, plain_engine)).train()
    assert out.global_step == 6
    assert_same_checkpoint(whole / "checkpoint-6", resumed / "checkpoint-6")
    assert_same_losses(whole, resumed)
    # Its state is not declared complete by name: no crossing to or from it.
    assert not crosses("plain", "ddp") and crosses("ddp", "fsdp")


def test_an_unregistered_engine_is_a_config_error(tmp_path, monkeypatch):
    prechange.enter_copy(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match="engine.name"):
        _config(tmp_path, "plain")

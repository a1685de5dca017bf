"""Unused dataset columns: core/columns.py against TinyGPT and a few forward signatures."""

from __future__ import annotations

import logging

import datasets
import pytest
import torch
from torch import nn

from core.data.columns import (
    accepts_any_column,
    default_label_names,
    filter_batch_keys,
    remove_unused_columns,
    signature_columns,
)
from core.models.tiny_gpt import TinyGPT


def _dataset() -> datasets.Dataset:
    ids = [[1, 2, 3], [4, 5, 6]]
    return datasets.Dataset.from_dict(
        {"input_ids": ids, "labels": ids, "text": ["abc", "def"], "idx": [0, 1]}
    )


def _tiny() -> TinyGPT:
    return TinyGPT(n_layer=1, n_head=1, n_embd=8, block_size=8)


class _Kwargs(nn.Module):
    def forward(self, input_ids: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return input_ids.float().mean()


class _Wrapper(nn.Module):
    """Like DDP: the user's model in `.module`, a forward that takes anything."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class _Compiled(nn.Module):
    """Like torch.compile's OptimizedModule: the user's model in `._orig_mod`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module

    def forward(self, *args, **kwargs):
        return self._orig_mod(*args, **kwargs)


class _QA(nn.Module):
    def forward(self, input_ids, start_positions=None, end_positions=None):
        return input_ids


class _NoLabels(nn.Module):
    def forward(self, x):
        return x


def test_unaccepted_columns_are_dropped_and_logged_once(caplog):
    ds = _dataset()
    with caplog.at_level(logging.INFO, logger="core.data.columns"):
        out = remove_unused_columns(ds, _tiny(), None, enabled=True)
    assert out.column_names == ["input_ids", "labels"]
    assert ds.column_names == ["input_ids", "labels", "text", "idx"]  # the input is untouched
    records = [r for r in caplog.records if r.name == "core.data.columns"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "not accepted by TinyGPT.forward and have been ignored: text, idx" in records[0].message


def test_disabled_keeps_every_column():
    ds = _dataset()
    assert remove_unused_columns(ds, _tiny(), None, enabled=False) is ds


def test_forward_with_kwargs_keeps_every_column(caplog):
    ds = _dataset()
    assert accepts_any_column(_Kwargs())
    with caplog.at_level(logging.INFO, logger="core.data.columns"):
        assert remove_unused_columns(ds, _Kwargs(), None, enabled=True) is ds
    assert not caplog.records


def test_nothing_to_drop_returns_the_dataset():
    ds = _dataset().remove_columns(["text", "idx"])
    assert remove_unused_columns(ds, _tiny(), None, enabled=True) is ds


@pytest.mark.parametrize("wrap", [_Wrapper, _Compiled, lambda m: _Wrapper(_Compiled(m))])
def test_wrappers_are_unwrapped(wrap, caplog):
    model = wrap(_tiny())
    assert signature_columns(model) == ["input_ids", "labels", "label", "label_ids"]
    assert not accepts_any_column(model)  # the wrapper's own **kwargs does not count
    with caplog.at_level(logging.INFO, logger="core.data.columns"):
        out = remove_unused_columns(_dataset(), model, None, enabled=True)
    assert out.column_names == ["input_ids", "labels"]
    assert "TinyGPT.forward" in caplog.text


def test_label_names_are_accepted():
    ds = datasets.Dataset.from_dict({"x": [1, 2], "target": [0, 1], "label": [1, 0], "n": [3, 4]})
    out = remove_unused_columns(ds, _NoLabels(), ["target"], enabled=True)
    assert out.column_names == ["x", "target", "label"]
    assert signature_columns(_NoLabels(), ["target", "x"]) == ["x", "label", "label_ids", "target"]


def test_nothing_remaining_raises_naming_both_sides():
    ds = _dataset().remove_columns(["input_ids", "labels"])
    with pytest.raises(ValueError, match="no dataset column is accepted by TinyGPT.forward") as e:
        remove_unused_columns(ds, _tiny(), None, enabled=True)
    assert "input_ids, labels, label, label_ids" in str(e.value)
    assert "text, idx" in str(e.value)


def test_torch_map_style_dataset_is_returned_unchanged():
    ds = torch.utils.data.TensorDataset(torch.arange(4))
    assert remove_unused_columns(ds, _tiny(), None, enabled=True) is ds


def test_filter_batch_keys():
    batch = {"input_ids": 1, "text": 2, "labels": 3}
    out = filter_batch_keys(batch, signature_columns(_tiny()))
    assert out == {"input_ids": 1, "labels": 3} and list(out) == ["input_ids", "labels"]
    assert set(batch) == {"input_ids", "text", "labels"}


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (_tiny(), ["labels"]),
        (_Wrapper(_tiny()), ["labels"]),
        (_QA(), ["start_positions", "end_positions"]),
        (_NoLabels(), []),
        (_Kwargs(), ["labels"]),
    ],
)
def test_default_label_names(model, expected):
    assert default_label_names(model) == expected

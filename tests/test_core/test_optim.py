"""Parameter groups and the optimizer names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core.config import ConfigError, OptimConfig
from core.models.tiny_gpt import TinyGPT
from core.optim import build_optimizer, decay_parameter_names, parameter_groups


class MyRMSNorm(nn.Module):  # a user's own norm class, recognised by name
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


def test_no_decay_for_biases_and_norm_weights():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), MyRMSNorm(), nn.Embedding(3, 4))
    assert decay_parameter_names(model) == {"0.weight", "3.weight"}
    decay, no_decay = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [p.shape for p in decay["params"]] == [(4, 4), (3, 4)]
    assert len(no_decay["params"]) == 4  # linear bias, layernorm weight+bias, rmsnorm weight


def test_tiny_gpt_groups_cover_each_parameter_once():
    model = TinyGPT()
    groups = parameter_groups(model, 0.01)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    names = decay_parameter_names(model)
    assert "wte.weight" in names and "blocks.0.ln_1.weight" not in names
    assert "blocks.0.attn.qkv.bias" not in names


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("adamw_torch", torch.optim.AdamW),
        ("adamw_torch_fused", torch.optim.AdamW),
        ("sgd", torch.optim.SGD),
        ("adagrad", torch.optim.Adagrad),
        ("adafactor", torch.optim.Adafactor),
    ],
)
def test_each_optimizer_builds_and_steps(name, cls):
    model = TinyGPT(n_layer=1, n_embd=16, n_head=2, block_size=8)
    opt = build_optimizer(
        model, OptimConfig(name=name, lr=0.01, weight_decay=0.1, momentum=0.9), torch.device("cpu")
    )
    assert isinstance(opt, cls)
    before = model.wpe.weight.detach().clone()
    x = torch.randint(0, 256, (2, 8))
    model(x, labels=x)["loss"].backward()
    opt.step()
    assert not torch.equal(before, model.wpe.weight)
    if name == "adamw_torch_fused":
        assert opt.defaults["fused"] is True
    if name == "sgd":
        assert opt.defaults["momentum"] == 0.9


def test_unknown_optimizer_lists_valid_names():
    with pytest.raises(ConfigError, match="accepted: adamw_torch, adamw_torch_fused, sgd"):
        OptimConfig(name="lion")

"""Label smoothing: core/losses.py against F.cross_entropy, and compute_loss with TinyGPT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.data import collate
from core.losses import LOGITS_NEEDED, LabelSmoother, compute_loss
from core.models import call_model
from core.models.tiny_gpt import TinyGPT

B, T, V = 3, 9, 17


def _lm_tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 3
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 5:] = -100  # right padding
    labels[2, 1] = -100  # a hole
    return logits, labels


def _reference(logits: torch.Tensor, labels: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LabelSmoother formula, written independently of F.cross_entropy's smoothing."""
    logp = F.log_softmax(logits.float(), dim=-1)
    keep = labels != -100
    nll = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    smooth = -logp.mean(dim=-1)
    per_target = (1 - eps) * nll + eps * smooth
    return per_target[keep].sum() / keep.sum()


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_causal_lm_equals_cross_entropy_on_shifted_tensors(eps):
    logits, labels = _lm_tensors()
    got = LabelSmoother(eps)(logits, labels)
    want = F.cross_entropy(
        logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), label_smoothing=eps
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_causal_lm_matches_the_hf_formula(eps):
    logits, labels = _lm_tensors(seed=1)
    got = LabelSmoother(eps)(logits, labels)
    want = _reference(logits[:, :-1], labels[:, 1:], eps)
    # A different sequence of float32 ops: equal up to a few ulps of a loss near 3.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_smoothing_changes_the_loss():
    logits, labels = _lm_tensors()
    assert not torch.equal(LabelSmoother(0.1)(logits, labels), LabelSmoother(0.0)(logits, labels))


def test_ignored_targets_do_not_count():
    logits, labels = _lm_tensors()
    labels[1] = -100  # a fully padded sample
    smoother = LabelSmoother(0.1)
    loss = smoother(logits, labels)
    other = logits.clone()
    other[1] = torch.randn(T, V) * 10  # whatever a padded sample predicts
    other[0, 5:-1] = 0.0  # and the positions before padding labels
    assert torch.equal(smoother(other, labels), loss)
    without = smoother(logits[[0, 2]], labels[[0, 2]])  # the mean is over real targets only
    torch.testing.assert_close(loss, without, rtol=0, atol=1e-6)


def test_first_label_is_never_a_target():
    # Unshifted labels: position 0 has no predecessor to predict it.
    logits, labels = _lm_tensors()
    changed = labels.clone()
    changed[:, 0] = (labels[:, 0] + 1) % V
    smoother = LabelSmoother(0.1)
    assert torch.equal(smoother(logits, changed), smoother(logits, labels))


def test_classification_shape_is_not_shifted():
    g = torch.Generator().manual_seed(2)
    logits, labels = torch.randn(5, 4, generator=g), torch.tensor([0, 3, -100, 1, 2])
    got = LabelSmoother(0.1)(logits, labels)
    assert torch.equal(got, F.cross_entropy(logits, labels, label_smoothing=0.1))


def test_bf16_logits_are_computed_in_float32():
    logits, labels = _lm_tensors()
    low = logits.bfloat16()
    got = LabelSmoother(0.1)(low, labels)
    assert got.dtype == torch.float32
    want = F.cross_entropy(
        low[:, :-1].reshape(-1, V).float(), labels[:, 1:].reshape(-1), label_smoothing=0.1
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("logits_shape", "labels_shape"),
    [
        ((B, T, V), (B, T + 1)),
        ((B, T, V), (B,)),
        ((B, V), (B, 1)),
        ((B, V), (B + 1,)),
        ((B, T, V, 2), (B, T, V)),
    ],
)
def test_bad_shapes_raise_naming_them(logits_shape, labels_shape):
    logits, labels = torch.zeros(logits_shape), torch.zeros(labels_shape, dtype=torch.long)
    with pytest.raises(ValueError, match=r"shape \(.*\) with labels of shape \(.*\)") as info:
        LabelSmoother(0.1)(logits, labels)
    assert str(tuple(logits_shape)) in str(info.value)
    assert str(tuple(labels_shape)) in str(info.value)


def test_epsilon_out_of_range_raises():
    with pytest.raises(ValueError, match="epsilon"):
        LabelSmoother(1.0)


def _tiny_batch() -> tuple[TinyGPT, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=1, n_head=2, n_embd=16, block_size=16, dropout=0.0)
    samples = [{"input_ids": [5, 6, 7, 8, 9, 10]}, {"input_ids": [1, 2, 3]}]  # padded
    return model, collate(samples)


def test_tiny_gpt_eps_zero_equals_the_models_own_loss():
    model, batch = _tiny_batch()
    got = compute_loss(model, batch, LabelSmoother(0.0), ["labels"])
    assert torch.equal(got, call_model(model, batch))
    assert torch.equal(compute_loss(model, batch, None, ["labels"]), call_model(model, batch))


def test_tiny_gpt_smoothed_loss_keeps_the_callers_batch():
    model, batch = _tiny_batch()
    loss = compute_loss(model, batch, LabelSmoother(0.1), ["label_ids", "labels"])
    assert set(batch) == {"input_ids", "labels"}  # labels popped from a copy only
    logits = model(input_ids=batch["input_ids"])["logits"]
    assert torch.equal(loss, LabelSmoother(0.1)(logits, batch["labels"]))
    loss.backward()
    assert model.wte.weight.grad is not None


class _LossOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return {"loss": self.w * input_ids.float().mean()}


def test_model_without_logits_raises():
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long)}
    batch["labels"] = batch["input_ids"]
    with pytest.raises(ValueError, match=LOGITS_NEEDED):
        compute_loss(_LossOnly(), batch, LabelSmoother(0.1), ["labels"])


def test_batch_without_labels_raises():
    model, batch = _tiny_batch()
    del batch["labels"]
    with pytest.raises(ValueError, match="none of data.label_names"):
        compute_loss(model, batch, LabelSmoother(0.1), ["labels"])

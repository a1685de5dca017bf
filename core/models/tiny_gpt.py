"""A tiny byte-level GPT-style decoder: the built-in model (`model.name: tiny-gpt`).

No torch.distributed here: wrapping for data parallelism happens in core/engines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.reporting.memory import tiny_gpt_flops

VOCAB_SIZE = 256  # one token per byte
IGNORE_INDEX = -100


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=bias),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """forward(input_ids, labels=None) -> {"loss", "logits"}; labels are shifted inside, as in a
    Hugging Face causal LM, and positions labelled -100 are ignored."""

    def __init__(
        self,
        n_layer: int = 2,
        n_head: int = 2,
        n_embd: int = 64,
        block_size: int = 64,
        dropout: float = 0.1,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(VOCAB_SIZE, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2
        self.gradient_checkpointing = False
        self.apply(self._init_weights)

    def training_flops(self, tokens: int, seq_len: int) -> float:
        """Training FLOPs (forward + backward) of `tokens` tokens at context `seq_len`
        (core.reporting.memory.tiny_gpt_flops; position embeddings left out)."""
        n_params = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        n_embd = self.wpe.embedding_dim
        return tiny_gpt_flops(n_params, len(self.blocks), n_embd, seq_len, tokens)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def gradient_checkpointing_enable(self) -> None:
        """The hook the loop calls for `model.gradient_checkpointing: true`."""
        self.gradient_checkpointing = True

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        t = input_ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                # preserve_rng_state (the default) replays dropout exactly in the recomputation.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB_SIZE).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=IGNORE_INDEX,
            )
        return out

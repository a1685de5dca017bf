"""Tiny Hugging Face models, a tokenizer and data, made locally (nothing downloads).

The tokenizer is a byte-level BPE trained here with `tokenizers` on a slice of the standard
library's source, wrapped as a transformers fast tokenizer with a ChatML-style chat template;
the models are tiny Llama and GPT-2 architectures saved with `save_pretrained` (safetensors).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
VOCAB = 400


@dataclass(frozen=True)
class Assets:
    tokenizer: Path
    """A tokenizer directory (tokenizer.json, tokenizer_config.json, chat template)."""
    llama: Path
    """A tiny LlamaForCausalLM directory with the tokenizer's files beside its weights."""
    gpt2: Path
    """A tiny GPT2LMHeadModel directory (tied head), vocabulary of the tokenizer."""
    text: Path
    """A text file of a few hundred lines."""
    chat: Path
    """A jsonl file of conversations (system/user/assistant), all usable."""


def corpus_lines(n: int = 600, seed: int = 0) -> list[str]:
    """Plain English-like lines from a fixed word list (deterministic)."""
    rng = random.Random(seed)
    words = (
        "the model trains on text and learns to predict the next token while a checkpoint "
        "keeps every state so that a run resumes at the exact batch it stopped"
    ).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 18))) for _ in range(n)]


def conversations(n: int = 120, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    lines = corpus_lines(4 * n, seed)
    rows = []
    for i in range(n):
        messages = []
        if i % 3 == 0:
            messages.append({"role": "system", "content": "you are terse"})
        for turn in range(1 + i % 2):
            messages.append(
                {
                    "role": "user",
                    "content": f"question {rng.randint(0, 99)}: " + lines[4 * i + turn],
                }
            )
            messages.append({"role": "assistant", "content": lines[4 * i + 2 + turn]})
        rows.append({"messages": messages})
    return rows


def make_tokenizer(out: Path, texts: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


def make_llama(out: Path, tokenizer: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_gpt2(out: Path, tokenizer: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = GPT2Config(
        vocab_size=len(tok),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(out)
    return out


def make_assets(root: Path) -> Assets:
    root.mkdir(parents=True, exist_ok=True)
    lines = corpus_lines()
    text = root / "corpus.txt"
    text.write_text("\n".join(lines) + "\n")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in conversations()))
    tokenizer = make_tokenizer(root / "tokenizer", lines)
    return Assets(
        tokenizer=tokenizer,
        llama=make_llama(root / "llama", tokenizer),
        gpt2=make_gpt2(root / "gpt2", tokenizer),
        text=text,
        chat=chat,
    )

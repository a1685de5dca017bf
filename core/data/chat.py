"""Chat rows (`data.format: chat`) to token ids and labels.

A row holds `messages`, a list of {role, content}. It is rendered whole with the chat template
(the tokenizer's, or `data.chat_template`) and tokenised without added special tokens (the
template writes its own). With `data.train_on: assistant` a token is a label only when its
characters lie entirely inside an assistant turn: the text the template adds for that turn
after the prompt that asks for it (`add_generation_prompt`), i.e. the reply and the template's
end-of-turn marker. Every other token, including one that straddles a turn boundary, gets -100.
The turn spans come from rendering the conversation prefix by prefix, so any template works
whose rendering of a conversation starts with the rendering of its first turns. An assistant turn
that opens a conversation answers no prompt: it is context, not a label.

Rows that cannot be used are counted by reason (`SKIP_REASONS`), never silently dropped.
"""

from __future__ import annotations

import logging
from typing import Any

import jinja2
import numpy as np
import pyarrow as pa

from core.data.errors import DataError
from core.data.pack import IGNORE, ragged
from core.data.tokenizers import HFTokenizer

logger = logging.getLogger(__name__)
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError)
DATE_STRING = "26 Jul 2024"
"""What templates that print a date are given (Llama 3's own default)."""
ROLES = ("system", "user", "assistant", "tool")
SKIP_REASONS = (
    "",  # 0: used
    "no messages",
    "an unknown role",
    "no assistant turn",
    "empty text",
    "a chat template error",
    "a template that rewrites earlier turns",
    "no assistant token within data.seq_len",
)
(
    USED,
    NO_MESSAGES,
    UNKNOWN_ROLE,
    NO_ASSISTANT,
    EMPTY_TEXT,
    TEMPLATE_ERROR,
    NOT_PREFIX,
    TRUNCATED,
) = range(len(SKIP_REASONS))


def _clean(messages: Any) -> tuple[list[dict[str, Any]] | None, int]:
    """The messages with null fields dropped (Arrow fills absent keys with null), or a reason."""
    if not isinstance(messages, list) or not messages:
        return None, NO_MESSAGES
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            return None, UNKNOWN_ROLE
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():
            return None, EMPTY_TEXT
        out.append({k: v for k, v in m.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        return None, NO_ASSISTANT
    return out, USED


def _render(tokenizer: HFTokenizer, messages: list, template: str | None, prompt: bool) -> str:
    # A fixed date_string: templates that print today's date (Llama 3's "Today Date") would
    # otherwise render other samples on another day.
    return tokenizer.hf.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=prompt,
        chat_template=template,
        date_string=DATE_STRING,
    )


def check_template(tokenizer: HFTokenizer, template: str | None) -> None:
    """Refuse a template that does not parse, once, before any row is rendered."""
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    try:
        _render(tokenizer, probe, template, prompt=False)
    except jinja2.TemplateSyntaxError as e:
        where = "data.chat_template" if template is not None else f"data.tokenizer {tokenizer.spec}"
        raise DataError(f"{where}: the chat template does not parse: {e}") from e
    except TEMPLATE_ERRORS:
        pass  # a template may refuse this probe (e.g. ask for a system turn): rows will tell


def _spans(
    tokenizer: HFTokenizer, messages: list, template: str | None, full: str
) -> list[tuple[int, int]] | None:
    """Character spans of the assistant turns in `full`; None when the template renders a
    conversation as something other than its rendered prefixes plus more text."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:
            continue  # an opening assistant turn answers no prompt: context, not a label
        asked = _render(tokenizer, messages[:i], template, prompt=True)
        answered = _render(tokenizer, messages[: i + 1], template, prompt=False)
        if not (answered.startswith(asked) and full.startswith(answered)):
            return None
        spans.append((len(asked), len(answered)))
    return spans


def _labels(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]):
    """ids where the token lies inside a span, else IGNORE."""
    out = np.full(len(ids), IGNORE, dtype=np.int32)
    if not ids:
        return out
    starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
    ends = np.fromiter((o[1] for o in offsets), dtype=np.int64, count=len(offsets))
    inside = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        inside |= (starts >= s) & (ends <= e) & (ends > starts)
    values = np.asarray(ids, dtype=np.int32)
    out[inside] = values[inside]
    return out


def has_label(labels: np.ndarray) -> bool:
    """A sample trains on something: a label after position 0 (the first is never predicted)."""
    return bool((labels[1:] != IGNORE).any())


def encode_chat(
    batch: dict[str, list],
    tokenizer: HFTokenizer,
    template: str | None,
    train_on: str,
    seq_len: int,
    packing: bool,
    dtype: str,
) -> pa.Table:
    """datasets.map function: one output row per input row, with columns input_ids, labels and
    skip (0, or the index of the row's reason in SKIP_REASONS; its ids are then empty)."""
    rows = batch["messages"]
    skip = np.zeros(len(rows), dtype=np.uint8)
    texts: list[str] = []
    spans: list[list[tuple[int, int]]] = []
    kept: list[int] = []
    for i, raw in enumerate(rows):
        messages, reason = _clean(raw)
        if messages is None:
            skip[i] = reason
            continue
        try:
            full = _render(tokenizer, messages, template, prompt=False)
            if train_on == "all":
                turns: list[tuple[int, int]] | None = [(0, len(full))]
            else:
                turns = _spans(tokenizer, messages, template, full)
        except TEMPLATE_ERRORS as e:  # a template's raise_exception, or Python errors inside it
            if not (skip == TEMPLATE_ERROR).any():  # counted; the first of a batch logged
                logger.warning("chat row %d: the chat template failed: %s", i, e)
            skip[i] = TEMPLATE_ERROR
            continue
        if turns is None:
            skip[i] = NOT_PREFIX
            continue
        texts.append(full)
        spans.append(turns)
        kept.append(i)
    encodings = (
        tokenizer.chat_backend.encode_batch(texts, add_special_tokens=False) if texts else []
    )
    ids_out: list[np.ndarray] = [np.zeros(0, dtype=dtype)] * len(rows)
    labels_out: list[np.ndarray] = [np.zeros(0, dtype=np.int32)] * len(rows)
    for i, enc, turns in zip(kept, encodings, spans, strict=True):
        ids = np.asarray(enc.ids, dtype=dtype)
        labels = _labels(enc.ids, enc.offsets, turns)
        if not packing:
            ids, labels = ids[:seq_len], labels[:seq_len]
        if not has_label(labels):
            skip[i] = TRUNCATED
            continue
        ids_out[i], labels_out[i] = ids, labels
    return pa.table(
        {
            "input_ids": ragged(ids_out, dtype),
            "labels": ragged(labels_out, np.int32),
            "skip": pa.array(skip),
        }
    )


def skip_report(counts: np.ndarray, total: int) -> str | None:
    """One line: how many rows were skipped, by reason; None when none was."""
    skipped = int(counts[1:].sum())
    if not skipped:
        return None
    parts = [f"{n} with {SKIP_REASONS[r]}" for r, n in enumerate(counts) if r and n]
    return f"skipped {skipped} of {total} chat rows: {', '.join(parts)}"

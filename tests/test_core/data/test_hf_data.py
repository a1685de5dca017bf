"""Text and chat data through a Hugging Face tokenizer: EOS between packed documents, labels that
never hold a prompt token, bad rows counted by reason, the cache that makes tokenising run once,
the fingerprint that covers the tokenizer, and the errors a user can cause."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from core.config import ConfigError, DataConfig
from core.data import DataError, build_dataset, collate, dataset_fingerprint, load_tokenizer
from core.data.tokenizers import HFTokenizer
from core.models import check_vocab

IGNORE = -100


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Keep datasets' Arrow cache inside the test's temp dir, never in ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def text_cfg(assets, **kw) -> DataConfig:
    values = {"source": str(assets.text), "tokenizer": f"hf:{assets.tokenizer}", "seq_len": 32}
    return DataConfig(**{**values, **kw})


def chat_cfg(assets, source: Path | None = None, **kw) -> DataConfig:
    values = {
        "source": str(source or assets.chat),
        "format": "chat",
        "tokenizer": f"hf:{assets.tokenizer}",
        "seq_len": 96,
    }
    return DataConfig(**{**values, **kw})


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- text ------------------------------------------------------------------------------------


def test_packed_text_is_the_documents_with_eos_between_cut_in_blocks(hf_assets):
    cfg = text_cfg(hf_assets)
    tok = load_tokenizer(cfg)
    ds = build_dataset(cfg, tok)
    assert ds.features["input_ids"].feature.dtype == "uint16"  # 365 ids fit
    lines = hf_assets.text.read_text().splitlines()
    expected = [i for ids in tok.encode(lines) for i in [*ids, tok.eos_id]]
    flat = [i for row in ds["input_ids"] for i in row]
    assert len(ds) == len(expected) // 32 and all(len(r) == 32 for r in ds["input_ids"])
    assert flat == expected[: len(flat)]


def test_unpacked_text_is_one_truncated_document_per_sample_with_eos(hf_assets):
    cfg = text_cfg(hf_assets, packing=False, seq_len=8)
    tok = load_tokenizer(cfg)
    ds = build_dataset(cfg, tok)
    first = tok.encode([hf_assets.text.read_text().splitlines()[0]])[0]
    assert ds[0]["input_ids"] == [*first, tok.eos_id][:8]
    assert max(len(r) for r in ds["input_ids"]) == 8


def test_num_proc_gives_the_same_samples(hf_assets, monkeypatch):
    # datasets turns the tokenizers' own threads off before it forks its workers.
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    one = build_dataset(text_cfg(hf_assets))
    two = build_dataset(text_cfg(hf_assets, num_proc=2))
    assert one["input_ids"] == two["input_ids"]
    assert dataset_fingerprint(one) == dataset_fingerprint(two)


def test_a_second_build_reads_the_cache_and_does_not_tokenise(hf_assets, monkeypatch):
    cfg = text_cfg(hf_assets)
    first = build_dataset(cfg)

    def refuse(*args, **kwargs):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(HFTokenizer, "encode", refuse)
    again = build_dataset(cfg)
    assert again["input_ids"] == first["input_ids"]


def test_fingerprint_covers_the_tokenizer(hf_assets, tmp_path):
    base = dataset_fingerprint(build_dataset(text_cfg(hf_assets)))
    tok = load_tokenizer(text_cfg(hf_assets)).hf
    tok.add_special_tokens({"additional_special_tokens": ["<extra>"]})  # same ids for the text
    other = tmp_path / "tok2"
    tok.save_pretrained(other)
    changed = build_dataset(text_cfg(hf_assets, tokenizer=f"hf:{other}"))
    assert changed["input_ids"] == build_dataset(text_cfg(hf_assets))["input_ids"]
    assert dataset_fingerprint(changed) != base


def test_stdlib_source_with_a_hf_tokenizer(hf_assets):
    ds = build_dataset(DataConfig(tokenizer=f"hf:{hf_assets.tokenizer}", max_bytes=5000))
    assert len(ds) > 10 and all(len(r) == 64 for r in ds["input_ids"])


# --- chat ------------------------------------------------------------------------------------


def labelled_text(tok: HFTokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of consecutive labelled tokens."""
    runs, current = [], []
    for i, label in zip(ids, labels, strict=True):
        if label == IGNORE:
            if current:
                runs.append(tok.hf.decode(current))
            current = []
        else:
            assert label == i
            current.append(i)
    if current:
        runs.append(tok.hf.decode(current))
    return runs


@pytest.mark.parametrize("packing", [False, True])
def test_no_prompt_token_is_ever_a_label(hf_assets, packing):
    cfg = chat_cfg(hf_assets, packing=packing)
    tok = load_tokenizer(cfg)
    ds = build_dataset(cfg, tok)
    rows = [json.loads(line) for line in hf_assets.chat.read_text().splitlines()]
    replies = {m["content"] + "<|im_end|>\n" for r in rows for m in r["messages"]}
    replies = {r for r in replies if not r.startswith(("question", "you are"))}
    prompts = [m["content"] for r in rows for m in r["messages"] if m["role"] != "assistant"]
    labelled = 0
    for sample in ds:
        for run in labelled_text(tok, sample["input_ids"], sample["labels"]):
            labelled += 1
            assert "<|im_start|>" not in run and "user" not in run and "question" not in run
            # A whole reply, or (packed) the part of one at a block edge; never a prompt.
            assert any(run in reply for reply in replies), run
            assert not any(p in run for p in prompts if len(p) > 20), run
    assert labelled > len(ds) // 2
    if not packing:  # one conversation per sample: every reply is labelled whole
        first = ds[0]
        runs = labelled_text(tok, first["input_ids"], first["labels"])
        assistant = [m for m in rows[0]["messages"] if m["role"] == "assistant"]
        assert runs == [m["content"] + "<|im_end|>\n" for m in assistant]


def test_train_on_all_labels_every_token(hf_assets):
    ds = build_dataset(chat_cfg(hf_assets, train_on="all"))
    assert all(s["labels"] == s["input_ids"] for s in ds)


def test_bad_rows_are_counted_by_reason_in_one_line(hf_assets, tmp_path, caplog):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    rows = [
        good,
        {"other": 1},
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]},
        good,
    ]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        ds = build_dataset(chat_cfg(hf_assets, path, packing=False))
    assert len(ds) == 2
    lines = [r.getMessage() for r in caplog.records if "chat rows" in r.getMessage()]
    assert lines == [
        "data: skipped 4 of 6 chat rows: 1 with no messages, 1 with an unknown role, "
        "1 with no assistant turn, 1 with empty text"
    ]


def test_no_usable_row_is_a_data_error(hf_assets, tmp_path):
    path = write_rows(tmp_path / "rows.jsonl", [{"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DataError, match="no usable chat row.*1 with no assistant turn"):
        build_dataset(chat_cfg(hf_assets, path))


def test_a_tokenizer_without_chat_template_names_data_chat_template(hf_assets, tmp_path):
    tok = load_tokenizer(chat_cfg(hf_assets)).hf
    tok.chat_template = None
    plain = tmp_path / "plain"
    tok.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(DataError, match=r"^data.chat_template: the tokenizer"):
        build_dataset(chat_cfg(hf_assets, tokenizer=f"hf:{plain}"))
    # Given in the config (inline or as a file), it is used.
    template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    inline = build_dataset(chat_cfg(hf_assets, tokenizer=f"hf:{plain}", chat_template=template))
    (tmp_path / "t.jinja").write_text(template)
    from_file = chat_cfg(
        hf_assets, tokenizer=f"hf:{plain}", chat_template=str(tmp_path / "t.jinja")
    )
    assert build_dataset(from_file)["labels"] == inline["labels"]
    tok2 = load_tokenizer(from_file)
    runs = labelled_text(tok2, inline[0]["input_ids"], inline[0]["labels"])
    assert runs and all(not r.startswith("[") for r in runs)  # the role tag is prompt


def test_a_template_that_rewrites_earlier_turns_skips_the_row(hf_assets, tmp_path):
    # Only the last assistant turn is rendered in full: earlier prefixes are not prefixes.
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[elided]"
        "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    two_turns = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ]
    }
    one_turn = {"messages": two_turns["messages"][:2]}
    path = write_rows(tmp_path / "rows.jsonl", [two_turns, one_turn])
    ds = build_dataset(chat_cfg(hf_assets, path, chat_template=template, packing=False))
    assert len(ds) == 1


def test_collate_pads_labels_with_ignore():
    batch = collate(
        [
            {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]},
            {"input_ids": [8, 9], "labels": [IGNORE, 9]},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [IGNORE, 9, IGNORE]]
    packed = collate([{"input_ids": [1, 2], "labels": [IGNORE, 2]}])
    assert packed["labels"].dtype == torch.long and packed["labels"].tolist() == [[IGNORE, 2]]


# --- errors ----------------------------------------------------------------------------------


def test_tokenizer_errors_name_the_key(hf_assets, tmp_path):
    with pytest.raises(DataError, match="^data.tokenizer: no such directory"):
        load_tokenizer(text_cfg(hf_assets, tokenizer=f"hf:{tmp_path}/missing"))
    with pytest.raises(DataError, match="^data.tokenizer: .* holds no tokenizer.json"):
        load_tokenizer(text_cfg(hf_assets, tokenizer=f"hf:{tmp_path}"))
    with pytest.raises(ConfigError, match="^data.format: chat needs a tokenizer"):
        DataConfig(source=str(hf_assets.chat), format="chat")
    with pytest.raises(ConfigError, match="^data.chat_template: no such file"):
        chat_cfg(hf_assets, chat_template="missing.jinja")


def test_vocab_larger_than_the_embedding_is_refused_with_both_sizes(hf_assets):
    tok = load_tokenizer(text_cfg(hf_assets))
    check_vocab(tok, tok.vocab_size, "m")
    with pytest.raises(DataError, match=rf"ids up to {tok.vocab_size - 1}.*embedding of 300 rows"):
        check_vocab(tok, 300, "m")
    with pytest.raises(DataError, match="bytes produces ids up to 255.*embedding of 100 rows"):
        check_vocab(None, 100, "m")
    assert np.iinfo(np.uint16).max >= tok.vocab_size


# --- what a tokenizer.json or a template may hide ----------------------------------------------


def test_truncation_and_padding_saved_in_tokenizer_json_are_not_applied(hf_assets, tmp_path):
    tok = load_tokenizer(text_cfg(hf_assets)).hf
    tok.backend_tokenizer.enable_truncation(max_length=4)
    tok.backend_tokenizer.enable_padding(length=48, pad_id=tok.pad_token_id)
    saved = tmp_path / "truncating"
    tok.save_pretrained(saved)
    plain = build_dataset(text_cfg(hf_assets, packing=False, seq_len=40))
    odd = build_dataset(text_cfg(hf_assets, packing=False, seq_len=40, tokenizer=f"hf:{saved}"))
    assert odd["input_ids"] == plain["input_ids"]  # whole documents, no pad ids


def test_a_token_that_takes_the_prompts_last_space_is_no_label(hf_assets, tmp_path):
    from tokenizers import processors

    tok = load_tokenizer(text_cfg(hf_assets)).hf
    # GPT-2's post-processor: offsets of " hello" skip the space (trim_offsets).
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    saved = tmp_path / "trimming"
    tok.save_pretrained(saved)
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    rows = [
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "trains the model"},
            ]
        }
    ]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    cfg = chat_cfg(hf_assets, path, tokenizer=f"hf:{saved}", chat_template=template, packing=False)
    ds = build_dataset(cfg)
    runs = labelled_text(load_tokenizer(cfg), ds[0]["input_ids"], ds[0]["labels"])
    # " trains" holds the prompt's last space: no label (with trimmed offsets it would be one).
    assert runs == [" the model\n"]


def test_an_opening_assistant_turn_is_context_not_a_label(hf_assets, tmp_path):
    a, u = "assistant", "user"
    rows = [
        {"messages": [{"role": a, "content": "hi there"}, {"role": u, "content": "q"}]},
        {
            "messages": [
                {"role": a, "content": "hi there"},
                {"role": u, "content": "q"},
                {"role": a, "content": "the answer"},
            ]
        },
    ]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    cfg = chat_cfg(hf_assets, path, packing=False)
    ds = build_dataset(cfg)
    assert len(ds) == 1
    runs = labelled_text(load_tokenizer(cfg), ds[0]["input_ids"], ds[0]["labels"])
    assert runs == ["the answer<|im_end|>\n"]


def test_a_template_that_does_not_parse_is_refused_once(hf_assets):
    with pytest.raises(DataError, match="^data.chat_template: the chat template does not parse"):
        build_dataset(chat_cfg(hf_assets, chat_template="{% for m in messages %}{{ m }"))


def test_templates_that_print_a_date_get_a_fixed_one(hf_assets, tmp_path):
    template = (
        "{{ date_string }}\n{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    cfg = chat_cfg(hf_assets, chat_template=template, packing=False)
    ds = build_dataset(cfg)
    assert load_tokenizer(cfg).hf.decode(ds[0]["input_ids"]).startswith("26 Jul 2024\n")


def test_a_file_replaced_under_its_old_mtime_is_read_again(hf_assets, tmp_path):
    import os

    path = tmp_path / "corpus.txt"
    path.write_text("the model trains\n" * 50)
    before = build_dataset(text_cfg(hf_assets, source=str(path)))
    stat = path.stat()
    path.write_text("a checkpoint keeps every state\n" * 60)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # cp -p, tar x
    after = build_dataset(text_cfg(hf_assets, source=str(path)))
    assert after["input_ids"] != before["input_ids"]

"""Config parsing, overrides, and every bad-input case (one line naming the key)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated

import pytest
import yaml

from core.config import (
    DEFAULT_CONFIG,
    SECTIONS,
    Config,
    ConfigError,
    config_roles,
    dump_config,
    load_config,
    parse_overrides,
)
from core.config.roles import NEUTRAL, field_roles


def test_default_config_file_loads():
    config = load_config(None)
    assert config.model.name == "tiny-gpt"
    assert config.train.max_steps == 200
    assert load_config(DEFAULT_CONFIG) == config


def test_default_file_names_every_field():
    """configs/tiny.yaml is the embedded default: it spells out every field."""
    written = yaml.safe_load(DEFAULT_CONFIG.read_text())
    assert written == load_config(None).to_dict()


def test_public_cli_surface_is_pinned():
    """Changing a config name changes users' command lines: do it on purpose, here."""
    surface = {
        name: [f.name for f in dataclasses.fields(cls)]
        for name, cls in typing.get_type_hints(Config).items()
    }
    assert surface == {
        "run": [
            "output_dir",
            "seed",
            "full_determinism",
            "overwrite",
            "log_level",
            "report_to",
            "lease_wait_s",
            "lease_timeout_s",
        ],
        "model": [
            "name",
            "pretrained",
            "dtype",
            "attn_implementation",
            "trust_remote_code",
            "n_layer",
            "n_head",
            "n_embd",
            "block_size",
            "dropout",
            "bias",
            "gradient_checkpointing",
            "kwargs",
        ],
        "data": [
            "source",
            "store",
            "storage_options",
            "shard_bytes",
            "store_cache_bytes",
            "format",
            "text_field",
            "tokenizer",
            "num_proc",
            "train_on",
            "chat_template",
            "seq_len",
            "packing",
            "max_bytes",
            "num_workers",
            "drop_last",
            "group_by_length",
            "remove_unused_columns",
            "label_names",
        ],
        "train": [
            "max_steps",
            "num_epochs",
            "per_device_batch_size",
            "gradient_accumulation_steps",
            "keep_global_batch",
            "max_grad_norm",
            "logging_steps",
            "bf16",
            "progress_bar",
            "auto_find_batch_size",
            "label_smoothing_factor",
        ],
        "eval": ["strategy", "steps", "per_device_batch_size", "source", "holdout_samples"],
        "optim": ["name", "lr", "weight_decay", "beta1", "beta2", "eps", "momentum"],
        "scheduler": ["name", "warmup_steps", "warmup_ratio", "kwargs"],
        "checkpoint": [
            "dir",
            "storage_options",
            "async_save",
            "retries",
            "save_steps",
            "save_total_limit",
            "resume_from",
            "allow_config_change",
            "best_metric",
            "greater_is_better",
            "load_best_model_at_end",
        ],
        "engine": [
            "name",
            "backend",
            "device",
            "find_unused_parameters",
            "deepspeed_config",
            "fsdp",
        ],
    }


def test_overrides_both_forms_and_precedence(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: {max_steps: 7, per_device_batch_size: 4}\noptim: {lr: 0.5}\n")
    config = load_config(path, ["--train.max_steps", "9", "--optim.lr=1e-4"])
    assert config.train.max_steps == 9  # CLI over file
    assert config.train.per_device_batch_size == 4  # file over default
    assert config.optim.lr == 1e-4
    assert config.train.gradient_accumulation_steps == 1  # default


def test_override_types():
    parsed = parse_overrides(
        ["--run.full_determinism", "true", "--model.kwargs={a: 1}", "--train.num_epochs", "null"]
    )
    assert parsed == {
        "run": {"full_determinism": True},
        "model": {"kwargs": {"a": 1}},
        "train": {"num_epochs": None},
    }


def test_int_accepted_for_float_field():
    config = load_config(None, ["--optim.lr", "1"])
    assert config.optim.lr == 1.0 and isinstance(config.optim.lr, float)


def test_dump_round_trips(tmp_path):
    config = load_config(None, ["--train.max_steps", "3"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


BAD = [
    (["--train.max_stepz", "5"], "train.max_stepz: unknown key; valid keys of [train]: max_steps"),
    (["--nosuch.key", "1"], "--nosuch.key: unknown section; valid: run, model"),
    (["--train.max_steps", "ten"], "train.max_steps: expected an integer, got 'ten'"),
    (["--train.per_device_batch_size", "-1"], "train.per_device_batch_size: must be > 0, got -1"),
    (
        ["--train.gradient_accumulation_steps", "0"],
        "train.gradient_accumulation_steps: must be > 0",
    ),
    (
        ["--optim.name", "adam"],
        "optim.name: unknown value 'adam'; accepted: adamw_torch, "
        "adamw_torch_fused, sgd, adagrad, adafactor",
    ),
    (
        ["--scheduler.name", "cosine_annealing"],
        "scheduler.name: unknown value 'cosine_annealing'; "
        "accepted: linear, cosine, cosine_with_restarts, polynomial, constant, "
        "constant_with_warmup, "
        "inverse_sqrt, reduce_lr_on_plateau",
    ),
    (["--train.max_steps", "null"], "train.max_steps: set train.max_steps or train.num_epochs"),
    (["--run.full_determinism", "maybe"], "run.full_determinism: expected true or false"),
    (["--data.source", "/no/such/file.txt"], "data.source: no such file '/no/such/file.txt'"),
    (
        ["--engine.name", "zero"],
        "engine.name: unknown value 'zero'; accepted: ddp, fsdp, deepspeed",
    ),
    (["--model.n_embd", "65"], "model.n_embd: must be divisible by model.n_head"),
    (["--data.seq_len", "128"], "data.seq_len: must be <= model.block_size (64)"),
    (["--train.max_steps"], "--train.max_steps: missing value"),
    (["stray"], "stray: expected an override of the form --section.key VALUE"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[b[0][0] for b in BAD])
def test_bad_input_names_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    text = str(err.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_missing_file():
    with pytest.raises(ConfigError, match=r"^--config: no such file '/nope.yaml'"):
        load_config("/nope.yaml")


def test_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(bad)
    bad.write_text("train: {max_steps: 5}\ntrainer: {}\n")
    with pytest.raises(ConfigError, match="^trainer: unknown section"):
        load_config(bad)


def test_file_without_steps_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim: {lr: 0.1}\n")
    with pytest.raises(ConfigError, match="set train.max_steps or train.num_epochs"):
        load_config(path)


def test_text_overrides_keep_yaml_words_and_mappings_still_parse():
    parsed = parse_overrides(
        ["--eval.strategy", "no", "--model.kwargs", "{a: 1}", "--checkpoint.best_metric", "null"]
    )
    assert parsed == {
        "eval": {"strategy": "no"},
        "model": {"kwargs": {"a": 1}},
        "checkpoint": {"best_metric": None},
    }


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("group_by_length", True, "nothing to group"),
        ("packing", False, "packed blocks"),
    ],
)
def test_a_token_store_refuses_what_fixed_blocks_cannot_do(key, value, message):
    with pytest.raises(ConfigError, match=f"data.{key}: .*{message}"):
        load_config(None, ["--data.store", "/tmp/any-store", f"--data.{key}", str(value).lower()])


def test_every_field_declares_its_role_for_checkpoints():
    """A field must say whether it defines the trajectory, is neutral to a resume, or was added
    with a value old checkpoints assume (core/config/roles.py): never silently the first."""
    roles = config_roles()
    assert len(roles) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    assert [key for key, role in roles.items() if role is None] == []


def test_a_field_without_a_role_is_found():
    @dataclasses.dataclass
    class Section:
        declared: Annotated[int, NEUTRAL] = 1
        undeclared: int = 2

    assert field_roles(Section) == {"declared": NEUTRAL, "undeclared": None}


def test_the_trajectory_follows_the_declared_roles():
    from core.checkpoint import trajectory

    flat = trajectory(load_config(None), 1, "data", 10)
    roles = config_roles()
    assert {k for k in roles if k in flat} == {k for k, r in roles.items() if r.in_trajectory}
    assert "run.output_dir" not in flat and "checkpoint.save_steps" not in flat
    assert flat["optim.lr"] == load_config(None).optim.lr

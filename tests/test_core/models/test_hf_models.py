"""Hugging Face causal LMs from the config, in one process: weights from safetensors or a seeded
init from config.json, dtype, gradient checkpointing, label smoothing, and the exports
(`Trainer.save_model`, `python -m checkpointing export --hf`) that transformers loads with
logits equal (torch.equal) to the trained model's."""

from __future__ import annotations

import json
import shutil

import datasets
import pytest
import torch

from checkpointing.cli import main as checkpointing_main
from checkpointing.manifest import CheckpointError
from core.config import ConfigError, ModelConfig, load_config
from core.models import build_model
from core.models.hf import resolve_hf
from core.seeding import set_seed
from core.trainer import Trainer
from tests.launch import read_metrics

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def hf_config(assets, run_dir, model="llama", *overrides):
    return load_config(
        None,
        [
            "--run.output_dir",
            str(run_dir),
            "--model.name",
            f"hf:{getattr(assets, model)}",
            "--data.tokenizer",
            f"hf:{assets.tokenizer}",
            "--data.source",
            str(assets.text),
            "--data.seq_len",
            "32",
            "--train.per_device_batch_size",
            "4",
            "--train.max_steps",
            "6",
            "--train.logging_steps",
            "1",
            "--train.progress_bar",
            "never",
            "--checkpoint.save_steps",
            "3",
            *overrides,
        ],
    )


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def sample_ids(assets) -> torch.Tensor:
    tok = AutoTokenizer.from_pretrained(assets.tokenizer)
    return torch.tensor([tok("the model trains on text and a checkpoint keeps")["input_ids"]])


# --- building --------------------------------------------------------------------------------


def test_pretrained_reads_the_safetensors_weights(hf_assets):
    model = build_model(ModelConfig(name=f"hf:{hf_assets.llama}"))
    reference = AutoModelForCausalLM.from_pretrained(hf_assets.llama)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert model.config.use_cache is False  # no KV cache while training


def test_from_config_is_a_seeded_init(hf_assets):
    cfg = ModelConfig(name=f"hf:{hf_assets.llama}", pretrained=False)
    set_seed(7)
    a = build_model(cfg)
    set_seed(7)
    b = build_model(cfg)
    loaded = build_model(ModelConfig(name=f"hf:{hf_assets.llama}"))
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], loaded.state_dict()[w])


def test_dtype_bfloat16(hf_assets):
    model = build_model(ModelConfig(name=f"hf:{hf_assets.gpt2}", dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(hf_assets):
    ids = sample_ids(hf_assets)
    results = []
    for checkpointing in (False, True):
        cfg = ModelConfig(name=f"hf:{hf_assets.llama}", gradient_checkpointing=checkpointing)
        model = build_model(cfg)
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_model_errors_name_the_key(hf_assets, tmp_path):
    def refused(name: str, **kw) -> str:
        with pytest.raises(ConfigError) as e:
            resolve_hf(ModelConfig(name=name, **kw))
        return str(e.value)

    assert refused(f"hf:{tmp_path}/missing").startswith("model.name: no such directory")
    assert "has no config.json" in refused(f"hf:{tmp_path}")
    pickled = tmp_path / "pickled"
    shutil.copytree(hf_assets.llama, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    message = refused(f"hf:{pickled}")
    assert message.startswith("model.pretrained:") and "pytorch_model.bin" in message
    assert "save_pretrained" in message  # how to convert it
    resolve_hf(ModelConfig(name=f"hf:{pickled}", pretrained=False))  # config alone is fine
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "config.json").write_text(
        json.dumps({"model_type": "my-own", "auto_map": {"AutoConfig": "conf.MyConfig"}})
    )
    assert refused(f"hf:{custom}").startswith("model.trust_remote_code:")
    # A hub id that is neither here nor reachable (the tests run offline: nothing downloads).
    assert refused("hf:nobody-here/no-such-model").startswith("model.name: cannot load")


# --- training and exporting ------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(hf_assets, tmp_path_factory):
    """A tiny Llama trained 6 steps in process, and what save_model wrote."""
    run_dir = tmp_path_factory.mktemp("hf_run") / "run"
    trainer = Trainer(args=hf_config(hf_assets, run_dir))
    trainer.train()
    saved = trainer.save_model(run_dir.parent / "saved")
    return trainer, run_dir, saved


def test_save_model_writes_a_directory_transformers_loads(hf_assets, trained):
    trainer, _, saved = trained
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in saved.iterdir()
    }
    loaded = AutoModelForCausalLM.from_pretrained(saved)
    ids = sample_ids(hf_assets)
    assert torch.equal(logits(loaded, ids), logits(trainer.model, ids))
    tok = AutoTokenizer.from_pretrained(saved)
    assert (
        tok("hello")["input_ids"]
        == AutoTokenizer.from_pretrained(hf_assets.tokenizer)("hello")["input_ids"]
    )
    assert loaded.config.use_cache is True  # as a user generating with it expects


def test_export_hf_from_the_checkpoint_equals_the_trained_model(hf_assets, trained, tmp_path):
    trainer, run_dir, _ = trained
    out = tmp_path / "export"
    assert checkpointing_main(["export", str(run_dir / "checkpoint-6"), str(out), "--hf"]) == 0
    ids = sample_ids(hf_assets)
    expected = logits(trainer.model, ids)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out), ids), expected)
    assert AutoTokenizer.from_pretrained(out).chat_template is not None
    sharded = tmp_path / "sharded"
    args = [
        "export",
        str(run_dir / "checkpoint-6"),
        str(sharded),
        "--hf",
        "--max-shard-size",
        "20KB",
    ]
    assert checkpointing_main(args) == 0
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(sharded), ids), expected)


def test_export_hf_of_a_tiny_gpt_checkpoint_says_why_not(tmp_path, capsys):
    run_dir = tmp_path / "run"
    Trainer(
        args=load_config(
            None,
            [
                "--run.output_dir",
                str(run_dir),
                "--train.max_steps",
                "1",
                "--data.max_bytes",
                "5000",
            ],
        )
    ).train()
    assert (
        checkpointing_main(["export", str(run_dir / "checkpoint-1"), str(tmp_path / "o"), "--hf"])
        == 1
    )
    assert "holds no Hugging Face model files" in capsys.readouterr().err


def test_tied_gpt2_round_trips_with_label_smoothing_and_best_model(hf_assets, tmp_path):
    run_dir = tmp_path / "run"
    config = hf_config(
        hf_assets,
        run_dir,
        "gpt2",
        "--train.label_smoothing_factor",
        "0.1",
        "--eval.strategy",
        "steps",
        "--eval.steps",
        "3",
        "--eval.holdout_samples",
        "16",
        "--checkpoint.best_metric",
        "eval_loss",
        "--checkpoint.load_best_model_at_end",
        "true",
    )
    trainer = Trainer(args=config)
    trainer.train()
    assert trainer.model.lm_head.weight is trainer.model.transformer.wte.weight
    out = tmp_path / "export"
    assert checkpointing_main(["export", str(run_dir / "checkpoint-6"), str(out), "--hf"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    best = min((m for m in read_metrics(run_dir) if "eval_loss" in m), key=lambda m: m["eval_loss"])
    exported_best = tmp_path / "best"
    step = best["step"]
    assert (
        checkpointing_main(
            ["export", str(run_dir / f"checkpoint-{step}"), str(exported_best), "--hf"]
        )
        == 0
    )
    ids = sample_ids(hf_assets)
    assert torch.equal(
        logits(AutoModelForCausalLM.from_pretrained(exported_best), ids), logits(trainer.model, ids)
    )


def test_resuming_with_another_tokenizer_is_refused_naming_it(hf_assets, trained, tmp_path):
    _, run_dir, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    tok = AutoTokenizer.from_pretrained(hf_assets.tokenizer)
    tok.chat_template = "{{ messages }}"  # text ids unchanged: another tokenizer all the same
    other = tmp_path / "tok2"
    tok.save_pretrained(other)
    config = hf_config(
        hf_assets, copy, "llama", "--data.tokenizer", f"hf:{other}", "--train.max_steps", "8"
    )
    with pytest.raises(CheckpointError, match="data.tokenizer.fingerprint"):
        Trainer(args=config).train()


def test_hf_files_stay_inside_the_export_and_may_sit_in_folders(trained, tmp_path):
    from checkpointing.hf_export import HFFiles, write_hf_model

    trainer, _, _ = trained
    files = HFFiles(trainer.loop.checkpointer.hf_files.files)
    for bad in ("../escape.txt", "/etc/x", "a/../../b"):
        with pytest.raises(CheckpointError, match="outside the model directory"):
            files.load_state_dict({"files": {bad: "x"}})
    named = {**files.files, "additional_chat_templates/tools.jinja": b"{{ messages }}"}
    tensors = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    out = write_hf_model(tmp_path / "out", tensors, named)
    assert (out / "additional_chat_templates" / "tools.jinja").read_bytes() == b"{{ messages }}"


def test_a_bad_max_shard_size_is_a_usage_error(trained, tmp_path, capsys):
    _, run_dir, _ = trained
    with pytest.raises(SystemExit) as e:
        checkpointing_main(
            [
                "export",
                str(run_dir / "checkpoint-6"),
                str(tmp_path / "o"),
                "--hf",
                "--max-shard-size",
                "5XB",
            ]
        )
    assert e.value.code == 2 and "a size such as 5GB" in capsys.readouterr().err


def test_a_checkpoint_without_the_hf_entry_still_resumes(hf_assets, trained, tmp_path):
    """Checkpoints of a transformers model from before the entry existed (a factory's)."""
    _, run_dir, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    for ckpt in copy.glob("checkpoint-*"):
        manifest = json.loads((ckpt / "manifest.json").read_text())
        del manifest["entries"]["hf"]
        manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("hf.")}
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
        (ckpt / "hf.json").unlink()
    shutil.rmtree(copy / "checkpoint-6")
    trainer = Trainer(args=hf_config(hf_assets, copy))
    assert trainer.train().global_step == 6 and trainer.loop.start_step == 3
    assert (copy / "checkpoint-6" / "hf.json").is_file()

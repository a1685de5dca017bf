"""Corruption, planted pickles, config mismatches, self-checks, retention: one process, fast."""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from checkpointing.manifest import CheckpointCorruptError, CheckpointError, verify
from checkpointing.serialize import save_state
from core.callbacks import TrainerCallback
from core.checkpoint import ResumeMismatchError
from core.config import load_config
from core.loop import DistInfo
from core.run import build_trainer
from tests.checkpoints import file_record, flip_byte, load_entry
from tests.launch import REPO
from tests.launch import SMALL as SMALL_RUN

# One process writes the whole share of the model and the optimizer (checkpointing.balanced).
MODEL, OPTIMIZER = "model/rank-00000", "optimizer/rank-00000"
SMALL = [*SMALL_RUN, "--train.max_steps", "8", "--checkpoint.save_steps", "4"]


def trainer_for(run_dir: Path, *overrides: str, callbacks=None):
    config = load_config(None, [*SMALL, "--run.output_dir", str(run_dir), *overrides])
    return build_trainer(config, DistInfo(), torch.device("cpu"), callbacks=callbacks)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run dir with committed checkpoint-4 and checkpoint-8."""
    run_dir = tmp_path_factory.mktemp("trained")
    trainer_for(run_dir).train()
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    return run_dir


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def resume_step(run_dir: Path, *overrides: str) -> int:
    trainer = trainer_for(run_dir, *overrides)
    trainer.checkpointer.restore()
    return trainer.state.global_step


def rehash(checkpoint: Path, rel: str) -> None:
    """Make the manifest agree with a replaced file (an attacker who can write the dir)."""
    manifest_path = checkpoint / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    data = (checkpoint / rel).read_bytes()
    manifest["files"][rel] = file_record(data)
    manifest_path.write_text(json.dumps(manifest))


def truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


CORRUPTIONS = {
    "truncated": ("model/rank-00000.safetensors", truncate),
    "flipped-byte": ("optimizer/rank-00000.safetensors", flip_byte),
    "missing-file": ("rng/rank-00000.json", Path.unlink),
    "bad-manifest-json": ("manifest.json", lambda p: p.write_text("{not json")),
    "no-manifest": ("manifest.json", Path.unlink),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_newest_falls_back_to_older(run_dir, kind, caplog):
    rel, damage = CORRUPTIONS[kind]
    damage(run_dir / "checkpoint-8" / rel)
    with caplog.at_level(logging.WARNING, logger="checkpointing.manager"):
        assert resume_step(run_dir) == 4
    lines = [r.getMessage() for r in caplog.records if "skipping checkpoint-8" in r.getMessage()]
    assert len(lines) == 1 and rel.split("/")[-1] in lines[0], caplog.text


def test_corrupt_explicit_path_is_an_error(run_dir):
    flip_byte(run_dir / "checkpoint-8" / "model/rank-00000.safetensors")
    with pytest.raises(
        CheckpointCorruptError, match=r"model/rank-00000\.safetensors: blake3 differs"
    ):
        resume_step(run_dir, "--checkpoint.resume_from", str(run_dir / "checkpoint-8"))


def test_explicit_path_resumes_that_checkpoint(run_dir):
    assert resume_step(run_dir, "--checkpoint.resume_from", str(run_dir / "checkpoint-4")) == 4


def as_format_1(checkpoint: Path) -> None:
    """Rewrite a checkpoint as this code wrote it before issue 22: model and optimizer each one
    global file pair written by rank 0 (`model.safetensors` + `model.json`), and a manifest of
    format 1 recording each file as {"size", "sha256"} (hashed here with hashlib)."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for name in ("model", "optimizer"):
        whole = load_entry(checkpoint, name)
        shutil.rmtree(checkpoint / name)
        save_state(checkpoint, name, whole)
        manifest["entries"][name] = "global"
    manifest["format_version"] = 1
    files = [f.relative_to(checkpoint).as_posix() for f in checkpoint.rglob("*") if f.is_file()]
    manifest["files"] = {}
    for rel in sorted(files):
        if rel != "manifest.json":
            data = (checkpoint / rel).read_bytes()
            manifest["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=1))


def loaded_state(run_dir: Path, *overrides: str) -> dict[str, torch.Tensor]:
    trainer = trainer_for(run_dir, *overrides)
    trainer.checkpointer.restore()
    return {
        **{f"model.{k}": v for k, v in trainer.engine.model.state_dict().items()},
        **{
            f"optim.{i}.{k}": v
            for i, s in trainer.engine.optimizer.state_dict()["state"].items()
            for k, v in s.items()
        },
    }


def test_new_manifests_record_blake3(trained):
    manifest = json.loads((trained / "checkpoint-8" / "manifest.json").read_text())
    assert manifest["format_version"] == 3
    for rel, record in manifest["files"].items():
        assert record == file_record((trained / "checkpoint-8" / rel).read_bytes()), rel


def test_a_checkpoint_of_the_old_layout_verifies_and_resumes_exactly(trained, run_dir):
    expected = loaded_state(trained, "--checkpoint.resume_from", str(trained / "checkpoint-8"))
    as_format_1(run_dir / "checkpoint-8")
    assert verify(run_dir / "checkpoint-8").format_version == 1
    got = loaded_state(run_dir)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert (run_dir / "checkpoint-8" / "model.safetensors").is_file()
    flip_byte(run_dir / "checkpoint-8" / "optimizer.safetensors")
    with pytest.raises(CheckpointCorruptError, match=r"optimizer\.safetensors: sha256 differs"):
        verify(run_dir / "checkpoint-8")
    assert resume_step(run_dir) == 4  # the older checkpoint, of format 3


HOSTILE_RECORDS = {
    "unknown-algorithm": {"size": 1, "hash": {"algorithm": "md5", "digest": "0" * 32}},
    "digest-not-hex": {"size": 1, "hash": {"algorithm": "blake3", "digest": "../" * 21 + "x"}},
    "extra-key": {"size": 1, "hash": {"algorithm": "blake3", "digest": "0" * 64, "key": 1}},
    "negative-size": {"size": -1, "hash": {"algorithm": "blake3", "digest": "0" * 64}},
    "no-hash": {"size": 1},
    "not-a-record": [1, 2],
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_RECORDS))
def test_a_manifest_naming_no_known_hash_is_refused_before_any_read(run_dir, kind, caplog):
    """A manifest that records a file in a way this code cannot check is never trusted."""
    ckpt = run_dir / "checkpoint-8"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["model/rank-00000.safetensors"] = HOSTILE_RECORDS[kind]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointCorruptError, match=r"unreadable manifest \(model/rank-00000\.safetensors: "
    ):
        verify(ckpt)
    with caplog.at_level(logging.WARNING, logger="checkpointing.manager"):
        assert resume_step(run_dir) == 4


def test_a_manifest_of_a_newer_format_is_refused(run_dir):
    ckpt = run_dir / "checkpoint-8"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["format_version"] = 4
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match="format version 4, this code reads 1, 2, 3"):
        verify(ckpt)


class PlantedPayload:
    """Unpickling this would create a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize(
    "rel", ["optimizer/rank-00000.safetensors", "model/rank-00000.safetensors", "train_state.json"]
)
def test_planted_pickle_is_refused_and_never_runs(run_dir, tmp_path, rel):
    marker = tmp_path / "pwned"
    ckpt = run_dir / "checkpoint-8"
    (ckpt / rel).write_bytes(pickle.dumps(PlantedPayload(marker)))
    rehash(ckpt, rel)
    verify(ckpt)  # the checksums agree: only the format protects us now
    with pytest.raises(CheckpointCorruptError, match=f"refusing to load: .*{rel}"):
        resume_step(run_dir)
    assert not marker.exists()


def test_no_pickle_loader_in_checkpointing():
    """No call in checkpointing/ can unpickle code: no pickle.load(s), and every torch.load
    (DeepSpeed's shards only) passes weights_only=True."""
    root = REPO / "checkpointing"
    torch_loads = 0
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            name = f"{owner.id if isinstance(owner, ast.Name) else '?'}.{node.func.attr}"
            assert name not in ("pickle.load", "pickle.loads"), f"{path.name} calls {name}"
            if name == "torch.load":
                torch_loads += 1
                flags = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
                assert flags.get("weights_only") is True, f"{path.name}:{node.lineno}"
    assert torch_loads >= 1  # the DeepSpeed loader is there, and was checked


@pytest.mark.parametrize(
    ("override", "field"),
    [
        (("--run.seed", "1"), "run.seed"),
        (("--train.per_device_batch_size", "4"), "train.per_device_batch_size"),
        (("--model.n_layer", "3"), "model.n_layer"),
        (("--data.max_bytes", "30000"), "dataset"),
    ],
)
def test_trajectory_change_is_refused_naming_fields(run_dir, override, field):
    with pytest.raises(CheckpointError, match=f"differs in fields .*{field}") as err:
        resume_step(run_dir, *override)
    assert "allow_config_change" in str(err.value)


def test_trajectory_change_allowed_explicitly(run_dir):
    # logging_steps never matters; lr does, and is allowed here on purpose
    assert resume_step(run_dir, "--train.logging_steps", "3") == 8
    assert (
        resume_step(run_dir, "--optim.lr", "0.01", "--checkpoint.allow_config_change", "true") == 8
    )


def test_fresh_start_refused_where_checkpoints_exist(run_dir):
    with pytest.raises(CheckpointError, match="run.overwrite"):
        resume_step(run_dir, "--checkpoint.resume_from", "none")
    assert resume_step(run_dir, "--checkpoint.resume_from", "none", "--run.overwrite", "true") == 0
    assert not list(run_dir.glob("checkpoint-*"))


def test_self_check_catches_rng_consumed_after_restore(run_dir):
    class ConsumesRng(TrainerCallback):
        def on_train_begin(self, config, state, control):
            torch.rand(1)

    trainer = trainer_for(
        run_dir,
        "--train.max_steps",
        "12",
        "--checkpoint.allow_config_change",
        "true",
        callbacks=[ConsumesRng()],
    )
    with pytest.raises(ResumeMismatchError, match="RNG state .* differs"):
        trainer.train()


def test_self_check_catches_a_wrong_learning_rate(run_dir):
    ckpt = run_dir / "checkpoint-8"
    structure = json.loads((ckpt / "optimizer/rank-00000.json").read_text())
    groups = structure["param_groups"]
    for g in groups:
        g["lr"] = g["lr"] * 2
    (ckpt / "optimizer/rank-00000.json").write_text(json.dumps(structure))
    rehash(ckpt, "optimizer/rank-00000.json")
    with pytest.raises(ResumeMismatchError, match="learning rate"):
        resume_step(run_dir)


def test_leftovers_are_never_taken_for_checkpoints(run_dir):
    tmp = run_dir / ".tmp-checkpoint-12"
    shutil.copytree(run_dir / "checkpoint-8", tmp)  # even a complete-looking one
    (run_dir / "checkpoint-99").mkdir()  # a directory with no manifest
    assert resume_step(run_dir) == 8
    assert not tmp.exists()


def test_save_total_limit_keeps_newest(tmp_path):
    trainer_for(
        tmp_path, "--checkpoint.save_steps", "2", "--checkpoint.save_total_limit", "2"
    ).train()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("checkpoint", "."))) == [
        "checkpoint-6",
        "checkpoint-8",
    ]


def test_final_checkpoint_always_written(tmp_path):
    trainer_for(tmp_path, "--train.max_steps", "5", "--checkpoint.save_steps", "0").train()
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-5"]
    assert verify(tmp_path / "checkpoint-5").step == 5

"""python -m checkpointing list / verify / export."""

from __future__ import annotations

import subprocess
import sys

import torch
from safetensors.torch import load_file

from core.config import load_config
from core.loop import DistInfo
from core.models.tiny_gpt import TinyGPT
from core.run import build_trainer
from tests.launch import REPO, child_env


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "checkpointing", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_list_verify_export(tmp_path):
    config = load_config(
        None,
        [
            "--run.output_dir",
            str(tmp_path),
            "--train.max_steps",
            "6",
            "--checkpoint.save_steps",
            "2",
            "--train.progress_bar",
            "never",
            "--data.max_bytes",
            "20000",
        ],
    )
    trainer = build_trainer(config, DistInfo(), torch.device("cpu"))
    trainer.train()
    live = {k: v.clone() for k, v in trainer.engine.model.state_dict().items()}

    damaged = tmp_path / "checkpoint-4" / "model" / "rank-00000.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    (tmp_path / "checkpoint-2" / "manifest.json").unlink()
    (tmp_path / ".tmp-checkpoint-8").mkdir()

    out = cli("list", str(tmp_path))
    assert out.returncode == 0, out.stderr
    status = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:]}
    assert status == {
        "checkpoint-6": "committed",
        "checkpoint-4": "corrupt",
        "checkpoint-2": "incomplete",
        ".tmp-checkpoint-8": "incomplete",
    }

    assert cli("verify", str(tmp_path / "checkpoint-6")).returncode == 0
    bad = cli("verify", str(tmp_path / "checkpoint-4"))
    assert bad.returncode == 1 and "rank-00000.safetensors" in bad.stderr

    target = tmp_path / "model.safetensors"
    assert cli("export", str(tmp_path / "checkpoint-6"), str(target)).returncode == 0
    exported = load_file(target)
    assert exported.keys() == live.keys()  # tied weights under both names
    for name, tensor in live.items():
        assert torch.equal(exported[name], tensor), name
    TinyGPT().load_state_dict(exported, strict=True)
    assert cli("export", str(tmp_path / "checkpoint-4"), str(target)).returncode == 1

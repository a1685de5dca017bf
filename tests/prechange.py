"""The checkpoint that guards the redesign of a run's path (issue 31): written once, by the code
before that change (commit bca496a), and kept under tests/fixtures/prechange/. Whatever the path
of a run becomes, this checkpoint must resume bit-identically (tests/test_prechange.py).

    python -m tests.prechange   # rewrites the fixture: only ever with the pre-change code

A tiny single-process run with dropout, gradient accumulation and a warmup-then-cosine schedule,
interrupted by a checkpoint at step 3 of 6, on a small corpus kept beside it; the fixture keeps
checkpoint-3, the metrics and the final checkpoint of the uninterrupted run (what torch 2.13.0 on
CPU computed then).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "prechange"
STEP = 3
OVERRIDES = [
    "--model.n_layer", "1",
    "--model.n_embd", "16",
    "--model.block_size", "16",
    "--data.seq_len", "16",
    "--data.source", "corpus.txt",  # relative: the test runs in a copy of the fixture
    "--data.format", "text",
    "--train.max_steps", "6",
    "--train.per_device_batch_size", "4",
    "--train.gradient_accumulation_steps", "2",
    "--train.logging_steps", "1",
    "--scheduler.warmup_steps", "2",
    "--checkpoint.save_steps", str(STEP),
]  # fmt: skip


def enter_copy(tmp_path: Path, monkeypatch) -> Path:
    """A copy of the fixture at `tmp_path`, made the working directory (its corpus is named
    relatively)."""
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def began_at():
    """A callback recording the step train() began at (in `.step`)."""
    from core.callbacks import TrainerCallback

    class BeganAt(TrainerCallback):
        step: int | None = None

        def on_train_begin(self, config, state, control):
            self.step = state.global_step

    return BeganAt()


def config(output_dir: Path):
    """The run's config, writing into `output_dir`."""
    from core.config import load_config

    return load_config(None, [*OVERRIDES, "--run.output_dir", str(output_dir)])


def words(n: int) -> str:
    """About `n` bytes of made-up lines from a fixed seed (no licence, no download)."""
    rng = random.Random(0)
    vocab = ["".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(1, 8)))
             for _ in range(400)]  # fmt: skip
    lines, size = [], 0
    while size < n:
        line = " ".join(rng.choice(vocab) for _ in range(rng.randint(4, 14))) + ".\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)


def main() -> None:
    from checkpointing.serialize import load_state
    from core.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        corpus = FIXTURE / "corpus.txt"
        if not corpus.is_file():
            FIXTURE.mkdir(parents=True, exist_ok=True)
            corpus.write_text(words(12_000))
        os.chdir(tmp)
        shutil.copy(corpus, "corpus.txt")
        run = Path(tmp) / "run"
        Trainer(args=config(run)).train()
        for old in FIXTURE.iterdir():
            if old.name != "corpus.txt":
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        shutil.copytree(run / f"checkpoint-{STEP}", FIXTURE / f"checkpoint-{STEP}")
        lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
        (FIXTURE / "metrics.jsonl").write_text("".join(lines))
        final = run / "checkpoint-6"
        shutil.copytree(final, FIXTURE / "final")
        print(load_state(final, "train_state")["global_step"], file=sys.stderr)


if __name__ == "__main__":
    main()

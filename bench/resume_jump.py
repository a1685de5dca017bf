"""Resume jump cost: launch-to-first-resumed-step at step 10 vs step 10,000 of one long epoch.

One in-process run of a very small model saves checkpoints at steps 10 and 10,000 of its first
epoch. Each is copied into a run dir of its own; `python -m launcher` resumes from it and is
timed from launch until it logs its first resumed step (then stopped). Repetitions interleave;
medians; the ratio should be <= 1.1 (the sampler jumps, it does not iterate skipped batches).

    python bench/resume_jump.py [--reps 5] [--far 10000]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import alternating, detail, figure, resume_copy  # noqa: E402
from core.callbacks import TrainerCallback  # noqa: E402
from core.config import load_config  # noqa: E402
from core.loop import DistInfo  # noqa: E402
from core.run import build_trainer  # noqa: E402

FAR = 10_000
NEAR = 10
# One epoch holds 189k samples of the whole stdlib at seq_len 64: step 10,000 is mid-epoch.
OVERRIDES = [
    "--model.n_layer",
    "1",
    "--model.n_embd",
    "16",
    "--model.n_head",
    "1",
    "--data.max_bytes",
    "0",
    "--train.per_device_batch_size",
    "1",
    "--train.logging_steps",
    "1000",
    "--train.progress_bar",
    "never",
    "--checkpoint.save_steps",
    "0",
]


class SaveAt(TrainerCallback):
    def __init__(self, far: int) -> None:
        self.far = far

    def on_step_end(self, config, state, control) -> None:
        control.should_save = state.global_step in (NEAR, self.far)
        control.should_training_stop = state.global_step >= self.far


def make_checkpoints(root: Path, far: int) -> None:
    config = load_config(
        None,
        [*OVERRIDES, "--train.max_steps", str(2 * far), "--run.output_dir", str(root / "long")],
    )
    trainer = build_trainer(config, DistInfo(), torch.device("cpu"), callbacks=[SaveAt(far)])
    trainer.train()
    assert trainer.state.epoch == 0, "the far checkpoint must be mid-epoch"


def time_to_first_step(run_dir: Path, step: int, far: int) -> float:
    metrics = run_dir / "metrics.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        *OVERRIDES,
        "--train.max_steps",
        str(2 * far),
        "--run.output_dir",
        str(run_dir),
        "--train.logging_steps",
        "1",
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while True:
            if metrics.exists() and f'"step": {step + 1},' in metrics.read_text():
                return time.perf_counter() - t0
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode()[-2000:])
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--far", type=int, default=FAR)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        make_checkpoints(root, args.far)
        detail("resume_jump_setup_s", value=time.perf_counter() - t0)
        times: dict[int, list[float]] = {NEAR: [], args.far: []}
        for rep in range(args.reps):
            for step in alternating(rep, NEAR, args.far):
                with resume_copy(root, step, rep) as run_dir:
                    times[step].append(time_to_first_step(run_dir, step, args.far))
    near, far = statistics.median(times[NEAR]), statistics.median(times[args.far])
    figure(
        "resume_jump",
        far,
        "s launch to first resumed step",
        ratio_to=f"the same at step {NEAR}",
        ratio=far / near,
        config={"near_step": NEAR, "far_step": args.far, "reps": args.reps},
        near_s=near,
        far_all=times[args.far],
        near_all=times[NEAR],
    )


if __name__ == "__main__":
    main()

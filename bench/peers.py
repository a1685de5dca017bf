"""Against peers: the tiny config trained by `python -m launcher`, by the Hugging Face Trainer and
by a plain accelerate loop, side by side in one run; and resuming at the same step.

All three train the same model (configs/tiny.yaml's TinyGPT after the same seeding), on the same
dataset with the same collate and batch size, with the same optimizer object kind (our AdamW
parameter groups) and the same cosine LambdaLR, clipping at 1.0, and a loss sync every step
(the launcher and the Trainer log every step; the accelerate loop calls `.item()`). Each run is
a fresh subprocess; the sides alternate and rotate `--reps` times; steps/s is over the steps
after the first 10%, medians. Figures: `vs_trainer` and `vs_accelerate` (ours / theirs).

Resume: each side trains to step `--resume-at` of a `2 x resume-at` step run and checkpoints;
then a fresh process resumes from that checkpoint, timed from launch to its first resumed step
(ours: `checkpoint.resume_from latest`; the Trainer: `train(resume_from_checkpoint=...)`, which
skips the consumed batches of its epoch). Figure `resume_vs_trainer` (ours / theirs, seconds).

Needs `pip install .[bench]` (transformers, accelerate); without them it prints one line saying
so and exits 0.

    .venv/bin/python bench/peers.py [--steps 300] [--reps 3] [--resume-at 300]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import detail, figure  # noqa: E402
from bench.loop_overhead import CONFIG, child_env, run_side, steady_rates  # noqa: E402

WARMUP = 0.1


def _build(total_steps: int, overrides: Sequence[str] = ()):
    """Model, dataset, optimizer and LambdaLR of the tiny config (with launcher-style
    `overrides`, `--section.key value`), after its seeding."""
    import torch

    from core.config import load_config
    from core.data import build_dataset
    from core.models import build_model
    from core.optim import build_optimizer
    from core.schedules import build_schedule
    from core.seeding import set_seed

    cfg = load_config(REPO / CONFIG, list(overrides))
    set_seed(cfg.run.seed)
    dataset = build_dataset(cfg.data)
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"))
    sc = cfg.scheduler
    schedule = build_schedule(optimizer, sc.name, total_steps, sc.warmup_steps, 0.0, {})
    return cfg, model, dataset, optimizer, schedule.scheduler


def trainer_side(
    total: int,
    out: Path,
    work: Path,
    stop_at: int | None,
    resume: bool,
    overrides: Sequence[str] = (),
    same_order: bool = False,
) -> None:
    """The Hugging Face Trainer on the same parts; writes {"step_time_s", "losses"} to out.

    `same_order`: the Trainer takes its samples in the launcher's order (its sampler's first
    epoch) rather than its own RandomSampler's, so that the first losses can be compared."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from core.data import collate
    from core.data.sampler import ResumableDistributedSampler

    cfg, model, dataset, optimizer, scheduler = _build(total, overrides)
    bs = cfg.train.per_device_batch_size

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now
            if resume:  # the first resumed step: report and stop at once
                out.write_text(json.dumps({"first_step": state.global_step}))
                os._exit(0)
            if stop_at is not None and state.global_step >= stop_at:
                control.should_save = True
                control.should_training_stop = True
            return control

    class TiedWeightsTrainer(Trainer):
        """The Trainer saves a plain nn.Module with safetensors' save_file, which refuses
        TinyGPT's tied embedding / head; save_model writes the shared tensor once."""

        def _save(self, output_dir: str | None = None, state_dict=None) -> None:
            from safetensors.torch import save_model

            os.makedirs(output_dir, exist_ok=True)
            save_model(self.model, os.path.join(output_dir, "model.safetensors"), {"format": "pt"})

        def _get_train_sampler(self, train_dataset=None):
            if not same_order:
                return super()._get_train_sampler(train_dataset)
            ours = ResumableDistributedSampler(len(dataset), 1, 0, bs, cfg.run.seed)
            return ours.epoch_order().tolist()

    # Read on load when keys are missing (the tied head, written once); the tie itself holds.
    model._keys_to_ignore_on_save = None
    timer = Timer()
    args = TrainingArguments(
        output_dir=str(work),
        per_device_train_batch_size=bs,
        max_steps=total,
        max_grad_norm=cfg.train.max_grad_norm,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=cfg.run.seed,
        dataloader_drop_last=True,
        use_cpu=not torch.cuda.is_available(),  # the launcher's choice (engine.device auto)
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = TiedWeightsTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=collate,
        optimizers=(optimizer, scheduler),
        callbacks=[timer],
    )
    checkpoint = None
    if resume:
        checkpoint = str(max(work.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])))
    trainer.train(resume_from_checkpoint=checkpoint)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out.write_text(json.dumps({"step_time_s": timer.times, "losses": losses}))


def accelerate_side(total: int, out: Path, overrides: Sequence[str] = ()) -> None:
    """A plain accelerate loop on the same parts; writes {"step_time_s", "losses"} to out."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, RandomSampler

    from core.data import collate

    cfg, model, dataset, optimizer, scheduler = _build(total, overrides)
    g = torch.Generator()
    g.manual_seed(cfg.run.seed)
    loader = DataLoader(
        dataset,
        batch_size=cfg.train.per_device_batch_size,
        sampler=RandomSampler(dataset, generator=g),
        collate_fn=collate,
        drop_last=True,
    )
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    losses, times, last = [], [], time.perf_counter()
    step = 0
    while step < total:
        for batch in loader:
            loss = model(**batch)["loss"]
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            now = time.perf_counter()
            times.append(now - last)
            last = now
            step += 1
            if step == total:
                break
    out.write_text(json.dumps({"step_time_s": times, "losses": losses}))


def _worker(side: str, total: int, out: Path, work: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--worker",
        side,
        "--steps",
        str(total),
        "--out",
        str(out),
        "--work",
        str(work),
        *extra,
    ]


def peer_run(
    side: str, steps: int, threads: int, overrides: Sequence[str] = (), same_order: bool = False
) -> tuple[list[float], list[float]]:
    """(loss per step, seconds per step) of one fresh run of a peer; `overrides` and
    `same_order` as for trainer_side (the accelerate loop takes no `same_order`)."""
    with tempfile.TemporaryDirectory(prefix=f"peers_{side}_") as tmp:
        out = Path(tmp, "out.json")
        extra = ["--overrides", json.dumps(list(overrides))]
        cmd = _worker(side, steps, out, Path(tmp, "work"), *extra)
        if same_order:
            cmd.append("--same-order")
        proc = subprocess.run(cmd, cwd=REPO, env=child_env(threads), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{side} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        data = json.loads(out.read_text())
        return data["losses"], data["step_time_s"]


def throughput(steps: int, reps: int, threads: int) -> None:
    sides = ["ours", "trainer", "accelerate"]
    rates: dict[str, list[float]] = {s: [] for s in sides}
    for rep in range(reps):
        for side in sides[rep % 3 :] + sides[: rep % 3]:  # rotate: no side always first
            if side == "ours":
                times = run_side("ours", steps, threads)[1]
            else:
                times = peer_run(side, steps, threads)[1]
            rates[side].append(steady_rates(times, WARMUP)[0])
            detail("peers_run", side=side, rep=rep, steps_per_s=rates[side][-1])
    ours = statistics.median(rates["ours"])
    config = {"model": "tiny-gpt (configs/tiny.yaml)", "steps": steps, "reps": reps}
    for peer, what in (("trainer", "transformers.Trainer"), ("accelerate", "accelerate loop")):
        theirs = statistics.median(rates[peer])
        figure(
            f"vs_{peer}",
            ours,
            "steps/s",
            ratio_to=f"{what}, same model, data, optimizer, schedule and batch",
            ratio=ours / theirs,
            config=config,
            theirs_steps_per_s=theirs,
            ours_all=rates["ours"],
            theirs_all=rates[peer],
        )


def _ours_cmd(run_dir: Path, total: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "launcher",
        "--config",
        CONFIG,
        "--run.output_dir",
        str(run_dir),
        "--train.max_steps",
        str(total),
        "--train.logging_steps",
        "1",
        "--train.progress_bar",
        "never",
    ]


def _until(proc: subprocess.Popen, done, t0: float) -> float:
    try:
        while not done():
            if proc.poll() is not None and not done():
                raise RuntimeError(f"exited {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
            time.sleep(0.002)
        return time.perf_counter() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def resume(at: int, reps: int, threads: int) -> None:
    total = 2 * at
    with tempfile.TemporaryDirectory(prefix="peers_resume_") as tmp:
        root = Path(tmp)
        # Checkpoints at step `at` of a `total`-step run, one per side.
        ours_src = root / "ours"
        proc = subprocess.run(
            [*_ours_cmd(ours_src, total), "--checkpoint.save_steps", str(at)],
            cwd=REPO,
            env=child_env(threads),
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        theirs_src = root / "trainer"
        cmd = _worker("trainer", total, root / "t.json", theirs_src, "--stop-at", str(at))
        proc = subprocess.run(cmd, cwd=REPO, env=child_env(threads), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        times: dict[str, list[float]] = {"ours": [], "trainer": []}
        for rep in range(reps):
            for side in ("ours", "trainer") if rep % 2 == 0 else ("trainer", "ours"):
                run_dir = root / f"{side}-{rep}"
                name = f"checkpoint-{at}"
                shutil.copytree((ours_src if side == "ours" else theirs_src) / name, run_dir / name)
                t0 = time.perf_counter()
                if side == "ours":
                    cmd = _ours_cmd(run_dir, total)
                    metrics = run_dir / "metrics.jsonl"

                    def done(metrics=metrics):
                        return metrics.exists() and f'"step": {at + 1},' in metrics.read_text()
                else:
                    marker = root / f"marker-{rep}.json"
                    cmd = _worker("trainer", total, marker, run_dir, "--resume")

                    def done(marker=marker):
                        return marker.exists()

                proc = subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=child_env(threads),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                times[side].append(_until(proc, done, t0))
                shutil.rmtree(run_dir)
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["trainer"])
    figure(
        "resume_vs_trainer",
        ours,
        "s launch to first resumed step",
        ratio_to="transformers.Trainer resuming at the same step, same data",
        ratio=ours / theirs,
        config={"resume_at": at, "total_steps": total, "reps": reps},
        theirs_s=theirs,
        ours_all=times["ours"],
        theirs_all=times["trainer"],
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--resume-at", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", choices=("trainer", "accelerate"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stop-at", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overrides", type=json.loads, default=[], help=argparse.SUPPRESS)
    parser.add_argument("--same-order", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "trainer":
        trainer_side(
            args.steps,
            args.out,
            args.work,
            args.stop_at,
            args.resume,
            args.overrides,
            args.same_order,
        )
        return
    if args.worker == "accelerate":
        accelerate_side(args.steps, args.out, args.overrides)
        return
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        detail("peers_skipped", why=f"{', '.join(missing)} not installed: pip install .[bench]")
        return
    throughput(args.steps, args.reps, args.threads)
    resume(args.resume_at, args.reps, args.threads)


if __name__ == "__main__":
    main()

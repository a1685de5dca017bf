"""`python -m launcher plot RUN_DIR [RUN_DIR ...] -o loss.png`: loss and learning rate by step.

Two panels sharing the step axis; one colour per run, labelled with its directory. Dotted
vertical lines mark committed checkpoints, dashed ones the steps where an attempt resumed
(labelled with the cause), both from history.jsonl. Drawn with the Agg canvas directly (no
pyplot, no display, no global backend switch).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from core.reporting.history import AttemptStart, CheckpointCommit, read_history, read_jsonl
from core.reporting.metrics import METRICS_FILE
from launcher.status import ReportError


def _training_records(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ReportError(f"{run_dir}: no {METRICS_FILE} (run.report_to must include jsonl)")
    try:
        records = [r for r in read_jsonl(path) if "loss" in r]
    except ValueError as e:
        raise ReportError(str(e)) from e
    if not records:
        raise ReportError(f"{path}: no training step logged yet")
    return records


def plot_runs(run_dirs: list[Path], output: Path) -> None:
    """Write the figure for `run_dirs` to `output` (the format follows the suffix)."""
    fig = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_lr = fig.subplots(2, 1, sharex=True)
    handles: list[Line2D] = []
    for i, run_dir in enumerate(run_dirs):
        color = f"C{i % 10}"
        records = _training_records(run_dir)
        try:
            history = read_history(run_dir)
        except ValueError as e:
            raise ReportError(str(e)) from e
        steps = [r["step"] for r in records]
        # Later runs thinner and on top, so identical curves still show both colours.
        width = max(0.8, 2.4 - 0.8 * i)
        (line,) = ax_loss.plot(
            steps, [r["loss"] for r in records], color=color, lw=width, label=str(run_dir)
        )
        ax_lr.plot(steps, [r["lr"] for r in records], color=color, lw=width)
        handles.append(line)
        commits = sorted({r.step for r in history if isinstance(r, CheckpointCommit)})
        resumes = [r for r in history if isinstance(r, AttemptStart) and r.attempt > 1]
        for ax in (ax_loss, ax_lr):
            for step in commits:
                ax.axvline(step, color=color, linestyle=":", linewidth=0.8, alpha=0.7)
            for r in resumes:
                ax.axvline(r.step, color=color, linestyle="--", linewidth=1.6)
        for r in resumes:
            ax_loss.annotate(
                f"resumed ({r.cause})",
                xy=(r.step, 0.98),
                xycoords=("data", "axes fraction"),
                xytext=(-3, 0),
                textcoords="offset points",
                rotation=90,
                va="top",
                ha="right",
                fontsize=8,
                color=color,
            )
    handles += [
        Line2D([], [], color="grey", linestyle=":", linewidth=0.8, label="checkpoint committed"),
        Line2D([], [], color="grey", linestyle="--", linewidth=1.6, label="resumed"),
    ]
    ax_loss.legend(handles=handles, fontsize=8, loc="upper right")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("training loss and learning rate by step")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    for ax in (ax_loss, ax_lr):
        ax.grid(alpha=0.3)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)


def plot_main(run_dirs: list[Path], output: Path) -> int:
    for run_dir in run_dirs:
        if not run_dir.is_dir():
            raise ReportError(f"{run_dir}: no such run directory")
    plot_runs(run_dirs, output)
    print(f"wrote {output} ({len(run_dirs)} run(s))")
    return 0

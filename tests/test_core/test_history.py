"""Unit tests of the resume history (cause rules, records, torn lines), report_to validation,
the end record of an attempt that raised, and log lines above the progress bar."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from core.callbacks import TrainerCallback, TrainerControl
from core.config import ConfigError, load_config
from core.loop import DistInfo
from core.reporting.history import (
    HISTORY_FILE,
    AttemptEnd,
    AttemptStart,
    CheckpointCommit,
    RunHistory,
    read_history,
    resume_cause,
)
from core.run import build_trainer
from core.state import TrainState
from core.trainer import Trainer
from tests.launch import SMALL


def start(attempt: int = 1) -> AttemptStart:
    return AttemptStart(0.0, attempt, 0, None, 2, "fresh", 10)


def end(reason: str) -> AttemptEnd:
    return AttemptEnd(1.0, 5, reason)


COMMIT = CheckpointCommit(0.5, 4, "checkpoint-4", 0.1)
CAUSES = [
    ([], 0, "fresh"),
    ([start(), COMMIT, end("preempted")], 0, "preempted"),
    ([start(), COMMIT], 0, "crashed"),  # SIGKILL / node loss: no end record
    ([start(), end("error")], 0, "crashed"),
    ([start(), end("done")], 0, "restarted"),  # relaunched after a clean end
    ([start(), end("preempted"), start(2)], 0, "crashed"),  # only the last attempt counts
    ([start(), COMMIT], 1, "restarted"),  # torchrun restarted the workers
    ([], 2, "restarted"),
]


@pytest.mark.parametrize(("previous", "restart_count", "cause"), CAUSES)
def test_resume_cause_rules(previous, restart_count, cause):
    assert resume_cause(previous, restart_count) == cause


@pytest.mark.parametrize("value", ["[wandb]", "[jsonl, tensorbord]"])
def test_bad_report_to_names_the_key_and_the_accepted_values(value):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--run.report_to", value])
    text = str(err.value)
    assert text.startswith("run.report_to: unknown value ") and "\n" not in text
    assert text.endswith("accepted: jsonl, tensorboard")


def test_report_to_default_and_empty():
    assert load_config(None).run.report_to == ["jsonl"]
    assert load_config(None, ["--run.report_to", "[]"]).run.report_to == []


def begin(history: RunHistory, config, step: int = 0) -> None:
    history.on_train_begin(config, TrainState(global_step=step), TrainerControl())


def test_records_round_trip_and_one_end_per_attempt(tmp_path):
    config = load_config(None, ["--run.output_dir", str(tmp_path)])
    h = RunHistory(tmp_path, world_size=2, total_steps=10, restart_count=0)
    h.end(0, "done")  # never started: nothing to end
    begin(h, config)
    h.on_save(
        config,
        TrainState(global_step=4),
        TrainerControl(),
        str(tmp_path / "checkpoint-4"),
        seconds=0.25,
    )
    h.end(4, "preempted")
    h.end(4, "done")  # a second end of the same attempt changes nothing
    begin(RunHistory(tmp_path, 2, 10), config, step=4)
    records = read_history(tmp_path)
    assert [type(r).__name__ for r in records] == [
        "AttemptStart",
        "CheckpointCommit",
        "AttemptEnd",
        "AttemptStart",
    ]
    assert records[1] == CheckpointCommit(records[1].time, 4, "checkpoint-4", 0.25)
    assert (records[2].reason, records[3].cause, records[3].attempt) == (
        "preempted",
        "preempted",
        2,
    )
    assert records[3].resumed_from == "checkpoint-4"
    with pytest.raises(ValueError, match="unknown end reason"):
        h.end(4, "oops")


def test_a_torn_last_line_is_cut_before_the_next_attempt(tmp_path):
    config = load_config(None, ["--run.output_dir", str(tmp_path)])
    begin(RunHistory(tmp_path, 1, 10), config)
    path = tmp_path / HISTORY_FILE
    with path.open("a") as f:
        f.write('{"event": "checkpoint", "ti')  # a kill in the middle of a write
    assert len(read_history(tmp_path)) == 1  # readers skip it
    begin(RunHistory(tmp_path, 1, 10), config)
    assert [r.cause for r in read_history(tmp_path)] == ["fresh", "crashed"]
    assert path.read_text().count("\n") == 2


def test_an_unreadable_history_warns_and_training_goes_on(tmp_path, caplog):
    config = load_config(None, ["--run.output_dir", str(tmp_path)])
    (tmp_path / HISTORY_FILE).write_text("not json\n")
    with caplog.at_level(logging.WARNING):
        begin(RunHistory(tmp_path, 1, 10), config)
    assert "history.jsonl:1: not a JSON line" in caplog.text
    assert (tmp_path / HISTORY_FILE).read_text().splitlines()[1].startswith('{"event": "start"')
    assert '"cause": "unknown"' in (tmp_path / HISTORY_FILE).read_text()


class FailAt(TrainerCallback):
    def on_step_end(self, config, state, control, **kwargs):
        if state.global_step == 3:
            raise RuntimeError("boom at step 3")


def test_an_attempt_that_raises_records_an_error_end(tmp_path):
    config = load_config(
        None, [*SMALL, "--run.output_dir", str(tmp_path), "--train.max_steps", "6"]
    )
    with pytest.raises(RuntimeError, match="boom"):
        Trainer(args=config, callbacks=[FailAt()]).train()
    *_, last = read_history(tmp_path)
    assert last == AttemptEnd(last.time, 3, "error", "RuntimeError: boom at step 3")
    result = Trainer(args=config).train()  # relaunched: no checkpoint yet, so from step 0
    assert result.global_step == 6
    starts = [r for r in read_history(tmp_path) if isinstance(r, AttemptStart)]
    assert [(s.cause, s.step) for s in starts] == [("fresh", 0), ("crashed", 0)]
    assert read_history(tmp_path)[-1].reason == "done"


def test_log_records_print_above_the_progress_bar(tmp_path, capsys):
    handler = logging.StreamHandler(sys.stderr)  # the captured stderr, as the launcher's is
    handler.setFormatter(logging.Formatter("[log] %(message)s"))
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    try:
        config = load_config(
            None,
            [
                *SMALL,
                "--run.output_dir",
                str(tmp_path),
                "--train.max_steps",
                "6",
                "--checkpoint.save_steps",
                "2",
                "--train.progress_bar",
                "always",
            ],
        )
        build_trainer(config, DistInfo(), torch.device("cpu")).train()
        assert root.handlers == [handler]  # the redirection ended with training
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    err = capsys.readouterr().err
    saved_lines = [line for line in err.split("\n") if "saved checkpoint-" in line]
    assert len(saved_lines) == 3, err
    for line in saved_lines:
        # tqdm.write clears the bar (\r ... \r) and prints the record at the start of the line;
        # without the redirection the record follows the bar's text ("50%|#####  | 3/6 ...").
        assert line.rsplit("\r", 1)[-1].startswith("[log] saved checkpoint-"), repr(line)
    assert "6/6" in err and "samples/s=" in err

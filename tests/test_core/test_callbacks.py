"""Callback events, the handler, early stopping (and its resume), memory and speed metrics."""

from __future__ import annotations

import inspect
import json
import math
import time

import pytest
import torch

from core.callbacks import (
    EVENTS,
    CallbackHandler,
    EarlyStoppingCallback,
    TrainerCallback,
    TrainerControl,
)
from core.config import load_config
from core.reporting.memory import StageMemory, speed_metrics, tiny_gpt_flops
from core.state import TrainState

HF_EVENTS = {
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_step_end",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_evaluate",
    "on_save",
    "on_log",
    "on_prediction_step",
}
EVENT_KWARGS = {"on_evaluate": {"metrics": {}}, "on_save": {"path": "p"}, "on_log": {"logs": {}}}


@pytest.fixture(scope="module")
def config():
    return load_config(None)


def with_best(greater: str | None = None, metric: str = "eval_accuracy"):
    flags = ["--eval.strategy", "steps", "--checkpoint.best_metric", metric]
    if greater is not None:
        flags += ["--checkpoint.greater_is_better", greater]
    return load_config(None, flags)


class Recorder(TrainerCallback):
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def on_log(self, config, state, control, logs, **kwargs):
        self.calls.append((self.name, logs["loss"]))


class Counter(TrainerCallback):
    def __init__(self) -> None:
        self.n = 0

    def on_step_end(self, config, state, control, **kwargs):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state_dict):
        self.n = state_dict["n"]


class HalfStateful(TrainerCallback):
    def state_dict(self):
        return {}


def fire(handler, event, config, control=None, **kwargs):
    return handler.fire(event, config, TrainState(), control or TrainerControl(), **kwargs)


# -- events and the handler --------------------------------------------------------------------
def test_every_hf_event_is_a_no_op_on_the_base_class(config):
    assert set(EVENTS) == HF_EVENTS
    handler = CallbackHandler([TrainerCallback()])
    for event in EVENTS:
        sig = inspect.signature(getattr(TrainerCallback, event))
        assert list(sig.parameters)[:4] == ["self", "config", "state", "control"]
        assert "kwargs" in sig.parameters
        control = fire(handler, event, config, **EVENT_KWARGS.get(event, {}))
        assert control == TrainerControl()


def test_fire_calls_callbacks_in_order_and_returns_the_control(config):
    calls: list = []
    handler = CallbackHandler([Recorder("a", calls), Recorder("b", calls)])
    control = TrainerControl()
    assert fire(handler, "on_log", config, control, logs={"loss": 1.5}) is control
    assert calls == [("a", 1.5), ("b", 1.5)]


def test_fire_passes_extra_keywords_to_overrides_that_take_them(config):
    seen = {}

    class TakesAll(TrainerCallback):
        def on_step_begin(self, config, state, control, **kwargs):
            seen.update(kwargs)

    fire(CallbackHandler([TakesAll()]), "on_step_begin", config, micro_batches=4)
    assert seen == {"micro_batches": 4}


def test_fire_skips_callbacks_that_keep_the_no_op(config, monkeypatch):
    calls: list = []
    handler = CallbackHandler([Recorder("a", calls), TrainerCallback(), Recorder("b", calls)])
    fire(handler, "on_log", config, logs={"loss": 1.0})  # the handler looks up overrides here
    spy = []
    monkeypatch.setattr(TrainerCallback, "on_log", lambda *a, **k: spy.append(a))
    fire(handler, "on_log", config, logs={"loss": 2.0})
    assert calls == [("a", 1.0), ("b", 1.0), ("a", 2.0), ("b", 2.0)] and spy == []


def test_fire_follows_edits_of_the_list_and_instance_overrides(config):
    calls: list = []
    handler = CallbackHandler([Recorder("a", calls)])
    fire(handler, "on_log", config, logs={"loss": 1.0})
    handler.callbacks.insert(0, Recorder("first", calls))  # edited in place, not through add
    plain = TrainerCallback()
    plain.on_log = lambda config, state, control, logs, **kw: calls.append(("inst", logs["loss"]))
    handler.add(plain)
    fire(handler, "on_log", config, logs={"loss": 2.0})
    handler.pop(Recorder)
    fire(handler, "on_log", config, logs={"loss": 3.0})
    assert calls == [
        ("a", 1.0),
        ("first", 2.0),
        ("a", 2.0),
        ("inst", 2.0),
        ("a", 3.0),
        ("inst", 3.0),
    ]


def test_unknown_event_raises(config):
    handler = CallbackHandler([TrainerCallback()])
    with pytest.raises(ValueError, match="on_stepend"):
        fire(handler, "on_stepend", config)


def test_add_pop_remove():
    a, b = Counter(), Recorder("r", [])
    handler = CallbackHandler([a])
    handler.add(b)
    handler.add(Counter)  # a class is instantiated
    assert [type(cb) for cb in handler.callbacks] == [Counter, Recorder, Counter]
    assert handler.pop(Counter) is a  # the first of that class
    assert handler.pop(b) is b
    assert handler.pop(b) is None
    handler.remove(Counter)
    assert handler.callbacks == []
    with pytest.raises(ValueError, match="no Counter"):
        handler.remove(Counter)
    with pytest.raises(TypeError, match="TrainerCallback"):
        handler.add(object())  # type: ignore[arg-type]


def test_control_flags_and_resets():
    control = TrainerControl()
    assert not any(vars(control).values())
    for flag in vars(control):
        setattr(control, flag, True)
    control.reset_step()
    assert (control.should_save, control.should_evaluate, control.should_log) == (False,) * 3
    assert control.should_training_stop and control.should_epoch_stop
    control.reset_epoch()
    assert not control.should_epoch_stop and control.should_training_stop
    control.reset_training()
    assert not control.should_training_stop


def test_stateful_picks_only_stateful_callbacks_with_stable_names():
    first, second, counter = EarlyStoppingCallback(), EarlyStoppingCallback(), Counter()
    handler = CallbackHandler([Recorder("r", []), first, HalfStateful(), counter, second])
    entries = handler.stateful()
    assert list(entries) == [
        "callback.EarlyStoppingCallback",
        "callback.Counter",
        "callback.EarlyStoppingCallback.1",
    ]
    assert entries["callback.EarlyStoppingCallback"] is first
    assert entries["callback.EarlyStoppingCallback.1"] is second
    assert entries["callback.Counter"] is counter
    assert list(handler.stateful()) == list(entries)  # same callbacks, same names


# -- early stopping ----------------------------------------------------------------------------
def evaluate(cb, config, values, metric="eval_loss", control=None):
    """Feed `values` one evaluation at a time; the 1-based evaluation that stopped, or None."""
    control = control or TrainerControl()
    for i, v in enumerate(values, 1):
        cb.on_evaluate(config, TrainState(), control, metrics={metric: v, "other": 0.0})
        if control.should_training_stop:
            return i
    return None


def test_patience_counts_evaluations_without_improvement(config):
    cb = EarlyStoppingCallback(patience=2)
    # 1.0 best; 1.1 bad (1); 0.9 best, reset; 0.95 bad (1); 0.9 equal is not better (2): stop
    assert evaluate(cb, config, [1.0, 1.1, 0.9, 0.95, 0.9, 0.1]) == 5
    assert cb.state_dict() == {"best": 0.9, "bad_evaluations": 2}


def test_patience_one_stops_at_the_first_bad_evaluation(config):
    assert evaluate(EarlyStoppingCallback(), config, [3.0, 2.0, 2.5, 1.0]) == 3


def test_threshold_requires_a_large_enough_improvement(config):
    cb = EarlyStoppingCallback(patience=2, threshold=0.1)
    # 0.95 and 0.91 improve by < 0.1 on 1.0: two bad evaluations
    assert evaluate(cb, config, [1.0, 0.95, 0.91]) == 3
    cb = EarlyStoppingCallback(patience=2, threshold=0.1)
    assert evaluate(cb, config, [1.0, 0.85, 0.8, 0.7, 0.65, 0.62]) == 6
    assert cb.best == 0.7


@pytest.mark.parametrize(
    ("metric", "greater"),
    [("eval_loss", False), ("eval_nll_loss", False), ("eval_accuracy", True), ("eval_f1", True)],
)
def test_direction_inferred_from_the_metric_name(config, metric, greater):
    assert EarlyStoppingCallback(metric=metric).resolve(config) == (metric, greater)


def test_metric_and_direction_default_to_the_config(config):
    assert EarlyStoppingCallback().resolve(config) == ("eval_loss", False)
    assert EarlyStoppingCallback().resolve(with_best()) == ("eval_accuracy", True)
    assert EarlyStoppingCallback().resolve(with_best("false")) == ("eval_accuracy", False)
    explicit = EarlyStoppingCallback(metric="eval_loss", greater_is_better=True)
    assert explicit.resolve(with_best("false")) == ("eval_loss", True)


def test_greater_is_better_stops_when_the_metric_stops_rising():
    cb = EarlyStoppingCallback(patience=2)
    assert evaluate(cb, with_best(), [0.5, 0.6, 0.7, 0.65, 0.7], metric="eval_accuracy") == 5
    assert cb.best == 0.7


def test_missing_metric_names_it_and_the_keys_present(config):
    cb = EarlyStoppingCallback(metric="eval_acc")
    with pytest.raises(ValueError, match=r"'eval_acc'.*eval_loss, eval_runtime"):
        cb.on_evaluate(
            config,
            TrainState(),
            TrainerControl(),
            metrics={"eval_runtime": 1.0, "eval_loss": 2.0},
        )


def test_non_finite_values_count_as_no_improvement_and_stay_out_of_the_state(config):
    cb = EarlyStoppingCallback(patience=3)
    assert evaluate(cb, config, [math.nan, 1.0, math.inf, math.nan, -math.inf]) == 5
    assert cb.state_dict() == {"best": 1.0, "bad_evaluations": 3}
    json.dumps(cb.state_dict(), allow_nan=False)


def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="patience"):
        EarlyStoppingCallback(patience=0)
    with pytest.raises(ValueError, match="threshold"):
        EarlyStoppingCallback(threshold=-0.1)


SEQUENCE = [2.0, 1.5, 1.6, 1.4, 1.45, 1.41, 1.3, 1.35, 1.36, 1.37, 1.2]


def test_state_round_trips_through_json(config):
    cb = EarlyStoppingCallback(patience=3)
    assert cb.state_dict() == {"best": None, "bad_evaluations": 0}
    evaluate(cb, config, SEQUENCE[:5])
    restored = EarlyStoppingCallback(patience=3)
    restored.load_state_dict(json.loads(json.dumps(cb.state_dict(), allow_nan=False)))
    assert restored.state_dict() == cb.state_dict() == {"best": 1.4, "bad_evaluations": 1}


@pytest.mark.parametrize("split", range(len(SEQUENCE) + 1))
def test_resumed_copy_stops_at_the_same_evaluation(config, split):
    uninterrupted = evaluate(EarlyStoppingCallback(patience=3), config, SEQUENCE)
    assert uninterrupted == 10

    before = EarlyStoppingCallback(patience=3)
    stopped = evaluate(before, config, SEQUENCE[:split])
    after = EarlyStoppingCallback(patience=3)  # a new process after the kill
    after.load_state_dict(json.loads(json.dumps(before.state_dict(), allow_nan=False)))
    if stopped is None:
        later = evaluate(after, config, SEQUENCE[split:])
        stopped = None if later is None else split + later
    assert stopped == uninterrupted


# -- memory and speed --------------------------------------------------------------------------
def test_stage_metrics_are_present_and_positive():
    mem = StageMemory()
    with mem.stage("init"):
        pass
    with mem.stage("train"):
        block = bytearray(8 * 2**20)  # touch some memory inside the stage
        with mem.stage("eval"):
            pass
        del block
    mem.start("save")
    mem.stop("save")
    metrics = mem.metrics()
    for stage in ("init", "train", "eval", "save"):
        assert metrics[f"{stage}_mem_cpu_peak_mb"] > 0
    # The nested stage's samples are the outer stage's too.
    assert metrics["train_mem_cpu_peak_mb"] >= metrics["eval_mem_cpu_peak_mb"]
    assert all(isinstance(v, float) for v in metrics.values())
    gpu = [k for k in metrics if "_gpu_" in k]
    assert bool(gpu) == torch.cuda.is_initialized()


def test_a_repeated_stage_reports_its_largest_peak():
    mem = StageMemory()
    with mem.stage("eval"):
        block = bytearray(64 * 2**20)  # freed before the second run
    first = mem.metrics()["eval_mem_cpu_peak_mb"]
    del block
    with mem.stage("eval"):
        pass
    assert mem.metrics()["eval_mem_cpu_peak_mb"] >= first


def test_stage_errors():
    mem = StageMemory()
    with pytest.raises(ValueError, match="unknown memory stage 'predict'"):
        mem.start("predict")
    with pytest.raises(RuntimeError, match="not started"):
        mem.stop("train")
    mem.start("train")
    with pytest.raises(RuntimeError, match="twice"):
        mem.start("train")
    mem.stop("train")
    with pytest.raises(KeyError), mem.stage("eval"):
        raise KeyError("boom")
    assert "eval_mem_cpu_peak_mb" in mem.metrics()  # stopped despite the error


def test_speed_metrics():
    m = speed_metrics("train", 10.0, num_samples=1000, num_steps=10, num_tokens=32000, now=14.0)
    assert m == {
        "train_runtime": 4.0,
        "train_samples_per_second": 250.0,
        "train_steps_per_second": 2.5,
        "train_tokens_per_second": 8000.0,
    }
    assert speed_metrics("eval", 0.0, num_samples=1, now=3.0) == {
        "eval_runtime": 3.0,
        "eval_samples_per_second": 0.333,
    }
    assert speed_metrics("eval", 5.0, num_samples=1, now=5.0) == {"eval_runtime": 0.0}


def test_speed_metrics_default_clock_is_perf_counter():
    m = speed_metrics("train", time.perf_counter(), num_steps=1)
    assert 0 <= m["train_runtime"] < 5


def test_tiny_gpt_flops_by_hand():
    # 6 * 100 * 10 = 6000; 12 * 2 * 4 * 8 * 10 = 7680
    assert tiny_gpt_flops(n_params=100, n_layer=2, n_embd=4, seq_len=8, tokens=10) == 13680.0
    assert tiny_gpt_flops(1, 1, 1, 1, 0) == 0.0
    with pytest.raises(ValueError, match="tokens"):
        tiny_gpt_flops(1, 1, 1, 1, -1)


class FakeCuda:
    """torch.cuda's peak counters, driven by the test (no GPU needed)."""

    def __init__(self) -> None:
        self.peak = self.resets = 0

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2 * self.peak)

    def reset(self, device=None) -> None:
        self.resets += 1
        self.peak = 0


def test_gpu_peaks_reset_per_stage_and_nested_stages_fold_into_the_outer(monkeypatch):
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    mem = StageMemory()
    mb = 2**20
    with mem.stage("train"):
        cuda.peak = 100 * mb
        with mem.stage("eval"):  # its reset must not lose train's 100 MB
            cuda.peak = 50 * mb
        cuda.peak = 80 * mb
    with mem.stage("save"):
        cuda.peak = 5 * mb
    m = mem.metrics()
    assert cuda.resets == 3
    assert m["train_mem_gpu_alloc_peak_mb"] == 100.0
    assert m["train_mem_gpu_reserved_peak_mb"] == 200.0
    assert m["eval_mem_gpu_alloc_peak_mb"] == 50.0
    assert m["save_mem_gpu_alloc_peak_mb"] == 5.0

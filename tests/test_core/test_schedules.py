"""core.schedules: hand-computed lr curves, plateau behaviour, JSON state round trips, errors."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch

from core.schedules import SCHEDULE_NAMES, Schedule, build_schedule, get_warmup_steps

TOTAL, WARMUP = 10, 2
STEPS = (0, 1, 2, 4, 6, 8, 10, 12)  # start, mid-warmup, end of warmup, decay, end, past the end

R2 = math.sqrt(2) / 2  # cos(pi / 4)
# Expected lr at each step in STEPS, worked out by hand from the transformers formulas with
# total 10, warmup 2 (so post-warmup progress = (step - 2) / 8).
EXPECTED = {
    # (10 - step) / 8 after warmup, clamped at 0.
    "linear": (1.0, {}, [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]),
    # 0.5 * (1 + cos(pi * progress)); past the end the half-cosine keeps going back up.
    "cosine": (1.0, {}, [0.0, 0.5, 1.0, 0.5 * (1 + R2), 0.5, 0.5 * (1 - R2), 0.0, 0.5 * (1 - R2)]),
    # two cycles: 0.5 * (1 + cos(pi * ((2 * progress) % 1))), restart at progress 0.5, 0 from 1.
    "cosine_with_restarts": (1.0, {"num_cycles": 2}, [0.0, 0.5, 1.0, 0.5, 1.0, 0.5, 0.0, 0.0]),
    # lr_init 2, lr_end 0.2, power 2: lr = 1.8 * (1 - progress) ** 2 + 0.2; lr_end past the end.
    # progress 0.25 / 0.5 / 0.75 -> 1.8 * 0.5625 + 0.2, 1.8 * 0.25 + 0.2, 1.8 * 0.0625 + 0.2.
    "polynomial": (
        2.0,
        {"lr_end": 0.2, "power": 2.0},
        [0.0, 1.0, 2.0, 1.2125, 0.65, 0.3125, 0.2, 0.2],
    ),
    "constant": (1.0, {}, [1.0] * 8),
    "constant_with_warmup": (1.0, {}, [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    # timescale defaults to warmup (2): 1 / sqrt(step / 2) = sqrt(2 / step) after warmup.
    "inverse_sqrt": (
        1.0,
        {},
        [0.0, 0.5, 1.0, R2, 1 / math.sqrt(3), 0.5, 1 / math.sqrt(5), 1 / math.sqrt(6)],
    ),
}
LAMBDA_NAMES = tuple(EXPECTED)


def make(
    name: str, lr: float = 1.0, warmup: int = WARMUP, warmup_ratio: float = 0.0, kwargs=None
) -> tuple[torch.optim.SGD, Schedule]:
    """A real SGD over one parameter and the named schedule over it (total 10 steps)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return optimizer, build_schedule(optimizer, name, TOTAL, warmup, warmup_ratio, kwargs)


def run(optimizer: torch.optim.Optimizer, schedule: Schedule, n: int) -> list[float]:
    """lr before the first step, then after each of n optimizer+scheduler steps."""
    lrs = [schedule.last_lr()]
    for _ in range(n):
        optimizer.step()
        schedule.step()
        lrs.append(schedule.last_lr())
    return lrs


def test_every_name_is_covered() -> None:
    assert set(SCHEDULE_NAMES) == {*LAMBDA_NAMES, "reduce_lr_on_plateau"}


@pytest.mark.parametrize("name", LAMBDA_NAMES)
def test_lr_curve_matches_hand_computed_values(name: str) -> None:
    lr, kwargs, expected = EXPECTED[name]
    optimizer, schedule = make(name, lr=lr, kwargs=kwargs)
    lrs = run(optimizer, schedule, max(STEPS))
    assert [lrs[s] for s in STEPS] == pytest.approx(expected, abs=1e-12)


def test_defaults_cosine_restarts_one_cycle_and_inverse_sqrt_timescale() -> None:
    optimizer, schedule = make("cosine_with_restarts")
    assert run(optimizer, schedule, 6)[6] == pytest.approx(0.5, abs=1e-12)  # cos(pi/2), no restart
    optimizer, schedule = make("inverse_sqrt", warmup=0)
    lrs = run(optimizer, schedule, 30_000)  # timescale 10_000: 1 / sqrt((step + 1e4) / 1e4)
    assert (lrs[0], lrs[30_000]) == pytest.approx((1.0, 0.5))
    optimizer, schedule = make("inverse_sqrt", kwargs={"timescale": 4})
    assert run(optimizer, schedule, 14)[14] == pytest.approx(0.5)  # 1 / sqrt((14 + 2) / 4)


def test_warmup_ratio_sets_warmup_steps() -> None:
    optimizer, schedule = make("linear", warmup=0, warmup_ratio=0.2)
    assert run(optimizer, schedule, 2) == [0.0, 0.5, 1.0]


def test_get_warmup_steps() -> None:
    assert get_warmup_steps(100, 5, 0.5) == 5  # steps win over ratio
    assert get_warmup_steps(100, 0, 0.05) == 5
    assert get_warmup_steps(10, 0, 0.21) == 3  # 2.1 rounds up
    assert get_warmup_steps(10, 0, 0.0) == 0


def test_plateau_drops_after_patience_and_ignores_step() -> None:
    kwargs = {"mode": "min", "factor": 0.5, "patience": 2}
    optimizer, schedule = make("reduce_lr_on_plateau", warmup=0, kwargs=kwargs)
    assert run(optimizer, schedule, 20) == [1.0] * 21
    schedule.observe(1.0)  # first observation sets the best
    schedule.observe(1.0)
    schedule.observe(1.0)
    assert schedule.last_lr() == 1.0  # two non-improving observations are within patience
    schedule.observe(1.0)
    assert schedule.last_lr() == 0.5
    assert run(optimizer, schedule, 5) == [0.5] * 6


@pytest.mark.parametrize("name", LAMBDA_NAMES)
def test_observe_is_a_noop_for_step_schedules(name: str) -> None:
    lr, kwargs, _ = EXPECTED[name]
    _, schedule = make(name, lr=lr, kwargs=kwargs)
    before = schedule.last_lr()
    schedule.observe(123.0)
    assert schedule.last_lr() == before


@pytest.mark.parametrize("name", [*LAMBDA_NAMES, "reduce_lr_on_plateau"])
def test_state_dict_json_round_trip_resumes_identically(name: str) -> None:
    lr, kwargs, _ = EXPECTED.get(name, (1.0, {"factor": 0.5, "patience": 1}, None))
    metrics = [3.0, 2.0, 2.5, 2.5, 2.5, 1.0, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]

    def advance(optimizer: torch.optim.Optimizer, schedule: Schedule, steps: range) -> list[float]:
        lrs = []
        for i in steps:
            optimizer.step()
            schedule.step()
            schedule.observe(metrics[i])
            lrs.append(schedule.last_lr())
        return lrs

    optimizer, schedule = make(name, lr=lr, kwargs=kwargs)
    advance(optimizer, schedule, range(4))
    # LambdaLR state is strict JSON; plateau's holds inf ("best", "mode_worse"), which json writes
    # as Infinity by default and reads back.
    text = json.dumps(schedule.state_dict(), allow_nan=name == "reduce_lr_on_plateau")
    opt_state = optimizer.state_dict()

    optimizer2, schedule2 = make(name, lr=lr, kwargs=kwargs)
    optimizer2.load_state_dict(opt_state)
    schedule2.load_state_dict(json.loads(text))
    assert schedule2.last_lr() == schedule.last_lr()
    resumed = advance(optimizer2, schedule2, range(4, 12))
    assert resumed == advance(optimizer, schedule, range(4, 12))
    assert len(set(resumed)) > 1 or name.startswith("constant")  # the window exercises the curve


@pytest.mark.parametrize("name", LAMBDA_NAMES)
def test_lambda_state_is_plain_numbers_and_pickles(name: str) -> None:
    lr, kwargs, _ = EXPECTED[name]
    _, schedule = make(name, lr=lr, kwargs=kwargs)
    fn = schedule.scheduler.lr_lambdas[0]
    assert schedule.state_dict()["lr_lambdas"] == [fn.__dict__]
    assert all(type(v) in (int, float) for v in fn.__dict__.values())
    clone = pickle.loads(pickle.dumps(fn))
    assert clone == fn and clone(5) == fn(5)


def test_unknown_name_lists_accepted_names() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="'cosin'") as err:
        build_schedule(optimizer, "cosin", TOTAL)
    assert "\n" not in str(err.value)
    assert all(n in str(err.value) for n in SCHEDULE_NAMES)


@pytest.mark.parametrize(
    ("name", "bad", "accepted"),
    [
        ("cosine", "power", ["num_cycles"]),
        ("polynomial", "num_cycles", ["lr_end", "power"]),
        ("inverse_sqrt", "lr_end", ["timescale"]),
        ("cosine_with_restarts", "cycles", ["num_cycles"]),
        ("linear", "num_cycles", ["none"]),
        ("constant", "num_cycles", ["none"]),
        ("constant_with_warmup", "timescale", ["none"]),
        ("reduce_lr_on_plateau", "num_cycles", ["mode", "factor", "patience", "min_lr"]),
    ],
)
def test_unknown_kwarg_names_key_and_accepted(name: str, bad: str, accepted: list[str]) -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=f"'{bad}'") as err:
        build_schedule(optimizer, name, TOTAL, kwargs={bad: 1})
    assert all(a in str(err.value) for a in accepted)


def test_bad_kwarg_values_rejected() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="num_cycles"):
        build_schedule(optimizer, "cosine", TOTAL, kwargs={"num_cycles": "0.5"})
    with pytest.raises(ValueError, match="lr_end"):
        build_schedule(optimizer, "polynomial", TOTAL, kwargs={"lr_end": 1.0})

"""Builds a training run from a Config and its resume plan, in stages: data
(core/build_data.py, its sampler core/build_sampler.py), model (core/build_model.py), engine
(core/build_engine.py), evaluator (core/validator.py), then the checkpointer, the reporters and
the loop's hooks. The path of a run: plan (core/plan.py) -> build (here) -> loop (core/loop.py) ->
checkpoint hook (core/checkpoint_hook.py); see docs/design.md."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core.build_data import build_data
from core.build_engine import build_engine
from core.build_model import build_model, check_inputs
from core.callbacks import CallbackHandler, TrainerCallback, TrainerControl
from core.checkpoint import RunCheckpointer, trajectory
from core.checkpoint_hook import CheckpointHook
from core.config import Config
from core.data import collate
from core.dist_info import DistInfo
from core.loop import TrainLoop
from core.plan import RunPlan, plan_run
from core.reporting.line_writer import LineWriter
from core.reporting.memory import StageMemory
from core.reporting.reporters import build_reporters
from core.reporting.step_log import StepLog
from core.seeding import enable_full_determinism, set_seed
from core.state import TrainState
from core.validator import Validator, build_evaluator

logger = logging.getLogger(__name__)


@dataclass
class UserParts:
    """What a Python API user may bring instead of the config's built-in choices."""

    model: nn.Module | None = None
    model_init: Callable[[], nn.Module] | None = None
    train_dataset: Any = None
    eval_dataset: Any = None
    data_collator: Callable[[list[Any]], Any] | None = None
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None = None
    compute_metrics: Callable[..., dict[str, float]] | None = None
    preprocess_logits_for_metrics: Callable[..., Any] | None = None


def build_trainer(
    config: Config,
    dist_info: DistInfo,
    device: torch.device,
    callbacks: list[TrainerCallback] | None = None,
    stop_requested: Callable[[], bool] | None = None,
    parts: UserParts | None = None,
    memory: StageMemory | None = None,
    plan: RunPlan | None = None,
) -> TrainLoop:
    """Everything a run needs, built in a fixed order so that seeding decides all of it, from
    the resume plan (core/plan.py; made here when not given). `config` is the config asked for;
    what is built follows `plan.config`, fitted to the checkpoint it resumes."""
    parts = parts or UserParts()
    plan = plan or plan_run(config, dist_info)
    config = plan.config
    if config.run.full_determinism:
        enable_full_determinism(config.run.seed)
    else:
        set_seed(config.run.seed)
    tokenizer, hf = check_inputs(config, parts)
    data = build_data(config, tokenizer, dist_info, parts.train_dataset, parts.eval_dataset)
    built = build_model(config, parts, hf, tokenizer, device, data)
    model, dataset, total_steps = built.model, built.dataset, data.steps[1]
    engine = build_engine(config, model, parts, device, total_steps, built.loss_fn, dist_info)
    evaluator = build_evaluator(
        config, parts, built.eval_dataset, model, engine, built.label_names, dist_info,
        stop_requested,
    )  # fmt: skip
    if dist_info.is_main:
        logger.info(
            "model %s: %.2fM parameters; %s samples, %d steps on %d rank(s), device %s",
            type(model).__name__,
            sum(p.numel() for p in model.parameters()) / 1e6,
            "streamed" if data.streamed else len(dataset),
            total_steps,
            dist_info.world_size,
            device,
        )
    state = TrainState()
    checkpointer = RunCheckpointer(
        config,
        plan,
        engine,
        data.sampler,
        state,
        trajectory(
            config,
            dist_info.world_size,
            data.fingerprint,
            total_steps,
            tokenizer.fingerprint if tokenizer is not None else None,
        ),
        built.hf_files,
    )
    reporters: list[TrainerCallback] = []
    writer = None
    if dist_info.is_main:
        # A job that lost the run's lease writes no more lines into it (see LineWriter).
        writer = LineWriter(may_write=lambda: not checkpointer.lease_lost())
        reporters = build_reporters(
            config, total_steps, dist_info.world_size, dist_info.restart_count, writer
        )
    handler = CallbackHandler([*reporters, *(callbacks or [])])
    checkpointer.extra_state = handler.stateful  # callbacks with state resume too
    memory = memory or StageMemory(device)
    control = TrainerControl()

    def fire(event: str, **kwargs: Any) -> None:
        handler.fire(event, config, state, control, **kwargs)

    observes_loss = evaluator is None or config.eval.strategy == "no"
    log = StepLog(
        config, state, engine, data.sampler, data.lengths, dist_info, fire, memory, writer,
        observes_loss,
    )  # fmt: skip
    return TrainLoop(
        config,
        engine,
        dataset,
        data.sampler,
        parts.data_collator or collate,
        data.lengths,
        dist_info,
        state,
        handler,
        control,
        CheckpointHook(checkpointer, log, fire, memory, stop_requested),
        Validator(evaluator, config, log, memory, checkpointer),
        log,
        memory,
        data.steps,
    )

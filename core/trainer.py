"""The Python API: a Hugging Face Trainer-shaped front door to the same loop and checkpoints.

    trainer = Trainer(model=..., args=config, train_dataset=..., eval_dataset=...,
                      compute_metrics=..., callbacks=[...], dist_info=..., device=...)
    result = trainer.train(resume_from_checkpoint=True)

The launcher is a thin user of this class. Distributed setup stays outside core: under torchrun,
get `dist_info`, `device` and `stop_requested` from `launcher.session()`.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpointing.comm import control_group
from checkpointing.hf_export import write_hf_model
from checkpointing.holder import Holder
from checkpointing.lease import Lease, LeaseLost, acquire
from checkpointing.serialize import write_safetensors
from core.autobatch import SEARCH_STEPS, halved, is_oom, release_memory
from core.callbacks import TrainerCallback
from core.config import Config, dump_config, load_config
from core.loop import DistInfo, TrainLoop
from core.plan import RunPlan, open_checkpoint_storage, plan_run
from core.reporting.memory import StageMemory
from core.reporting.reporters import finish_attempt
from core.run import UserParts, build_trainer
from core.state import TrainState

logger = logging.getLogger(__name__)


@dataclass
class TrainOutput:
    global_step: int
    training_loss: float
    """Mean of the logged training losses (every logging_steps-th step and the last)."""
    metrics: dict[str, float]


def _resume_value(resume_from_checkpoint: bool | str | Path | None, config: Config) -> str:
    """train()'s argument in the config's terms: None keeps checkpoint.resume_from."""
    if resume_from_checkpoint is None:
        return config.checkpoint.resume_from
    if resume_from_checkpoint is True:
        return "latest"
    if resume_from_checkpoint is False:
        return "none"
    return str(resume_from_checkpoint)


class Trainer:
    """Train `model` (or `model_init()`, re-invoked after seeding at every train()) on
    `train_dataset` (a `datasets.Dataset` or a torch map-style dataset; default: the config's
    data section) with everything else from `args` (a Config, a YAML path, or None for
    configs/tiny.yaml). `optimizers=(optimizer, lr_scheduler)` replaces the config's optimizer
    and schedule; `optimizer_cls_and_kwargs=(cls, kwargs)` builds `cls` over our parameter
    groups."""

    def __init__(
        self,
        model: nn.Module | None = None,
        args: Config | str | Path | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        compute_metrics: Callable[..., dict[str, float]] | None = None,
        preprocess_logits_for_metrics: Callable[..., Any] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None = None,
        model_init: Callable[[], nn.Module] | None = None,
        *,
        dist_info: DistInfo | None = None,
        device: torch.device | None = None,
        stop_requested: Callable[[], bool] | None = None,
    ) -> None:
        if model is not None and model_init is not None:
            raise ValueError("pass either model or model_init, not both")
        if optimizers[0] is not None and optimizer_cls_and_kwargs is not None:
            raise ValueError("pass either optimizers or optimizer_cls_and_kwargs, not both")
        if optimizers[1] is not None and optimizers[0] is None:
            raise ValueError("optimizers=(None, scheduler): give the scheduler's optimizer too")
        self.args = args if isinstance(args, Config) else load_config(args)
        self.parts = UserParts(
            model=model,
            model_init=model_init,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            data_collator=data_collator,
            optimizer=optimizers[0],
            lr_scheduler=optimizers[1],
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self.callbacks = list(callbacks or [])
        self.dist_info = dist_info or DistInfo()
        self.device = device or torch.device("cpu")
        self.stop_requested = stop_requested
        self.model = model
        self.loop: TrainLoop | None = None
        self._lease: Lease | None = None

    def train(self, resume_from_checkpoint: bool | str | Path | None = None) -> TrainOutput:
        """Train to max_steps / num_epochs. `resume_from_checkpoint`: None keeps the config's
        checkpoint.resume_from (default latest), True is latest, False is none, a path resumes
        that checkpoint."""
        config = dataclasses.replace(
            self.args,
            checkpoint=dataclasses.replace(
                self.args.checkpoint,
                resume_from=_resume_value(resume_from_checkpoint, self.args),
            ),
        )
        self._asked = config
        t0 = time.perf_counter()
        try:
            plan = plan_run(config, self.dist_info)
            if config.train.auto_find_batch_size:
                state = self._train_searching_batch(plan)
            else:
                state = self._train_once(plan)
        finally:
            if self._lease is not None:
                self._lease.release()  # nothing when lost: the run is another job's now
                self._lease = None
        self.model = self.loop.engine.model
        losses = [h["loss"] for h in state.log_history if "loss" in h]
        metrics = dict(self.loop.summary)
        metrics["train_runtime_with_setup"] = time.perf_counter() - t0
        return TrainOutput(
            state.global_step, statistics.fmean(losses) if losses else float("nan"), metrics
        )

    def _acquire_lease(self, config: Config) -> Lease:
        """The run's lease (checkpointing/lease.py) on every rank; LeaseHeld after waiting
        run.lease_wait_s for another job that holds it."""
        info = self.dist_info
        return acquire(
            open_checkpoint_storage(config, info.world_size),
            Holder.this_process(info.job, info.job_id),
            info.rank,
            timeout_s=config.run.lease_timeout_s,
            wait_s=config.run.lease_wait_s,
            group=control_group(),
        )

    def _build(self, plan: RunPlan, memory: StageMemory) -> TrainLoop:
        with memory.stage("init"):
            return build_trainer(
                plan.config,
                self.dist_info,
                self.device,
                callbacks=self.callbacks,
                stop_requested=self.stop_requested,
                parts=self.parts,
                memory=memory,
                plan=plan,
            )

    def _train_once(self, plan: RunPlan) -> TrainState:
        memory = StageMemory(self.device)
        self.loop = self._build(plan, memory)
        # Building reads the run (the checkpoint to resume) and writes nothing: bad input
        # fails before the lease. Before anything of the run is written, one job holds it.
        if self._lease is None:
            self._lease = self._acquire_lease(plan.config)
            # The job that held the run until now may have committed since the plan was made
            # (while this one waited, or right before it released): plan again, then.
            if self._lease.waited or plan.outdated():
                fresh = plan_run(self._asked, self.dist_info, plan.manager)
                if (fresh.resumes, fresh.stale) != (plan.resumes, plan.stale):
                    if self.dist_info.is_main:
                        when = "while waiting for" if self._lease.waited else "before taking"
                        logger.info("the run changed %s its lease: building it again", when)
                    plan = fresh
                    self.loop = self._build(plan, memory)
        plan.manager.lease = self._lease
        self._plan = plan
        if self.dist_info.is_main:  # only once everything was built: bad input writes nothing
            out = Path(plan.config.run.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            # What runs: the planned config (a resume on other ranks may adjust accumulation).
            (out / "config.yaml").write_text(dump_config(plan.config))
        try:
            state = self.loop.train()
        except LeaseLost:  # history.jsonl is the new holder's now: nothing more is recorded
            raise
        except BaseException as e:  # recorded in history.jsonl, then re-raised
            finish_attempt(self.loop.callbacks, self.loop.state.global_step, error=e)
            raise
        finish_attempt(self.loop.callbacks, state.global_step, preempted=self.loop.preempted)
        return state

    def _train_searching_batch(self, plan: RunPlan) -> TrainState:
        """auto_find_batch_size: start at the size a resumed checkpoint recorded (the plan
        holds it), else search down from the configured one while out-of-memory errors come
        in the first steps."""
        # A model object (not model_init) keeps the weights a failed attempt stepped.
        initial = None
        if self.parts.model is not None:
            initial = {k: v.detach().clone() for k, v in self.parts.model.state_dict().items()}
        while True:
            try:
                return self._train_once(plan)
            except Exception as e:
                if (
                    not is_oom(e)
                    or self.loop is None
                    or (self.loop.state.global_step - self.loop.start_step > SEARCH_STEPS)
                ):
                    raise
                self.loop = None
                release_memory()
                plan = self._plan.with_config(halved(self._plan.config))
                if initial is not None:
                    self.parts.model.load_state_dict(initial)

    def save_model(self, output_dir: str | Path | None = None) -> Path | None:
        """Write the trained model's full weights (ZeRO shards gathered, fp32 master values
        under DeepSpeed) to `output_dir` (default: run.output_dir), as the export command does
        from a checkpoint: for a transformers model a directory `from_pretrained` loads
        (config.json, model.safetensors, tokenizer files; returns the directory), else
        `<output_dir>/model.safetensors` (returns that file). A collective: call it on every
        rank; rank 0 writes and gets the path, the others None."""
        if self.loop is None:
            raise RuntimeError("save_model: nothing trained yet; call train() first")
        tensors = self.loop.engine.full_state_dict()
        if not self.dist_info.is_main:
            return None
        out = Path(output_dir or self.args.run.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        checkpointer = self.loop.checkpointer
        if checkpointer is not None and checkpointer.hf_files is not None:
            return write_hf_model(out, tensors, checkpointer.hf_files.files)
        write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
        return out / "model.safetensors"

    def evaluate(self) -> dict[str, float]:
        """Evaluate the current model on eval_dataset (every rank; the same dict on each)."""
        if self.loop is None:
            self.loop = build_trainer(
                self.args, self.dist_info, self.device, callbacks=self.callbacks, parts=self.parts
            )
        evaluate = self.loop.validator.evaluate
        if evaluate is None:
            raise ValueError("no evaluation data: pass eval_dataset or set eval.strategy")
        metrics = evaluate()
        if metrics is None:
            raise RuntimeError("evaluation interrupted by a stop request")
        return metrics

    @property
    def preempted(self) -> bool:
        """True when the last train() stopped on a stop request and checkpointed."""
        return self.loop is not None and self.loop.preempted

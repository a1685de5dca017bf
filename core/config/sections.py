"""The config sections: one dataclass each, a docstring under every field, checks that name the
key. Parsing (YAML files, `--section.key` overrides) lives in core/config/__init__.py; the
model and data sections in core/config/inputs.py.

Precedence is CLI > file > defaults. Unknown keys, wrong types and out-of-range values raise
`ConfigError` with one line naming the key and what is accepted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any

from core.config.checks import _check, _one_of, _read_mapping
from core.config.inputs import DataConfig, ModelConfig
from core.config.roles import NEUTRAL, TRAJECTORY, Added
from core.engines.registry import engine_names

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "adafactor")
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
)
FSDP_DEFAULTS: dict[str, Any] = {"wrap": None, "reshard_after_forward": True}
REPORT_TO = ("jsonl", "tensorboard")


@dataclass
class RunConfig:
    output_dir: Annotated[str, NEUTRAL] = "runs/tiny"
    """Directory for config.yaml, metrics.jsonl and checkpoints."""
    seed: Annotated[int, TRAJECTORY] = 42
    """Seed for Python, NumPy, torch, the sampler shuffle and DataLoader workers."""
    full_determinism: Annotated[bool, TRAJECTORY] = False
    """Use deterministic algorithms only (torch.use_deterministic_algorithms, cuDNN flags)."""
    overwrite: Annotated[bool, NEUTRAL] = False
    """Allow a fresh run (resume_from: none) to write into an output_dir that holds checkpoints."""
    log_level: Annotated[str, NEUTRAL] = "info"
    """Logging level: debug, info, warning, error."""
    report_to: Annotated[list[str], NEUTRAL] = field(default_factory=lambda: ["jsonl"])
    """Metric sinks of rank 0: jsonl (metrics.jsonl), tensorboard (<output_dir>/tensorboard/)."""
    lease_wait_s: Annotated[float, NEUTRAL] = 600.0
    """A second job launched into a run whose lease another job holds waits this long for it
    (a preempted job's grace period and final save), then exits with code 73."""
    lease_timeout_s: Annotated[float, NEUTRAL] = 60.0
    """A lease whose heartbeat is older than this is taken over (a lost node, a frozen job); on
    the same host a holder whose process is gone is taken over at once."""

    def __post_init__(self) -> None:
        _check(bool(self.output_dir), "run.output_dir", "must be a non-empty path")
        _check(self.lease_wait_s >= 0, "run.lease_wait_s", f"must be >= 0, got {self.lease_wait_s}")
        _check(
            self.lease_timeout_s > 0,
            "run.lease_timeout_s",
            f"must be > 0 seconds, got {self.lease_timeout_s}",
        )
        _check(self.seed >= 0, "run.seed", f"must be >= 0, got {self.seed}")
        _one_of(self.log_level, "run.log_level", ("debug", "info", "warning", "error"))
        for target in self.report_to:
            _one_of(target, "run.report_to", REPORT_TO)


@dataclass
class TrainConfig:
    max_steps: Annotated[int | None, TRAJECTORY] = None
    """Optimizer steps to run; wins over num_epochs when set."""
    num_epochs: Annotated[int | None, TRAJECTORY] = None
    """Epochs to run when max_steps is not set."""
    per_device_batch_size: Annotated[int, TRAJECTORY] = 8
    """Samples per micro-batch on each rank."""
    gradient_accumulation_steps: Annotated[int, TRAJECTORY] = 1
    """Micro-batches per optimizer step."""
    keep_global_batch: Annotated[bool, NEUTRAL] = True
    """Resuming on a different number of ranks: set accumulation so that ranks x per-device
    batch x accumulation stays the checkpoint's global batch (refused when impossible)."""
    max_grad_norm: Annotated[float, TRAJECTORY] = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    logging_steps: Annotated[int, NEUTRAL] = 10
    """Log (metrics.jsonl, console) every this many optimizer steps, and at the last step."""
    bf16: Annotated[bool, TRAJECTORY] = False
    """Run forward passes under bf16 autocast."""
    progress_bar: Annotated[str, NEUTRAL] = "auto"
    """auto (tqdm on a terminal), always or never."""
    auto_find_batch_size: Annotated[bool, TRAJECTORY] = False
    """On out-of-memory in the first steps: halve the batch, double accumulation, retry."""
    label_smoothing_factor: Annotated[float, TRAJECTORY] = 0.0
    """Label smoothing for models that return logits (cross_entropy's label_smoothing)."""

    def __post_init__(self) -> None:
        _check(
            self.max_steps is not None or self.num_epochs is not None,
            "train.max_steps",
            "set train.max_steps or train.num_epochs (both are missing)",
        )
        if self.max_steps is not None:
            _check(self.max_steps > 0, "train.max_steps", f"must be > 0, got {self.max_steps}")
        if self.num_epochs is not None:
            _check(self.num_epochs > 0, "train.num_epochs", f"must be > 0, got {self.num_epochs}")
        _check(
            self.per_device_batch_size > 0,
            "train.per_device_batch_size",
            f"must be > 0, got {self.per_device_batch_size}",
        )
        _check(
            self.gradient_accumulation_steps > 0,
            "train.gradient_accumulation_steps",
            f"must be > 0, got {self.gradient_accumulation_steps}",
        )
        _check(self.max_grad_norm >= 0, "train.max_grad_norm", "must be >= 0 (0 disables)")
        _check(self.logging_steps > 0, "train.logging_steps", "must be > 0")
        _one_of(self.progress_bar, "train.progress_bar", ("auto", "always", "never"))
        _check(
            0.0 <= self.label_smoothing_factor < 1.0,
            "train.label_smoothing_factor",
            "must be in [0, 1)",
        )


@dataclass
class OptimConfig:
    name: Annotated[str, TRAJECTORY] = "adamw_torch"
    """One of: adamw_torch, adamw_torch_fused, sgd, adagrad, adafactor."""
    lr: Annotated[float, TRAJECTORY] = 1e-3
    """Peak learning rate."""
    weight_decay: Annotated[float, TRAJECTORY] = 0.0
    """Weight decay, applied to all parameters but biases and normalisation weights."""
    beta1: Annotated[float, TRAJECTORY] = 0.9
    """AdamW beta1."""
    beta2: Annotated[float, TRAJECTORY] = 0.999
    """AdamW beta2 (adafactor: its beta2_decay is not this; see docs/configuration.md)."""
    eps: Annotated[float, TRAJECTORY] = 1e-8
    """AdamW/Adagrad epsilon."""
    momentum: Annotated[float, TRAJECTORY] = 0.0
    """SGD momentum."""

    def __post_init__(self) -> None:
        _one_of(self.name, "optim.name", OPTIMIZERS)
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        _check(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1", "betas in [0, 1)")
        _check(self.eps >= 0, "optim.eps", "must be >= 0")
        _check(self.momentum >= 0, "optim.momentum", "must be >= 0")


@dataclass
class SchedulerConfig:
    name: Annotated[str, TRAJECTORY] = "linear"
    """One of the eight schedule types (see docs/configuration.md)."""
    warmup_steps: Annotated[int, TRAJECTORY] = 0
    """Linear warmup steps; wins over warmup_ratio when > 0."""
    warmup_ratio: Annotated[float, TRAJECTORY] = 0.0
    """Warmup as a fraction of the total optimizer steps."""
    kwargs: Annotated[dict[str, Any], TRAJECTORY] = field(default_factory=dict)
    """Extra schedule arguments: num_cycles, lr_end, power, timescale, factor, patience..."""

    def __post_init__(self) -> None:
        _one_of(self.name, "scheduler.name", SCHEDULERS)
        _check(self.warmup_steps >= 0, "scheduler.warmup_steps", "must be >= 0")
        _check(0.0 <= self.warmup_ratio <= 1.0, "scheduler.warmup_ratio", "must be in [0, 1]")


@dataclass
class EvalConfig:
    strategy: Annotated[str, TRAJECTORY] = "no"
    """When to evaluate: no, steps (every eval.steps), epoch (at each epoch end)."""
    steps: Annotated[int, TRAJECTORY] = 0
    """With strategy steps: evaluate every this many optimizer steps (0: train.logging_steps)."""
    per_device_batch_size: Annotated[int | None, TRAJECTORY] = None
    """Eval micro-batch per rank (default: train.per_device_batch_size)."""
    source: Annotated[str, TRAJECTORY] = "holdout"
    """holdout (the last eval.holdout_samples of the training data, which training then skips)
    or a file path / glob read with the data section's settings."""
    holdout_samples: Annotated[int, TRAJECTORY] = 256
    """With source holdout: samples held out for evaluation."""

    def __post_init__(self) -> None:
        _one_of(self.strategy, "eval.strategy", ("no", "steps", "epoch"))
        _check(self.holdout_samples > 0, "eval.holdout_samples", "must be > 0")
        _check(self.steps >= 0, "eval.steps", "must be >= 0")
        if self.per_device_batch_size is not None:
            _check(self.per_device_batch_size > 0, "eval.per_device_batch_size", "must be > 0")


@dataclass
class CheckpointConfig:
    dir: Annotated[str | None, NEUTRAL] = None
    """Where checkpoints live: a path or an fsspec URL (s3://bucket/run, gs://..., memory://
    for one process); default run.output_dir."""
    storage_options: Annotated[dict[str, Any], NEUTRAL] = field(default_factory=dict)
    """Keyword arguments for the fsspec filesystem (s3fs: endpoint_url, key, secret, ...);
    credentials are never written to config.yaml, logs or manifests."""
    async_save: Annotated[bool, NEUTRAL] = False
    """Stage the state in memory and write, upload and commit in a background thread."""
    retries: Annotated[int, NEUTRAL] = 3
    """Retries (with backoff) of each store operation of a save or load before it fails."""
    save_steps: Annotated[int, NEUTRAL] = 0
    """Save a checkpoint every this many optimizer steps (0 = only the final one)."""
    save_total_limit: Annotated[int | None, NEUTRAL] = None
    """Keep at most this many committed checkpoints (oldest deleted first)."""
    resume_from: Annotated[str, NEUTRAL] = "latest"
    """latest (newest committed checkpoint in output_dir, if any), none, or a checkpoint path."""
    allow_config_change: Annotated[bool, NEUTRAL] = False
    """Resume even when fields that change the trajectory differ from the checkpoint's."""
    best_metric: Annotated[str | None, NEUTRAL] = None
    """Metric (e.g. eval_loss) whose best checkpoint retention keeps beside the newest."""
    greater_is_better: Annotated[bool | None, NEUTRAL] = None
    """Whether a larger best_metric is better (default: false for names ending in loss)."""
    load_best_model_at_end: Annotated[bool, NEUTRAL] = False
    """Load the best checkpoint's model weights when training ends (needs best_metric)."""

    def __post_init__(self) -> None:
        _check(self.save_steps >= 0, "checkpoint.save_steps", "must be >= 0")
        if self.save_total_limit is not None:
            _check(self.save_total_limit > 0, "checkpoint.save_total_limit", "must be > 0")
        _check(bool(self.resume_from), "checkpoint.resume_from", "latest, none or a path")
        _check(self.retries >= 0, "checkpoint.retries", "must be >= 0")
        if self.dir is not None:
            _check(bool(self.dir), "checkpoint.dir", "a path or URL, or null for run.output_dir")


def metric_greater_is_better(metric: str, explicit: bool | None = None) -> bool:
    """`explicit` when set, else false for metrics named ...loss (as the HF Trainer decides)."""
    return explicit if explicit is not None else not metric.endswith("loss")


@dataclass
class EngineConfig:
    name: Annotated[str, TRAJECTORY] = "ddp"
    """Distributed engine: ddp, fsdp (FSDP2 sharding) or deepspeed."""
    backend: Annotated[str, NEUTRAL] = "auto"
    """Process-group backend: auto (nccl on CUDA, gloo on CPU), nccl or gloo."""
    device: Annotated[str, TRAJECTORY] = "auto"
    """auto (cuda:LOCAL_RANK when CUDA is available, else cpu), cpu or cuda."""
    find_unused_parameters: Annotated[bool, NEUTRAL] = False
    """DDP find_unused_parameters."""
    deepspeed_config: Annotated[dict[str, Any] | str | None, TRAJECTORY] = None
    """deepspeed: a DeepSpeed config (JSON or YAML file, or an inline mapping); the file is read
    here, so config.yaml records its content. Batch size, accumulation, clipping and bf16 come
    from the train section (leave them out or "auto")."""

    fsdp: Annotated[dict[str, Any], Added(FSDP_DEFAULTS)] = dataclasses.field(
        default_factory=lambda: dict(FSDP_DEFAULTS)
    )
    """fsdp: `wrap` (module class names sharded as units of their own; null: a transformers
    model's _no_split_modules, TinyGPT's Block) and `reshard_after_forward` (free gathered
    parameters after forward, gather again for backward: less memory, more communication)."""

    def __post_init__(self) -> None:
        _one_of(self.name, "engine.name", engine_names())
        unknown = sorted(set(self.fsdp) - set(FSDP_DEFAULTS))
        _check(
            not unknown,
            f"engine.fsdp.{unknown[0] if unknown else ''}",
            f"unknown key; valid keys: {', '.join(FSDP_DEFAULTS)}",
        )
        self.fsdp = {**FSDP_DEFAULTS, **self.fsdp}
        wrap = self.fsdp["wrap"]
        if isinstance(wrap, str):
            self.fsdp["wrap"] = wrap = [wrap]
        _check(
            wrap is None or (isinstance(wrap, list) and all(isinstance(c, str) for c in wrap)),
            "engine.fsdp.wrap",
            f"expected a list of module class names or null, got {wrap!r}",
        )
        _check(
            isinstance(self.fsdp["reshard_after_forward"], bool),
            "engine.fsdp.reshard_after_forward",
            f"expected true or false, got {self.fsdp['reshard_after_forward']!r}",
        )
        if isinstance(self.deepspeed_config, str):
            self.deepspeed_config = _read_mapping(self.deepspeed_config, "engine.deepspeed_config")
        if self.deepspeed_config is not None:
            _check(
                self.name == "deepspeed",
                "engine.deepspeed_config",
                f"is for engine.name deepspeed, not {self.name}",
            )
        _one_of(self.backend, "engine.backend", ("auto", "nccl", "gloo"))
        _one_of(self.device, "engine.device", ("auto", "cpu", "cuda"))


@dataclass
class Config:
    """The whole run; every section is built (from defaults where the file is silent)."""

    run: RunConfig
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
    optim: OptimConfig
    scheduler: SchedulerConfig
    checkpoint: CheckpointConfig
    engine: EngineConfig

    def __post_init__(self) -> None:
        if self.checkpoint.load_best_model_at_end:
            _check(
                self.checkpoint.best_metric is not None,
                "checkpoint.load_best_model_at_end",
                "needs checkpoint.best_metric (e.g. eval_loss)",
            )
        if self.checkpoint.best_metric is not None and self.checkpoint.best_metric.startswith(
            "eval_"
        ):
            _check(
                self.eval.strategy != "no",
                "checkpoint.best_metric",
                f"{self.checkpoint.best_metric} needs evaluation: set eval.strategy",
            )
        if self.engine.name == "deepspeed":
            _check(
                not self.checkpoint.load_best_model_at_end,
                "checkpoint.load_best_model_at_end",
                "is not supported with engine.name deepspeed",
            )
            _check(
                not self.train.auto_find_batch_size,
                "train.auto_find_batch_size",
                "is not supported with engine.name deepspeed",
            )
        if self.model.name == "tiny-gpt":
            _check(
                self.data.seq_len <= self.model.block_size,
                "data.seq_len",
                f"must be <= model.block_size ({self.model.block_size}), got {self.data.seq_len}",
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

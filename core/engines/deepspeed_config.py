"""How the DeepSpeed engine is set up: the DeepSpeed config our train section completes, the
engine's builder for the registry (core/engines/__init__.py), and which of its checkpoints
reshard onto another number of ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from checkpointing.manifest import CheckpointError, Manifest
from core.config import Config, ConfigError

if TYPE_CHECKING:
    from core.engines.deepspeed import DeepSpeedEngine
    from core.engines.registry import EngineInputs


def build(inputs: EngineInputs) -> DeepSpeedEngine:
    from core.engines.deepspeed import DeepSpeedEngine

    ds_config = resolve_deepspeed_config(inputs.config, inputs.world_size)
    names_optimizer = ds_config.get("optimizer") is not None
    if names_optimizer and inputs.custom_optimizer:
        raise ConfigError(
            "engine.deepspeed_config: names an optimizer, and the Trainer was given one too"
        )
    optimizer = None if names_optimizer else inputs.make_optimizer(inputs.model)
    return DeepSpeedEngine(
        inputs.model, optimizer, inputs.make_schedule, inputs.device, ds_config, inputs.loss_fn
    )


def check_reshard(config: Config, saved: Manifest, where: str) -> None:
    """ZeRO 1-2 with an Adam-family optimizer resume on another number of ranks (through a
    DeepSpeed universal checkpoint); anything else is refused with the reason."""
    ds = saved.trajectory.get("engine.deepspeed_config") or {}
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    named = str((ds.get("optimizer") or {}).get("type", "")).lower()
    adam = named in ("adam", "adamw") if named else config.optim.name.startswith("adamw")
    why = None
    if stage == 0:
        why = "ZeRO stage 0 keeps no partitioned optimizer state to convert"
    elif stage == 3:
        why = (
            "DeepSpeed 0.19's universal load gives every ZeRO-3 parameter group the "
            "hyperparameters of the first (weight decay would reach biases and norms)"
        )
    elif not adam:
        why = "DeepSpeed's universal checkpoints hold Adam moments only (exp_avg, exp_avg_sq)"
    if why is not None:
        raise CheckpointError(
            f"{where}: DeepSpeed ZeRO-{stage} shards cannot be resharded here: {why}; relaunch "
            f"on {saved.world_size}, or export the weights (python -m checkpointing export) "
            "and start a new run from them"
        )


def resolve_deepspeed_config(config: Config, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config to initialise with: the user's, plus the values our train section
    decides. A key the user set to anything but our value or "auto" is a ConfigError."""
    user = dict(config.engine.deepspeed_config or {})
    tc = config.train
    ours = {
        "train_micro_batch_size_per_gpu": tc.per_device_batch_size,
        "gradient_accumulation_steps": tc.gradient_accumulation_steps,
        "train_batch_size": tc.per_device_batch_size * tc.gradient_accumulation_steps * world_size,
        "gradient_clipping": float(tc.max_grad_norm),
    }
    where = {
        "train_micro_batch_size_per_gpu": "train.per_device_batch_size",
        "gradient_accumulation_steps": "train.gradient_accumulation_steps",
        "train_batch_size": "train.per_device_batch_size x gradient_accumulation_steps x world",
        "gradient_clipping": "train.max_grad_norm",
    }
    for key, value in ours.items():
        theirs = user.get(key, "auto")
        if theirs != "auto" and theirs != value:
            raise ConfigError(
                f"engine.deepspeed_config: {key} is {theirs!r} but {where[key]} gives {value!r}; "
                'remove it from the DeepSpeed config or set it to "auto"'
            )
        user[key] = value
    fp16 = user.get("fp16") or {}
    if fp16.get("enabled") is True:
        raise ConfigError(
            "engine.deepspeed_config: fp16 is not supported (dynamic loss scaling skips "
            "optimizer steps, which breaks exact resume); use train.bf16 true"
        )
    bf16 = dict(user.get("bf16") or {})
    if bf16.get("enabled", "auto") not in ("auto", tc.bf16):
        raise ConfigError(
            f"engine.deepspeed_config: bf16.enabled is {bf16['enabled']!r} but train.bf16 is "
            f"{tc.bf16!r}; set train.bf16 instead"
        )
    bf16["enabled"] = tc.bf16
    user["bf16"] = bf16
    zero = user.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"engine.deepspeed_config: zero_optimization.stage {stage!r}; 0-3")
    if user.get("scheduler") is not None and user.get("optimizer") is None:
        raise ConfigError(
            "engine.deepspeed_config: a scheduler needs the optimizer named there too "
            "(or drop the scheduler and use our scheduler section)"
        )
    user.setdefault("steps_per_print", 2**31 - 1)  # we log; DeepSpeed's own lines repeat ours
    return user

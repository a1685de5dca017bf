"""The engines (how a model is wrapped, stepped and checkpointed), registered by name."""

from core.engines.registry import (
    EngineInputs,
    engine_names,
    register_engine,
    unregister_engine,
)

__all__ = ["EngineInputs", "engine_names", "register_engine", "unregister_engine"]

register_engine("ddp", "core.engines.ddp:build", state_by_name=True)
register_engine("fsdp", "core.engines.fsdp:build", state_by_name=True)
register_engine(
    "deepspeed",
    "core.engines.deepspeed_config:build",
    reshard_check="core.engines.deepspeed_config:check_reshard",
)

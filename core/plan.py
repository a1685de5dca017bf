"""The resume plan: what a run continues from, decided once, before anything of it is built.

    plan = plan_run(config, dist_info)     # reads the run's checkpoints, writes nothing
    loop = build_trainer(..., plan=plan)   # every stage sized by plan.config
    loop.train()                           # the checkpointer loads plan.resume first

The plan resolves `checkpoint.resume_from` to one verified checkpoint (or none), reads what it
recorded (world size, trajectory, the batch auto_find_batch_size found) and fits the config to
this number of ranks. The builder and the checkpointer take it as a plain value: nothing after
this stage looks for a checkpoint again, except once the run's lease is taken (core/trainer.py):
a job that waited for it, or that finds a commit newer than the plan saw (the previous holder's
last save), plans again.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from checkpointing.comm import broadcast_object, control_group
from checkpointing.manager import CheckpointManager
from checkpointing.manifest import CheckpointError, Manifest
from checkpointing.redact import display_url
from checkpointing.storage import Storage, is_private_to_process, open_storage
from core.autobatch import at_recorded_batch
from core.config import Config, ConfigError, metric_greater_is_better
from core.dist_info import DistInfo
from core.elastic import fit_world_size

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPlan:
    config: Config
    """The config the run is built from: fitted to this number of ranks, at the batch size a
    resumed auto_find_batch_size search recorded."""
    manager: CheckpointManager
    """The run's one checkpoint manager (its lease is attached once taken)."""
    resume: tuple[Storage, Manifest] | None = None
    """The verified checkpoint to load before the first step; None: a fresh start."""
    stale: tuple[str, ...] = ()
    """Checkpoints a fresh start deletes first (run.overwrite with resume_from none)."""
    seen: str | None = None
    """The newest committed checkpoint when the plan was made (None: none)."""

    def outdated(self) -> bool:
        """Whether a checkpoint was committed (or deleted) since the plan was made; every rank
        gets rank 0's answer. Once this job holds the run's lease, nobody else commits."""
        return broadcast_object(self.manager.newest()) != self.seen

    @property
    def resumes(self) -> str | None:
        """Which checkpoint the plan resumes, as a comparable name (None: a fresh start)."""
        return None if self.resume is None else self.resume[0].display()

    def with_config(self, config: Config) -> RunPlan:
        return dataclasses.replace(self, config=config)


def open_checkpoint_storage(config: Config, world_size: int) -> Storage:
    """The checkpoint location of a run: checkpoint.dir, or run.output_dir."""
    cc = config.checkpoint
    url = cc.dir or config.run.output_dir
    if world_size > 1 and is_private_to_process(url):
        raise ConfigError(
            f"checkpoint.dir: {display_url(url)} lives in one process's memory; with "
            f"{world_size} ranks use a shared store (a shared filesystem path, s3://, gs://)"
        )
    try:
        return open_storage(url, cc.storage_options, cc.retries)
    except (ImportError, ValueError, TypeError) as e:
        raise ConfigError(f"checkpoint.dir: cannot open {display_url(url)}: {e}") from e


def open_manager(config: Config, dist_info: DistInfo) -> CheckpointManager:
    cc = config.checkpoint
    storage = open_checkpoint_storage(config, dist_info.world_size)
    return CheckpointManager(
        storage,
        dist_info.rank,
        dist_info.world_size,
        save_total_limit=cc.save_total_limit,
        engine=config.engine.name,
        group=control_group(),
        greater_is_better=metric_greater_is_better(
            cc.best_metric or "eval_loss", cc.greater_is_better
        ),
        async_save=cc.async_save,
        storage_options=cc.storage_options,
    )


def plan_run(
    config: Config, dist_info: DistInfo, manager: CheckpointManager | None = None
) -> RunPlan:
    """Resolve what `config` resumes on this process's ranks (a collective: every rank calls it
    and gets the same plan). Bad resume input raises here, before anything is built."""
    manager = manager or open_manager(config, dist_info)
    cc = config.checkpoint
    seen = broadcast_object(manager.newest())
    if cc.resume_from == "none":
        committed = tuple(name for _, name in manager.committed())
        if committed and not config.run.overwrite:
            raise CheckpointError(
                f"checkpoint.resume_from: none, but {manager.root} holds checkpoints; "
                "set run.overwrite true to start afresh there, or resume_from latest"
            )
        return RunPlan(config, manager, stale=committed, seen=seen)
    found = manager.resolve(cc.resume_from)
    if found is None:
        return RunPlan(config, manager, seen=seen)
    manifest = found[1]
    if config.train.auto_find_batch_size:
        config = at_recorded_batch(config, found)
    fitted = fit_world_size(config, manifest, dist_info.world_size)
    return RunPlan(fitted, manager, found, seen=seen)

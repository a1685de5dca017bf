"""What a training run checkpoints, and the checks that make a wrong resume impossible to miss.

The checkpointing package saves whatever mapping it is handed; this module decides the mapping
(model, optimizer, scheduler, sampler, train_state, per-rank rng), the config fields that fix
the trajectory, and the self-check recorded at save and recomputed after a load.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any

from checkpointing.hf_export import HF_ENTRY, HFFiles
from checkpointing.lease import LeaseLost
from checkpointing.manager import CheckpointSaveError, Entry
from checkpointing.manifest import CheckpointError, read_manifest
from checkpointing.restore import source_rank
from checkpointing.rng import RNGState, rng_fingerprint
from checkpointing.staging import SaveOutcome
from checkpointing.stateful import Stateful
from checkpointing.storage import Storage
from core.config import Config, config_roles
from core.data.sampler import ResumableDistributedSampler
from core.elastic import crosses, saved_global_batch
from core.engines.base import Engine
from core.plan import RunPlan
from core.state import TrainState

logger = logging.getLogger(__name__)

# Each config field declares its role beside its definition (core/config/roles.py).
_ROLES = config_roles()
ADDED = {key: role.old for key, role in _ROLES.items() if role is not None and role.kind == "added"}
"""Fields added after checkpoints were first written, with the value every run had before
them: an older checkpoint without them resumes as if it recorded these."""


class ResumeMismatchError(CheckpointError):
    """The run after loading differs from the run that saved (a wrong resume was caught)."""


# What a resume on another number of ranks may change, as long as the global batch stays.
ELASTIC_FIELDS = {"world_size", "train.gradient_accumulation_steps"}


def trajectory(
    config: Config,
    world_size: int,
    dataset_fp: str,
    total_steps: int,
    tokenizer_fp: str | None = None,
) -> dict:
    """The values that decide the trajectory, flat as {"section.key": value}. `tokenizer_fp`:
    the content fingerprint of a Hugging Face tokenizer (its directory may change under the
    same data.tokenizer name)."""
    tc = config.train
    flat = {
        f"{section}.{key}": value
        for section, fields in config.to_dict().items()
        for key, value in fields.items()
        if _ROLES[f"{section}.{key}"].in_trajectory
    }
    if tc.auto_find_batch_size:
        # The search may lower the micro-batch; what must not change is the global batch.
        del flat["train.per_device_batch_size"], flat["train.gradient_accumulation_steps"]
    flat.update(
        {
            "world_size": world_size,
            "train.global_batch": world_size
            * tc.per_device_batch_size
            * tc.gradient_accumulation_steps,
            "dataset": dataset_fp,
            "total_steps": total_steps,
        }
    )
    if tokenizer_fp is not None:
        flat["data.tokenizer.fingerprint"] = tokenizer_fp
    return flat


def fingerprint(values: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


class RunCheckpointer:
    """Saves and restores one run through a CheckpointManager, with the resume self-check."""

    def __init__(
        self,
        config: Config,
        plan: RunPlan,
        engine: Engine,
        sampler: ResumableDistributedSampler,
        state: TrainState,
        trajectory: dict[str, Any],
        hf_files: HFFiles | None = None,
    ) -> None:
        self.config = config
        self.plan = plan
        self.manager = plan.manager
        self.engine = engine
        self.sampler = sampler
        self.state = state
        self.trajectory = trajectory
        self.hf_files = hf_files
        """A Hugging Face model's config and tokenizer files, for exports (None: not one)."""
        self.rng = RNGState()
        self.last_saved_step: int | None = None
        self.last_eval: tuple[int, dict[str, float]] | None = None
        """(step, metrics) of the latest evaluation; a save at that step records the metric."""
        self.extra_state: Callable[[], dict[str, Stateful]] = dict
        """More global entries (callbacks with state), asked for at every save and load."""
        self._pending_rng_check: str | None = None
        self._ended: list[SaveOutcome] = []

    def entries(self) -> dict[str, Entry]:
        # Order is restore order: the RNG comes last so nothing consumes it after the restore.
        self.rng.extra = {
            "worker_seed_inputs": {
                "seed": self.config.run.seed,
                "epoch": self.sampler.epoch,
                "rank": self.manager.rank,
            }
        }
        return {
            **{
                name: Entry(obj, elastic=getattr(obj, "elastic", False))
                for name, obj in self.engine.stateful().items()
            },
            "sampler": Entry(self.sampler),
            "train_state": Entry(self.state),
            **self._hf_entry(),
            **{name: Entry(obj) for name, obj in self.extra_state().items()},
            # On another number of ranks, rank r continues the stream of saved rank r mod W:
            # every rank is seeded alike (set_seed), so this keeps that convention.
            "rng": Entry(self.rng, per_rank=True, elastic=True),
        }

    def _hf_entry(self) -> dict[str, Entry]:
        if self.hf_files is None:
            return {}
        # Optional: checkpoints of a transformers model built by a factory predate the entry.
        return {HF_ENTRY: Entry(self.hf_files, optional=True)}

    def _checks(self) -> dict[str, Any]:
        return {
            "lr": self.engine.schedule.last_lr(),
            "next_sample_ids": self.sampler.upcoming(self.sampler.global_batch),
        }

    def _metric(self) -> dict[str, Any] | None:
        """The best_metric of an evaluation at this very step, for retention by metric."""
        name = self.config.checkpoint.best_metric
        if name is None or self.last_eval is None or self.last_eval[0] != self.state.global_step:
            return None
        metrics = self.last_eval[1]
        if name not in metrics:
            raise CheckpointError(
                f"checkpoint.best_metric: {name!r} is not among the evaluation metrics "
                f"({', '.join(sorted(metrics))})"
            )
        return {"name": name, "value": metrics[name]}

    # -- save ----------------------------------------------------------------------------------
    def save(self, final: bool = False) -> list[SaveOutcome]:
        """Checkpoint the current step. With async_save (and not `final`) this returns once
        the state is staged; the commit is reported by a later `poll`. Returns the saves that
        committed meanwhile; a failed save raises CheckpointSaveError."""
        entries = self.entries()
        rng_fp = rng_fingerprint(self.rng.state_dict())
        done = self.manager.save(
            self.state.global_step,
            entries,
            self.trajectory,
            fingerprint(self.trajectory),
            checks={**self._checks(), "metric": self._metric()},
            rank_checks={"rng": rng_fp},
            background=self.config.checkpoint.async_save and not final,
        )
        self.last_saved_step = self.state.global_step
        return _committed(done)

    def poll(self) -> tuple[list[SaveOutcome], bool]:
        """(background saves that committed since the last call, whether one failed)."""
        self._ended.extend(self.manager.poll())
        failed = any(o.error is not None for o in self._ended)
        if failed:
            return [], True
        done, self._ended = self._ended, []
        return done, False

    def raise_failure(self) -> None:
        """Some rank's background save failed: raise its error here too (every rank then
        stops at the same step)."""
        self._ended.extend(self.manager.wait("stopping"))
        for outcome in self._ended:
            if outcome.error is not None:
                raise outcome.error
        raise CheckpointSaveError("a background checkpoint save failed on another rank")

    def lease_lost(self) -> bool:
        """True once this job lost the run's lease (see checkpointing/lease.py)."""
        lease = self.manager.lease
        return lease is not None and not lease.confirm()

    def lease_lost_error(self, step: int) -> LeaseLost:
        """The error every rank raises once any rank learned the lease was lost."""
        lease = self.manager.lease
        why = lease.why_lost if lease is not None and lease.why_lost else "lost the run's lease"
        return LeaseLost(f"step {step}: {why}; this job writes nothing more to the run")

    def wait(self) -> list[SaveOutcome]:
        """Wait for the save in flight; the saves that committed (a failure is raised)."""
        return _committed(self.manager.wait("finishing"))

    def close(self, timeout: float) -> None:
        """On the way out after an error: give the save in flight up to `timeout` seconds to
        commit (a failure is logged; the run is failing already)."""
        for outcome in self.manager.wait("exiting", timeout=timeout):
            if outcome.error is not None:
                logger.error("%s", outcome.error)
            else:
                logger.info("checkpoint-%d committed before exit", outcome.step)

    # -- resume --------------------------------------------------------------------------------
    def restore(self) -> None:
        """Before the first step, with the run's lease held: clean what interrupted saves left,
        delete what run.overwrite replaces, load the planned checkpoint and check the result."""
        self.manager.clean_leftovers()
        if self.manager.rank == 0:
            for name in self.plan.stale:
                logger.info("run.overwrite: deleting %s", name)
                self.manager.delete(name)
        if self.plan.resume is None:
            return
        path, manifest = self.plan.resume
        self._check_trajectory(path, manifest.trajectory)
        self.manager.load(path, manifest, self.entries())
        now = self._checks()
        self._compare(path, "learning rate", manifest.checks["lr"], now["lr"])
        saved_ids, now_ids = manifest.checks["next_sample_ids"], now["next_sample_ids"]
        n = min(len(saved_ids), len(now_ids))  # older checkpoints recorded one micro-batch
        if n == 0:
            n = max(len(saved_ids), len(now_ids))  # nothing to compare is itself a difference
        self._compare(path, "next batch sample ids", saved_ids[:n], now_ids[:n])
        source = source_rank(self.manager.rank, manifest.world_size)
        self._pending_rng_check = manifest.checks["rng"][source]
        self.last_saved_step = manifest.step
        logger.info(
            "resumed from %s at step %d (epoch %d, position %d)",
            path.display(),
            self.state.global_step,
            self.sampler.epoch,
            self.sampler.position,
        )

    def load_best_model(self) -> None:
        """Load the model weights of the checkpoint with the best recorded metric."""
        best = self.manager.best()
        if best is None:
            logger.warning(
                "load_best_model_at_end: no checkpoint recorded %s; keeping the final weights",
                self.config.checkpoint.best_metric,
            )
            return
        where = self.manager.storage.child(best)
        model = self.engine.stateful()["model"]
        self.manager.load(where, read_manifest(where), {"model": Entry(model)})
        logger.info("loaded the best model (%s) from %s", self.config.checkpoint.best_metric, best)

    def check_rng(self) -> None:
        """Called right before the first resumed step: the RNG streams must be untouched."""
        if self._pending_rng_check is None:
            return
        expected, self._pending_rng_check = self._pending_rng_check, None
        actual = rng_fingerprint(self.rng.state_dict())
        if actual != expected:
            raise ResumeMismatchError(
                f"rank {self.manager.rank}: RNG state {actual} differs from the checkpoint's "
                f"{expected} (something consumed random numbers between restore and first step)"
            )

    def _check_trajectory(self, path: Storage, saved: dict[str, Any]) -> None:
        saved = {k: v for k, v in saved.items() if k != "train.samples_per_step"}
        saved = {**{k: v for k, v in ADDED.items() if k in self.trajectory}, **saved}
        saved["train.global_batch"] = saved_global_batch(saved)
        keys = sorted(set(saved) | set(self.trajectory))
        differ = [k for k in keys if saved.get(k) != self.trajectory.get(k)]
        before, now = saved.get("engine.name"), self.trajectory.get("engine.name")
        if "engine.name" in differ and crosses(before, now):
            # Model and optimizer state are complete and keyed by name under both engines.
            logger.info(
                "resuming a %s checkpoint under engine %s: state matched by name", before, now
            )
            differ = [k for k in differ if k not in ("engine.name", "engine.fsdp")]
        if "train.global_batch" not in differ:
            # The same global batch on other ranks (or after such a resume): fit_world_size
            # planned the accumulation; on other ranks the micro-batch may change too.
            allowed = ELASTIC_FIELDS | (
                {"train.per_device_batch_size"} if "world_size" in differ else set()
            )
            differ = [k for k in differ if k not in allowed]
        if not differ:
            return
        detail = ", ".join(f"{k} ({saved.get(k)!r} -> {self.trajectory.get(k)!r})" for k in differ)
        if self.config.checkpoint.allow_config_change:
            logger.warning("resuming %s with changed fields (allowed): %s", path.display(), detail)
            return
        raise CheckpointError(
            f"{path.display()}: the config differs in fields that change the trajectory: {detail}; "
            "set checkpoint.allow_config_change true to resume anyway"
        )

    def _compare(self, path: Storage, what: str, saved: Any, now: Any) -> None:
        if saved != now:
            raise ResumeMismatchError(
                f"{path.display()}: after loading, the {what} is {now!r} but the checkpoint "
                f"recorded {saved!r}; refusing to continue a wrong resume"
            )


def _committed(outcomes: list[SaveOutcome]) -> list[SaveOutcome]:
    """The committed ones; the first failure is raised."""
    for outcome in outcomes:
        if outcome.error is not None:
            raise outcome.error
    return outcomes

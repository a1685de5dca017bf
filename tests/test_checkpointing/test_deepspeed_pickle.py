"""A DeepSpeed checkpoint whose files carry pickles that run a command, with a manifest rewritten
so every size and hash matches, is refused: a resume exits 3 and `python -m checkpointing
export` exits 1, each with one line naming the file, and the command never runs (every DeepSpeed
file is read with torch.load(weights_only=True), through the checkpoint engine a resume gives
DeepSpeed; a resume is launched for one of the plants)."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from checkpointing.cli import main as export_main
from checkpointing.manifest import CheckpointCorruptError
from core.config import ConfigError
from tests.checkpoints import RunsCommand, rewrite_manifest_entry, seed_resume_dir
from tests.launch import REPO, SMALL, run_launcher

pytest.importorskip("deepspeed")

STEP = 4
ARGS = (
    *SMALL,
    "--engine.name",
    "deepspeed",
    "--train.max_steps",
    str(STEP),
    "--checkpoint.save_steps",
    str(STEP),
)
# Two runs hold every kind of file DeepSpeed writes (fp32 ZeRO 1-2 optimizer files are named
# as ZeRO-3's are, and ZeRO 1-2 model states as bf16 ZeRO-2's).
RUNS = {
    "zero3": ("--engine.deepspeed_config", str(REPO / "configs" / "deepspeed" / "zero3.json")),
    "bf16-zero2": (
        *("--engine.deepspeed_config", str(REPO / "configs" / "deepspeed" / "zero2.json")),
        *("--train.bf16", "true"),
    ),
}
# (run, file, how it is written). Rank 1's files are read by rank 1 alone when resuming.
PLANTS = [
    ("zero3", "zero_pp_rank_1_mp_rank_00_model_states.pt", "torch.save"),
    ("zero3", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "torch.save"),
    ("bf16-zero2", "mp_rank_00_model_states.pt", "pickle"),
    ("bf16-zero2", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "torch.save"),
]
# The plant a resume is launched on (a 2-rank DeepSpeed job): a file rank 1 alone reads (its
# refusal must stop rank 0 too). DeepSpeed reads model and optimizer files, bare pickles too,
# through the one checkpoint engine that a resume installs and every plant is refused by
# in-process.
LAUNCHED = {PLANTS[0][1]}


def plant(checkpoint: Path, name: str, how: str, marker: Path) -> Path:
    """Rewrite DeepSpeed's `name` in `checkpoint` to run a command when unpickled, and its
    manifest entry to match. torch.save: the real content with a RunsCommand beside it;
    pickle: a bare RunsCommand."""
    path = next(checkpoint.rglob(name))
    if how == "torch.save":
        state = torch.load(path, weights_only=False)  # our own file, just saved: trusted
        state["extra"] = RunsCommand(marker)
        torch.save(state, path)
    else:
        path.write_bytes(pickle.dumps(RunsCommand(marker)))
    rewrite_manifest_entry(checkpoint, path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for key, extra in RUNS.items():
        run_dir = tmp_path_factory.mktemp(key) / "run"
        result = run_launcher(run_dir, 2, *ARGS, *extra)
        assert result.returncode == 0, result.output
        out[key] = run_dir
    return out


def test_the_planted_file_runs_its_command_when_unpickled(tmp_path, runs):
    """The plant is real: a full unpickle (what DeepSpeed's own loader does) runs it."""
    seed_resume_dir(runs["zero3"], tmp_path / "run", STEP)
    marker = tmp_path / "MARKER"
    path = plant(tmp_path / "run" / f"checkpoint-{STEP}", PLANTS[0][1], "torch.save", marker)
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize(("key", "name", "how"), PLANTS, ids=[p[1] for p in PLANTS])
def test_a_planted_pickle_is_refused_and_never_runs(tmp_path, runs, key, name, how, capsys):
    run_dir = tmp_path / "run"
    seed_resume_dir(runs[key], run_dir, STEP)
    checkpoint = run_dir / f"checkpoint-{STEP}"
    marker = tmp_path / "MARKER"
    path = plant(checkpoint, name, how, marker)

    # `python -m checkpointing export`, in this process (a plant that ran would touch MARKER
    # here as well): its exit code and its one line.
    out = tmp_path / "w.safetensors"
    assert export_main(["export", str(checkpoint), str(out)]) == 1
    assert f"FAILED {path}: refused" in capsys.readouterr().err
    assert not out.exists() and not marker.exists()

    # DeepSpeed's checkpoint engine as a resume installs it (core/engines/deepspeed.py).
    from checkpointing.deepspeed_safe_load import WeightsOnlyCheckpointEngine

    with pytest.raises(CheckpointCorruptError, match="refused"):
        WeightsOnlyCheckpointEngine(zipfile_serialization=True).load(str(path), "cpu")
    assert not marker.exists()
    if name not in LAUNCHED:
        return
    result = run_launcher(run_dir, 2, *ARGS, *RUNS[key])
    # Every worker refuses the same file and exits 3; torchrun itself exits 1.
    assert result.returncode != 0 and "exitcode: 3" in result.output, result.output
    assert f"{path}: refused, it is not a DeepSpeed file" in result.output, result.output
    assert not marker.exists()


def test_every_file_deepspeed_writes_loads_with_the_allow_list_and_a_plant_does_not(tmp_path, runs):
    from checkpointing.deepspeed_safe_load import WeightsOnlyCheckpointEngine

    engine = WeightsOnlyCheckpointEngine(zipfile_serialization=True)
    for run_dir in runs.values():
        for path in sorted((run_dir / f"checkpoint-{STEP}").rglob("*.pt")):
            assert isinstance(engine.load(str(path), map_location="cpu"), dict), path
    seed_resume_dir(runs["zero3"], tmp_path / "run", STEP)
    marker = tmp_path / "MARKER"
    path = plant(tmp_path / "run" / f"checkpoint-{STEP}", PLANTS[1][1], "torch.save", marker)
    with pytest.raises(CheckpointCorruptError, match="posix.system") as e:
        engine.load(str(path), map_location="cpu")
    assert str(e.value).startswith(f"{path}: refused")
    assert not marker.exists()


def test_deepspeed_loads_through_the_weights_only_engine_or_refuses_to_start():
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from checkpointing.deepspeed_safe_load import WeightsOnlyCheckpointEngine
    from core.engines.deepspeed import _load_weights_only

    def engine(checkpoint_engine, universal=False):
        return SimpleNamespace(
            checkpoint_engine=checkpoint_engine,
            checkpoint_serialization_enabled=lambda: True,
            load_universal_checkpoint=lambda: universal,
        )

    ds = engine(TorchCheckpointEngine(None))
    _load_weights_only(ds)
    assert type(ds.checkpoint_engine) is WeightsOnlyCheckpointEngine
    assert ds.checkpoint_engine.zipfile_serialization  # saves as DeepSpeed's engine would
    with pytest.raises(ConfigError, match="checkpoint.writer"):
        _load_weights_only(engine(object()))
    with pytest.raises(ConfigError, match="load_universal"):
        _load_weights_only(engine(TorchCheckpointEngine(None), universal=True))

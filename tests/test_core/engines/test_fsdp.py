"""The FSDP engine: sharded checkpoints reload exactly on other numbers of ranks and across
engines (DDP -> FSDP -> DDP), random SIGKILLs end bit-identical to an uninterrupted run (bf16
with async saves), a resume on 3 ranks sees the very global batches of the 2-rank run,
and hostile or inconsistent files are refused (exit 3) without being executed.

Tolerance of a resume on another number of ranks: gradients are summed in another order (the
reduce-scatter of 3 ranks versus 2), so losses agree to float32 rounding; 1e-5 relative, as in
tests/test_elastic.py (whose header gives the measured figures).
"""

from __future__ import annotations

import json
import pickle
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpointing.cli import main as export_main
from checkpointing.manifest import CheckpointCorruptError, verify
from checkpointing.serialize import StateFormatError, json_bytes
from checkpointing.sharded import SavedState, read_entry
from checkpointing.storage import LocalStorage, Storage, open_storage
from core.config import ConfigError, load_config
from tests.checkpoints import (
    RunsCommand,
    assert_same_losses,
    assert_tensors_equal,
    exported,
    file_record,
    rewrite_manifest_entry,
    seed_resume_dir,
)
from tests.launch import (
    BIN,
    REPO,
    SMALL,
    kill_and_finish,
    read_metrics,
    refused_here,
    run,
    run_launcher,
)
from tests.test_elastic import sample_ids

STEPS = 16
ARGS = (
    *SMALL,
    *("--engine.name", "fsdp"),
    *("--train.max_steps", str(STEPS)),
    *("--train.per_device_batch_size", "6"),  # 2 x 6 x 2 = a global batch of 24: 3 divide it
    *("--train.gradient_accumulation_steps", "2"),
    *("--checkpoint.save_steps", "2"),
    *("--checkpoint.save_total_limit", "6"),
    *("--model.dropout", "0.0"),  # dropout masks depend on the rank that draws them
    *("--run.log_level", "debug"),  # the sample ids of every step
    # Evaluation on shards of unequal length (17 and 16 samples, batches of 4): every rank
    # must still call the sharded model equally often.
    *("--eval.strategy", "steps", "--eval.steps", "8", "--eval.holdout_samples", "33"),
    *("--eval.per_device_batch_size", "4", "--checkpoint.best_metric", "eval_loss"),
    *("--checkpoint.load_best_model_at_end", "true"),
)
BF16 = ("--train.bf16", "true", "--checkpoint.async_save", "true")
WORKER = REPO / "tests" / "fsdp_worker.py"


# ------------------------------------------------------------------------ pieces on disk


def _write_pieces(root: Path, full: torch.Tensor, rows: list[tuple[int, int]]) -> dict:
    """A sharded entry `t` of one tensor `w`, rank r holding rows[r] = (start, stop); returns
    the manifest's files for it."""
    files = {}
    for r, (first, stop) in enumerate(rows):
        base = f"t/rank-{r:05d}"
        (root / "t").mkdir(parents=True, exist_ok=True)
        save_file({"w": full[first:stop].contiguous()}, root / f"{base}.safetensors")
        piece = {"shape": list(full.shape), "offsets": [first, 0], "dtype": "F32"}
        desc = {"w": {"__piece__": {**piece, "tensor": {"__tensor__": "w"}}}}
        (root / f"{base}.json").write_bytes(json_bytes(desc))
        for ext in ("json", "safetensors"):
            data = (root / f"{base}.{ext}").read_bytes()
            files[f"{base}.{ext}"] = file_record(data)
    return files


def _open(root: Path, files: dict, n: int, where: Storage | None = None) -> SavedState:
    where = where or LocalStorage(root)
    return SavedState(where, files, [f"t/rank-{r:05d}" for r in range(n)], 0)


@pytest.mark.parametrize("store", ["local", "memory"])
def test_pieces_are_read_by_region_across_saved_ranks(tmp_path, store):
    """From a local file by safetensors slices; from an object store (fsspec memory://) each
    file fetched whole and checked against the manifest's hash."""
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    files = _write_pieces(tmp_path, full, [(0, 3), (3, 6), (6, 7)])
    where = None
    if store == "memory":
        where = open_storage(f"memory://pieces-{uuid.uuid4().hex[:8]}")
        for rel in files:
            where.write_bytes(rel, (tmp_path / rel).read_bytes())
    saved = _open(tmp_path, files, 3, where)
    out = torch.empty(4, 5)
    saved.read([(saved.structure["w"], (2, 0), out)])  # rows 2..5: three saved pieces
    assert torch.equal(out, full[2:6])
    assert torch.equal(saved.full()["w"], full)
    if store == "memory":  # an object changed after verification is caught as it is read
        rel = "t/rank-00001.safetensors"
        data = bytearray(where.read_bytes(rel))
        data[-1] ^= 1
        where.write_bytes(rel, bytes(data))
        with pytest.raises(StateFormatError, match="blake3 differs"):
            saved.full()


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        ([(0, 4), (3, 7)], "overlapping"),
        ([(0, 3), (4, 7)], "12 of 14"),
        ([(0, 4), (4, 8)], "outside"),
    ],
    ids=["overlap", "gap", "outside"],
)
def test_pieces_that_do_not_tile_the_tensor_are_refused(tmp_path, rows, why):
    full = torch.zeros(8, 2)
    files = _write_pieces(tmp_path, full, rows)
    # Describe a tensor of 7 rows, whatever the pieces hold.
    for r in range(len(rows)):
        js = tmp_path / f"t/rank-{r:05d}.json"
        js.write_text(js.read_text().replace("8,", "7,"))
    with pytest.raises(CheckpointCorruptError, match=rf"w: .*{why}"):
        _open(tmp_path, files, len(rows))


# ------------------------------------------------------------------------ state after a load


def _worker(cwd: Path, nproc: int, *args: str) -> None:
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", str(WORKER), *args]
    result = run(cmd, cwd=cwd, timeout=180)
    assert result.returncode == 0, result.output


def _assert_same_dump(cwd: Path, a: str, b: str) -> None:
    assert_tensors_equal(load_file(cwd / f"{a}.safetensors"), load_file(cwd / f"{b}.safetensors"))
    assert (cwd / f"{a}.json").read_text() == (cwd / f"{b}.json").read_text()


def test_state_after_load_equals_the_saved_state_on_any_ranks_and_engines(tmp_path):
    """Gathered right after loading, every parameter and optimizer tensor equals (torch.equal)
    what was saved: FSDP 2 -> 1, 2 -> 3 (sizes not divisible by 3), 1 -> 2, and the chain
    FSDP -> DDP -> FSDP -> DDP."""
    # One launch per rank count, its legs in order (fsdp_worker.py's --then).
    w = lambda n, *legs: _worker(tmp_path, n, *" --then ".join(legs).split())  # noqa: E731
    w(
        2,
        "fsdp --train --save A --dump a",
        "ddp --load A/checkpoint-7 --save B --dump b",
        "fsdp --load B/checkpoint-7 --save C --dump c",
    )
    w(
        1,
        "fsdp --load A/checkpoint-7 --dump a1",
        "ddp --load C/checkpoint-7 --dump d",
        "fsdp --train --save E --dump e",
    )
    w(3, "fsdp --load A/checkpoint-7 --dump a3")
    w(2, "fsdp --load E/checkpoint-7 --dump e2")
    for got in ("a1", "a3", "b", "c", "d"):
        _assert_same_dump(tmp_path, "a", got)
    _assert_same_dump(tmp_path, "e", "e2")


# ------------------------------------------------------------------------ whole runs


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, str]:
    ref = tmp_path_factory.mktemp("fsdp-ref") / "run"
    result = run_launcher(ref, 2, *ARGS)
    assert result.returncode == 0, result.output
    return ref, result.output


def assert_same_sharded(a: Path, b: Path, tmp: Path) -> None:
    """Exported weights, the whole optimizer state and the sampler/scheduler equal."""
    assert_tensors_equal(exported(a), exported(b), "model")
    ma, mb = verify(a), verify(b)
    assert_tensors_equal(
        read_entry(LocalStorage(a), ma, "optimizer"), read_entry(LocalStorage(b), mb, "optimizer")
    )
    for rel in ("scheduler.json", "sampler.json"):
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_bf16_with_async_saves_survives_sigkills_bit_identical(tmp_path):
    """Killed mid-save (a background write of this rank's shards) and mid-step. The shards go
    through the writers every engine uses (a kill mid-way through a save made inline is
    tests/test_interruptions.py's); what is FSDP's own, the sharded state and its reload, is
    the same in fp32 (the load-equals-save matrix above) and in bf16."""
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    result = run_launcher(ref, 2, *ARGS, *BF16)
    assert result.returncode == 0, result.output
    kill_and_finish(run_dir, (*ARGS, *BF16), {}, ["save", "step"], seed=1234)
    assert_same_losses(ref, run_dir)
    last = f"checkpoint-{STEPS}"
    assert_same_sharded(ref / last, run_dir / last, tmp_path)


def test_two_ranks_resume_on_three_with_the_same_batches_and_deterministically(tmp_path, reference):
    ref, ref_log = reference
    saved = 6
    runs = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        seed_resume_dir(ref, run_dir, saved)
        result = run_launcher(run_dir, 3, *ARGS, "--train.per_device_batch_size", "4")
        assert result.returncode == 0, result.output
        assert "global batch stays 24 (3 x 4 x 2 accumulation)" in result.output, result.output
        runs.append((run_dir, result.output))
    (a, a_log), (b, _) = runs
    assert_same_losses(a, b)
    last = f"checkpoint-{STEPS}"
    assert_same_sharded(a / last, b / last, tmp_path)
    expected, got = sample_ids(ref_log), sample_ids(a_log)
    assert sorted(got) == list(range(saved + 1, STEPS + 1))
    for step, ids in got.items():
        assert sorted(ids) == sorted(expected[step]), f"step {step} saw another global batch"
    losses = {m["step"]: m["loss"] for m in read_metrics(ref) if "loss" in m}
    for m in read_metrics(a):
        if "loss" in m:
            assert m["loss"] == pytest.approx(losses[m["step"]], rel=1e-5), m["step"]


@pytest.mark.parametrize(
    "rel", ["model/rank-00001.safetensors", "optimizer/rank-00000.json"], ids=["shard", "desc"]
)
def test_a_planted_pickle_is_refused_and_never_runs(tmp_path, reference, rel, capsys):
    ref, _ = reference
    run_dir, marker = tmp_path / "run", tmp_path / "MARKER"
    seed_resume_dir(ref, run_dir, STEPS)
    checkpoint = run_dir / f"checkpoint-{STEPS}"
    (checkpoint / rel).write_bytes(pickle.dumps(RunsCommand(marker)))
    rewrite_manifest_entry(checkpoint, checkpoint / rel)
    result = run_launcher(run_dir, 2, *ARGS, "--checkpoint.resume_from", str(checkpoint))
    assert result.returncode != 0 and "exitcode: 3" in result.output, result.output
    assert "refusing to load" in result.output, result.output
    if rel.startswith("model/"):
        out = tmp_path / "w.safetensors"
        assert export_main(["export", str(checkpoint), str(out)]) == 1  # the CLI, in-process
        assert f"FAILED {checkpoint / rel}: not a valid safetensors" in capsys.readouterr().err
        assert not out.exists()
    assert not marker.exists()


def test_descriptions_that_do_not_tile_a_tensor_are_refused(tmp_path, reference):
    ref, _ = reference
    run_dir = tmp_path / "run"
    seed_resume_dir(ref, run_dir, STEPS)
    checkpoint = run_dir / f"checkpoint-{STEPS}"
    desc = checkpoint / "model" / "rank-00001.json"
    state = json.loads(desc.read_text())
    state["wte.weight"]["__piece__"]["offsets"] = [100, 0]  # overlaps rank 0's rows
    desc.write_bytes(json_bytes(state))
    rewrite_manifest_entry(checkpoint, desc)
    result = run_launcher(run_dir, 2, *ARGS, "--checkpoint.resume_from", str(checkpoint))
    assert result.returncode != 0 and "exitcode: 3" in result.output, result.output
    assert "wte.weight: the saved pieces do not tile" in result.output, result.output


def test_a_wrap_class_the_model_lacks_is_a_usage_error(tmp_path):
    result = refused_here(
        tmp_path / "run", *SMALL, "--engine.name", "fsdp", "--engine.fsdp", "{wrap: [Nope]}"
    )
    assert result.returncode == 2, result.output
    assert "engine.fsdp.wrap: Nope matches no module of TinyGPT; its classes are: Block" in (
        result.output
    )


def test_fsdp_config_errors():
    with pytest.raises(ConfigError, match="engine.deepspeed_config: is for engine.name deepspeed"):
        load_config(None, ["--engine.name", "fsdp", "--engine.deepspeed_config", "{}"])
    with pytest.raises(ConfigError, match="engine.fsdp.shard: unknown key"):
        load_config(None, ["--engine.name", "fsdp", "--engine.fsdp", "{shard: 2}"])

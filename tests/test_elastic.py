"""Elastic resume: a checkpoint saved on W ranks continues on W' ranks with the same global stream
of samples (every sample of the epoch once, each optimizer step the same global batch as the
uninterrupted run), losses within float rounding, and deterministic; impossible changes are
refused with the numbers; and a two-"node" torchrun on loopback survives losing a node.

Tolerances: a run on another number of ranks sums the same per-sample gradients in another
order (two ranks' all-reduce versus two accumulated micro-batches), so results differ by float32
rounding, not bit for bit. Measured here: losses within 1.2e-7 relative, weights within 8e-6
absolute after 18 AdamW steps (Adam divides by sqrt(v), which magnifies rounding in parameters
whose v is tiny). The tests allow 1e-5 relative on losses and 1e-4 absolute on weights: three
orders above rounding, orders below what a wrong sample, a skipped step or a wrong learning rate
does (the loss moves by ~1e-2 per step here).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from checkpointing.manifest import (
    CheckpointCorruptError,
    CheckpointError,
    Manifest,
    read_manifest,
    verify,
)
from checkpointing.restore import Restorer
from checkpointing.storage import LocalStorage
from core.config import Config, load_config
from core.elastic import fit_world_size
from tests.checkpoints import (
    assert_same_checkpoint,
    assert_same_losses,
    exported,
    flip_byte,
    load_entry,
    seed_resume_dir,
)
from tests.conftest import free_port
from tests.launch import (
    BIN,
    REPO,
    SMALL,
    child_env,
    kill_tree,
    logged_steps,
    read_metrics,
    refused_here,
    run_launcher,
)

STEPS, SAVED = 30, 12
# 625 samples of 32 bytes; 8 per device: a global batch of 16 is 39 steps an epoch, so the run
# stops mid-epoch and the resume is mid-epoch too.
ARGS = (
    *SMALL,
    "--train.max_steps",
    str(STEPS),
    "--checkpoint.save_steps",
    str(SAVED),
    "--model.dropout",
    "0.0",  # dropout masks depend on which rank draws them: not comparable across layouts
    "--run.log_level",
    "debug",  # logs the sample ids every step drew
)
SEED, SAMPLES, GLOBAL_BATCH = 42, 625, 16
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-4


def sample_ids(output: str) -> dict[int, list[int]]:
    """{step: the ids all ranks drew for it} from a debug log."""
    steps = {}
    for m in re.finditer(r"step (\d+) sample ids (\[.*\])", output):
        steps[int(m.group(1))] = [i for rank in json.loads(m.group(2)) for i in rank]
    return steps


def epoch_prefix(steps: int) -> list[int]:
    """The first `steps` global batches of epoch 0, from the seed alone (torch's randperm)."""
    g = torch.Generator()
    g.manual_seed(SEED)
    return torch.randperm(SAMPLES, generator=g)[: steps * GLOBAL_BATCH].tolist()


def assert_accounted(before: dict[int, list[int]], after: dict[int, list[int]], ref) -> None:
    """Steps 1..SAVED from the first run, the rest from the resumed one: every sample of the
    epoch's prefix exactly once, and each step the very global batch of the uninterrupted run."""
    assert sorted(after) == list(range(SAVED + 1, STEPS + 1)), sorted(after)
    whole = [before[s] for s in range(1, SAVED + 1)] + [after[s] for s in sorted(after)]
    seen = [i for ids in whole for i in ids]
    assert len(seen) == len(set(seen)), "a sample was repeated"
    assert sorted(seen) == sorted(epoch_prefix(STEPS)), "a sample was skipped or foreign"
    for step, ids in after.items():
        assert sorted(ids) == sorted(ref[step]), f"step {step} saw another global batch"


def assert_close_run(ref: Path, res: Path, steps: int = STEPS) -> None:
    """Losses within LOSS_RTOL and final weights within WEIGHT_ATOL of the reference run's."""
    losses = {m["step"]: m["loss"] for m in read_metrics(ref) if "loss" in m}
    resumed = [m for m in read_metrics(res) if "loss" in m]  # not the eval records
    assert [m["step"] for m in resumed] == list(range(1, steps + 1))
    for m in resumed:
        assert m["loss"] == pytest.approx(losses[m["step"]], rel=LOSS_RTOL), m["step"]
    a = load_entry(ref / f"checkpoint-{steps}", "model")
    b = load_entry(res / f"checkpoint-{steps}", "model")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=WEIGHT_ATOL), k


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, str]:
    """The module's uninterrupted run on 2 ranks, and its output."""
    ref = tmp_path_factory.mktemp("two-ranks") / "ref"
    first = run_launcher(ref, 2, *ARGS)
    assert first.returncode == 0, first.output
    return ref, first.output


def test_two_ranks_resume_on_one(tmp_path, two_ranks):
    (ref, output), res = two_ranks, tmp_path / "res"
    seed_resume_dir(ref, res, SAVED)
    resumed = run_launcher(res, None, *ARGS)
    assert resumed.returncode == 0, resumed.output
    assert "gradient_accumulation_steps 1 -> 2 keeps the global batch at 16" in resumed.output
    assert "gradient_accumulation_steps: 2" in (res / "config.yaml").read_text()
    ref_ids = sample_ids(output)
    assert sorted(ref_ids) == list(range(1, STEPS + 1))
    assert_accounted(ref_ids, sample_ids(resumed.output), ref_ids)
    assert_close_run(ref, res)
    # A later restart on one rank with the same command keeps the global batch too, and is
    # exact from there (same ranks, same accumulation).
    again = tmp_path / "again"
    seed_resume_dir(res, again, 24)
    restarted = run_launcher(again, None, *ARGS)
    assert restarted.returncode == 0, restarted.output
    assert "gradient_accumulation_steps 1 -> 2 keeps the global batch at 16" in restarted.output
    assert_same_losses(res, again)
    assert_same_checkpoint(res / f"checkpoint-{STEPS}", again / f"checkpoint-{STEPS}")
    assert_written_in_shares(ref, tmp_path / "corrupt")


def assert_written_in_shares(ref: Path, scratch: Path) -> None:
    """Both ranks of a DDP run wrote half the model and optimizer bytes; a flipped byte in
    rank 1's part is named and the previous checkpoint is resumed instead."""
    final = ref / f"checkpoint-{STEPS}"
    files = read_manifest(LocalStorage(final)).files
    for name in ("model", "optimizer"):
        sizes = [files[f"{name}/rank-{r:05d}.safetensors"]["size"] for r in range(2)]
        assert max(sizes) / (sum(sizes) / 2) < 1.1, (name, sizes)
    shutil.copytree(ref, scratch, ignore=shutil.ignore_patterns("*.jsonl"))
    flip_byte(scratch / f"checkpoint-{STEPS}" / "optimizer" / "rank-00001.safetensors")
    with pytest.raises(CheckpointCorruptError, match=r"optimizer/rank-00001\.safetensors: blake3"):
        verify(scratch / f"checkpoint-{STEPS}")
    found = Restorer(LocalStorage(scratch), 0, 1, None, None).resolve("latest")
    assert found is not None and found[1].step == 24


def test_one_rank_resumes_on_two_deterministically(tmp_path):
    """Saved by 1 rank with 2 accumulation steps; resumed twice on 2 ranks: the two resumes
    are bit-identical to each other (rank 1 continues rank 0's RNG streams)."""
    ref, res, again = tmp_path / "ref", tmp_path / "res", tmp_path / "again"
    args = (*ARGS, "--train.gradient_accumulation_steps", "2")
    first = run_launcher(ref, None, *args)
    assert first.returncode == 0, first.output
    outputs = []
    for run_dir in (res, again):
        seed_resume_dir(ref, run_dir, SAVED)
        resumed = run_launcher(run_dir, 2, *args)
        assert resumed.returncode == 0, resumed.output
        assert "gradient_accumulation_steps 2 -> 1 keeps the global batch at 16" in resumed.output
        outputs.append(resumed.output)
    ref_ids = sample_ids(first.output)
    for output in outputs:
        assert_accounted(ref_ids, sample_ids(output), ref_ids)
    assert_close_run(ref, res)
    assert_same_losses(res, again)
    assert_same_checkpoint(res / f"checkpoint-{STEPS}", again / f"checkpoint-{STEPS}")


@pytest.mark.parametrize(
    ("saving", "resuming", "message"),
    [
        (
            (),
            ("--train.per_device_batch_size", "5"),
            "cannot keep the global batch of 16 samples: it is not a multiple of 1 ranks x 5",
        ),
        (
            (),
            ("--train.keep_global_batch", "false"),
            "the global batch would change from 16 to 8",
        ),
        (
            ("--data.drop_last", "false"),  # 625 samples: padded to 626 on 2 ranks, 625 on 1
            ("--data.drop_last", "false"),
            "sampler state is for an epoch of 626 samples, this run's epoch has 625",
        ),
    ],
)
def test_impossible_change_is_refused(tmp_path, two_ranks, saving, resuming, message):
    """On 1 rank from a checkpoint of 2: the module's run, or one saved with `saving`."""
    args, checkpoint = ARGS, two_ranks[0] / f"checkpoint-{SAVED}"
    if saving:
        ref = tmp_path / "ref"
        args = (*ARGS, "--train.max_steps", "4", "--checkpoint.save_steps", "2")
        assert run_launcher(ref, 2, *args, *saving).returncode == 0
        checkpoint = ref / "checkpoint-4"
    resume = ("--checkpoint.resume_from", str(checkpoint))
    result = refused_here(tmp_path / "res", *args, *resume, *resuming)
    assert result.returncode == 3, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def _manifest(world_size: int, engine: str = "ddp", **trajectory) -> Manifest:
    return Manifest(
        step=8,
        world_size=world_size,
        engine=engine,
        config_fingerprint="",
        files={},
        entries={},
        trajectory={"world_size": world_size, "dataset": "abc", **trajectory},
    )


def _config(**train) -> Config:
    config = load_config(REPO / "configs" / "tiny.yaml")
    return dataclasses.replace(config, train=dataclasses.replace(config.train, **train))


def test_fit_world_size_keeps_the_checkpoints_global_batch_on_the_same_ranks():
    """After a resume on other ranks the checkpoint's accumulation differs from the config's."""
    config = _config(per_device_batch_size=8, gradient_accumulation_steps=1)
    saved = _manifest(1, **{"train.global_batch": 16, "train.per_device_batch_size": 8})
    assert fit_world_size(config, saved, 1).train.gradient_accumulation_steps == 2
    off = dataclasses.replace(
        config, train=dataclasses.replace(config.train, keep_global_batch=False)
    )
    assert fit_world_size(off, saved, 1) is off  # the trajectory check then names the change


def test_fit_world_size_adjusts_only_what_it_must():
    saved = _manifest(4, **{"train.global_batch": 64})
    config = _config(per_device_batch_size=8, gradient_accumulation_steps=1)
    assert fit_world_size(config, None, 2) is config
    assert fit_world_size(config, _manifest(2, **{"train.global_batch": 16}), 2) is config
    assert fit_world_size(config, saved, 2).train.gradient_accumulation_steps == 4
    assert fit_world_size(config, saved, 8).train.gradient_accumulation_steps == 1
    # Checkpoints written before the global batch was recorded: derived from what was.
    old = _manifest(4, **{"train.per_device_batch_size": 8, "train.gradient_accumulation_steps": 2})
    assert fit_world_size(config, old, 1).train.gradient_accumulation_steps == 8


def _ds(stage: int, **optimizer) -> dict:
    ds = {"zero_optimization": {"stage": stage}}
    if optimizer:
        ds["optimizer"] = optimizer
    return {"train.global_batch": 16, "engine.deepspeed_config": ds}


@pytest.mark.parametrize(
    ("saved", "engine", "message"),
    [
        (_manifest(2, engine="deepspeed", **_ds(2)), "ddp", "saved by engine deepspeed"),
        (_manifest(2, engine="deepspeed", **_ds(3)), "deepspeed", "ZeRO-3 parameter group"),
        (_manifest(2, engine="deepspeed", **_ds(0)), "deepspeed", "ZeRO-0 shards cannot"),
        (
            _manifest(2, engine="deepspeed", **_ds(2, type="SGD")),
            "deepspeed",
            "hold Adam moments only",
        ),
        (_manifest(2, **{"train.global_batch": 16, "dataset": "stream:X"}), "ddp", "iterable"),
        (_manifest(2, **{"train.global_batch": 32}), "ddp", "ranks that divides 32"),
        (_manifest(2, **{"train.global_batch": 36}), "ddp", "3 ranks x 8 per device; set"),
    ],
)
def test_fit_world_size_refuses(saved, engine, message):
    config = _config(per_device_batch_size=8)
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, name=engine))
    with pytest.raises(CheckpointError, match=message):
        fit_world_size(config, saved, 3)


def test_fit_world_size_reshards_zero_1_and_2():
    config = _config(per_device_batch_size=8)
    config = dataclasses.replace(
        config, engine=dataclasses.replace(config.engine, name="deepspeed")
    )
    for stage in (1, 2):
        fitted = fit_world_size(config, _manifest(2, engine="deepspeed", **_ds(stage)), 1)
        assert fitted.train.gradient_accumulation_steps == 2


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed")
@pytest.mark.parametrize(("stage", "saved_on", "resumed_on"), [(2, 2, 1), (1, 1, 2)])
def test_deepspeed_zero_shards_reshard(tmp_path, stage, saved_on, resumed_on):
    """ZeRO 1-2 shards saved on one number of ranks load on another through a DeepSpeed
    universal checkpoint: the same sample stream, losses and consolidated weights within the
    tolerance above."""
    ds = ("--engine.name", "deepspeed", "--engine.deepspeed_config")
    args = (*ARGS, *ds, str(REPO / "configs" / "deepspeed" / f"zero{stage}.json"))
    args += ("--train.gradient_accumulation_steps", str(2 // saved_on))  # global batch 16
    ref, res = tmp_path / "ref", tmp_path / "res"
    first = run_launcher(ref, saved_on, *args)
    assert first.returncode == 0, first.output
    seed_resume_dir(ref, res, SAVED)
    resumed = run_launcher(res, resumed_on, *args)
    assert resumed.returncode == 0, resumed.output
    assert f"loaded ZeRO shards of {saved_on} rank(s) on {resumed_on}" in resumed.output
    ref_ids = sample_ids(first.output)
    assert_accounted(ref_ids, sample_ids(resumed.output), ref_ids)
    losses = {m["step"]: m["loss"] for m in read_metrics(ref)}
    for m in read_metrics(res):
        assert m["loss"] == pytest.approx(losses[m["step"]], rel=LOSS_RTOL), m["step"]
    a = exported(ref / f"checkpoint-{STEPS}")
    b = exported(res / f"checkpoint-{STEPS}")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=WEIGHT_ATOL), k


def _node(run_dir: Path, port: int, log: Path) -> subprocess.Popen:
    """One "node": torchrun with one worker, meeting the other through c10d on loopback."""
    cmd = [
        str(BIN / "torchrun"),
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=elastic-test",
        "-m",
        "launcher",
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        "--run.output_dir",
        str(run_dir),
        *NODE_ARGS,
    ]
    with log.open("a") as out:
        return subprocess.Popen(
            cmd,
            cwd=run_dir.parent,
            env=child_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


NODE_STEPS = 60
NODE_ARGS = (
    *SMALL,
    "--data.max_bytes",
    "40000",
    "--train.max_steps",
    str(NODE_STEPS),
    "--checkpoint.save_steps",
    "10",
)


def test_two_nodes_on_loopback_lose_a_node_and_resume(tmp_path):
    """Two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1) train one run; one node
    is killed (its agent and worker, SIGKILL) after a checkpoint; both are relaunched and the
    run ends bit-identical to an uninterrupted two-process run."""
    ref = tmp_path / "ref"
    assert run_launcher(ref, 2, *NODE_ARGS).returncode == 0
    run_dir, logs = tmp_path / "nodes", [tmp_path / "node0.log", tmp_path / "node1.log"]
    run_dir.mkdir()
    port = free_port()
    nodes = [_node(run_dir, port, log) for log in logs]
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoint-20").exists() or logged_steps(run_dir) < 23:
            assert time.monotonic() < deadline, "the two nodes never reached step 23"
            assert all(n.poll() is None for n in nodes), _read(logs)
            time.sleep(0.01)
        kill_tree(nodes[1])  # node loss: the agent and its worker
        try:
            nodes[0].wait(timeout=120)  # the survivor's collective fails; its agent gives up
        except subprocess.TimeoutExpired:
            kill_tree(nodes[0])
        assert nodes[0].returncode != 0
        assert logged_steps(run_dir) < NODE_STEPS
        port = free_port()
        nodes = [_node(run_dir, port, log) for log in logs]
        for node in nodes:
            assert node.wait(timeout=180) == 0, _read(logs)
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_tree(node)
    assert "resumed from" in _read(logs)
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, NODE_STEPS + 1))
    assert_same_losses(ref, run_dir)
    assert_same_checkpoint(ref / f"checkpoint-{NODE_STEPS}", run_dir / f"checkpoint-{NODE_STEPS}")


def _read(logs: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in logs)

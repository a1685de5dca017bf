"""engine.name: deepspeed on CPU (gloo, 2 processes): ZeRO stages 1-3 resume bit-identically
after a clean stop, SIGKILL at random moments (mid-save included) and SIGTERM; a corrupt
DeepSpeed shard is caught by the manifest and the previous checkpoint is used; the export of a
checkpoint equals the live model's weights. Losses are compared as logged floats and weights
with torch.equal on the consolidated (zero_to_fp32) state."""

from __future__ import annotations

import itertools
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpointing.cli import main as export_main
from checkpointing.manifest import list_checkpoints, read_manifest, verify
from core.config import ConfigError, load_config
from core.engines.deepspeed_config import resolve_deepspeed_config
from tests.checkpoints import (
    assert_same_losses,
    assert_tensors_equal,
    exported,
    flip_byte,
    seed_resume_dir,
)
from tests.conftest import free_port
from tests.launch import (
    REPO,
    SMALL,
    kill_tree,
    launcher_cmd,
    logged_steps,
    read_metrics,
    refused_here,
    run,
    run_launcher,
    saving,
    start,
    wait_for,
)
from tests.objectstore import S3Server

pytest.importorskip("deepspeed")

STEPS = 24  # an epoch is 19.5 steps here: step 20 holds one micro-batch, not two
STAGES = (1, 2, 3)


def ds_args(stage: int, *extra: str) -> tuple[str, ...]:
    return (
        *SMALL,
        "--engine.name",
        "deepspeed",
        "--engine.deepspeed_config",
        str(REPO / "configs" / "deepspeed" / f"zero{stage}.json"),
        "--train.max_steps",
        str(STEPS),
        "--train.gradient_accumulation_steps",
        "2",
        "--checkpoint.save_steps",
        "4",
        "--checkpoint.save_total_limit",
        "3",
        *extra,
    )


def assert_same_weights(a: Path, b: Path) -> None:
    """The consolidated fp32 weights of two checkpoints are equal, tensor by tensor."""
    assert_tensors_equal(exported(a), exported(b), "weights")


def finish_like(ref: Path, run_dir: Path, args: tuple[str, ...]) -> str:
    """Relaunch `run_dir` to the end; its losses and final consolidated weights must equal the
    uninterrupted `ref`'s. Returns the run's output."""
    result = run_launcher(run_dir, 2, *args)
    assert result.returncode == 0, result.output
    assert_same_losses(ref, run_dir)
    assert_same_weights(ref / f"checkpoint-{STEPS}", run_dir / f"checkpoint-{STEPS}")
    return result.output


@pytest.fixture(scope="module", params=STAGES, ids=lambda s: f"zero{s}")
def reference(request, tmp_path_factory) -> tuple[int, Path]:
    """An uninterrupted run per stage, through the worker that also saves the live model."""
    stage = request.param
    ref = tmp_path_factory.mktemp(f"ref-zero{stage}") / "run"
    ref.mkdir()
    args = ["--config", str(REPO / "configs" / "tiny.yaml"), "--run.output_dir", str(ref)]
    cmd = [*launcher_cmd(2, []), *args, *ds_args(stage)]
    cmd[cmd.index("launcher")] = "tests.ds_worker"
    cmd.insert(cmd.index("tests.ds_worker") + 1, str(ref / "live"))
    result = run(cmd, cwd=ref.parent)
    assert result.returncode == 0, result.output
    assert read_manifest(ref / f"checkpoint-{STEPS}").engine == "deepspeed"
    return stage, ref


def test_export_equals_the_live_model(reference, capsys):
    stage, ref = reference
    live = load_file(ref / "live" / "model.safetensors")
    assert_tensors_equal(exported(ref / f"checkpoint-{STEPS}"), live, f"zero{stage} export")
    # Export verifies before DeepSpeed unpickles anything: a flipped bit is refused.
    bad = ref.parent / "corrupt"
    shutil.copytree(ref / f"checkpoint-{STEPS}", bad)
    flip_byte(next(bad.rglob("*optim_states.pt")))
    assert export_main(["export", str(bad), str(bad / "w.safetensors")]) == 1  # in-process
    assert "blake3 differs" in capsys.readouterr().err
    assert not (bad / "w.safetensors").exists()
    # Sharded for real: every rank wrote its own optimizer partition.
    shards = sorted(p.name for p in (ref / f"checkpoint-{STEPS}" / "deepspeed").rglob("*.pt"))
    assert sum("optim_states" in s for s in shards) == 2, shards


# ZeRO-1 and 2 write the same files (a model file, an optimizer partition per rank): ZeRO-1
# stands for both under SIGKILLs; ZeRO-2's resume is the bf16 test's and the export test's.
@pytest.mark.parametrize("reference", [1, 3], indirect=True, ids=["zero1", "zero3"])
def test_sigkill_at_random_moments_including_mid_save(tmp_path, reference):
    stage, ref = reference
    run_dir = tmp_path / "run"
    rng = random.Random(stage)
    hits = 0
    for plan in ("save", "step"):
        proc = start(run_dir, 2, *ds_args(stage))
        if plan == "save":
            hit = wait_for(lambda: saving(run_dir), proc)
            time.sleep(rng.uniform(0, 0.02))
        else:
            target = logged_steps(run_dir) + rng.randint(2, 6)
            hit = wait_for(lambda t=target: logged_steps(run_dir) >= t, proc)
            time.sleep(rng.uniform(0, 0.05))
        kill_tree(proc)  # torchrun and every worker, by pid
        hits += hit
        for _, name in list_checkpoints(run_dir):
            verify(run_dir / name)  # a checkpoint-<step> that exists is always complete
    assert hits == 2, "the run ended before a kill: the test tested nothing"
    finish_like(ref, run_dir, ds_args(stage))


# The graceful stop's save is the loop's, the same for every stage (each stage's own save is
# under the SIGKILLs above): the stage that shards the most stands for all.
@pytest.mark.parametrize("reference", [3], indirect=True, ids=["zero3"])
def test_sigterm_commits_and_resumes_exactly(tmp_path, reference):
    stage, ref = reference
    run_dir = tmp_path / "run"
    args = ds_args(stage, "--checkpoint.save_steps", "0")
    proc = start(run_dir, 2, *args)
    try:
        assert wait_for(lambda: logged_steps(run_dir) >= 5, proc)
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert "preempted at step" in out, out
    (step, name), *_ = list_checkpoints(run_dir)
    path = run_dir / name
    assert 5 <= step < STEPS and verify(path).engine == "deepspeed"
    assert f"resumed from {path}" in finish_like(ref, run_dir, args)


# The manifest hashes DeepSpeed's files as it hashes any (each stage's exact resume from a
# committed checkpoint is the SIGKILL test's relaunch): ZeRO-3 stands for every stage.
@pytest.mark.parametrize("reference", [3], indirect=True, ids=["zero3"])
def test_corrupt_shard_is_caught_and_the_previous_checkpoint_used(tmp_path, reference):
    """Also the exact resume after a clean stop: the run continues from checkpoint-16."""
    stage, ref = reference
    run_dir = tmp_path / "run"
    seed_resume_dir(ref, run_dir, 16)
    shutil.copytree(ref / "checkpoint-20", run_dir / "checkpoint-20")
    # One bit, in the middle of rank 1's optimizer partition.
    flip_byte(next((run_dir / "checkpoint-20").rglob("zero_pp_rank_1_*optim_states.pt")))
    output = finish_like(ref, run_dir, ds_args(stage))
    assert "skipping checkpoint-20" in output and "blake3" in output
    assert f"resumed from {run_dir / 'checkpoint-16'}" in output


# -- single configurations ---------------------------------------------------------------------
def _ref_and_resume(tmp_path: Path, args: tuple[str, ...], step: int) -> tuple[Path, Path]:
    ref = tmp_path / "ref"
    result = run_launcher(ref, 2, *args)
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "run"
    seed_resume_dir(ref, run_dir, step)
    finish_like(ref, run_dir, args)
    return ref, run_dir


def test_bf16_zero2_with_deepspeeds_own_optimizer_and_schedule_resumes_exactly(tmp_path):
    """bf16 at ZeRO-2, with the optimizer and schedule named in the DeepSpeed config (its
    WarmupLR's state lives in DeepSpeed's own files): one run and its resume show both."""
    ds = (
        "{zero_optimization: {stage: 2}, optimizer: {type: AdamW, params: {lr: 0.001, "
        "torch_adam: true}}, scheduler: {type: WarmupLR, params: {warmup_num_steps: 10}}}"
    )
    args = ds_args(2, "--train.bf16", "true", "--engine.deepspeed_config", ds)
    ref, _ = _ref_and_resume(tmp_path, args, 16)
    # bf16 really ran: DeepSpeed keeps the module in bf16 (fp32 master weights in the shards).
    shards = ref / f"checkpoint-{STEPS}" / "deepspeed"
    module = torch.load(next(shards.rglob("mp_rank_00_model_states.pt")), weights_only=True)
    assert module["module"]["wte.weight"].dtype == torch.bfloat16
    # DeepSpeed's WarmupLR (log warmup to its default 0.001 over 10 steps) drove the lr, and
    # the resume restored it from DeepSpeed's own files: the lrs matched above.
    lrs = [m["lr"] for m in read_metrics(ref)]
    assert all(a <= b for a, b in itertools.pairwise(lrs)) and lrs[-1] == 0.001, lrs
    assert 0 < lrs[5] < 0.001, lrs
    assert "scheduler" not in read_manifest(ref / f"checkpoint-{STEPS}").entries


# -- config ------------------------------------------------------------------------------------
def _config(*overrides: str):
    return load_config(None, ["--engine.name", "deepspeed", *overrides])


def test_our_train_section_fills_the_deepspeed_config():
    cfg = _config(
        "--engine.deepspeed_config",
        str(REPO / "configs" / "deepspeed" / "zero3.json"),
        "--train.per_device_batch_size",
        "4",
        "--train.gradient_accumulation_steps",
        "3",
        "--train.max_grad_norm",
        "0.5",
        "--train.bf16",
        "true",
    )
    ds = resolve_deepspeed_config(cfg, world_size=2)
    assert ds["zero_optimization"] == {"stage": 3}
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 24
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True}


@pytest.mark.parametrize(
    ("inline", "message"),
    [
        ("{train_micro_batch_size_per_gpu: 32}", "train.per_device_batch_size gives 16"),
        ("{gradient_clipping: 5.0}", "train.max_grad_norm gives 1.0"),
        ("{bf16: {enabled: true}}", "set train.bf16 instead"),
        ("{fp16: {enabled: true}}", "fp16 is not supported"),
        ("{zero_optimization: {stage: 4}}", "zero_optimization.stage 4"),
        ("{scheduler: {type: WarmupLR}}", "needs the optimizer named there too"),
    ],
)
def test_a_conflicting_deepspeed_config_is_one_clear_error(inline, message):
    cfg = _config("--engine.deepspeed_config", inline)
    with pytest.raises(ConfigError, match="engine.deepspeed_config") as e:
        resolve_deepspeed_config(cfg, world_size=2)
    assert message in str(e.value)


def test_deepspeed_config_file_errors():
    with pytest.raises(ConfigError, match="engine.deepspeed_config: no such file"):
        _config("--engine.deepspeed_config", "missing.json")
    with pytest.raises(ConfigError, match="is for engine.name deepspeed"):
        load_config(None, ["--engine.deepspeed_config", "{zero_optimization: {stage: 1}}"])


def test_conflict_exits_2_from_the_launcher(tmp_path):
    """Refused before anything is built (the launcher's main in this process, see
    tests/launch.py:refused_here): the check does not wait for torchrun's workers."""
    result = refused_here(
        tmp_path / "run", *ds_args(1), "--engine.deepspeed_config", "{gradient_clipping: 3}"
    )
    assert result.returncode == 2, result.output
    assert "engine.deepspeed_config: gradient_clipping is 3" in result.output
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_single_process_without_torchrun_gets_a_clear_error(tmp_path):
    result = refused_here(tmp_path / "run", *ds_args(1))
    assert result.returncode == 2, result.output
    assert "engine.name: deepspeed runs under torchrun" in result.output


@pytest.mark.parametrize("reference", [2], indirect=True, ids=["zero2"])
def test_the_deepspeed_launcher_runs_the_same_job(tmp_path, reference):
    """`deepspeed --module launcher` (it appends --local_rank=N) trains what torchrun trains."""
    stage, ref = reference
    run_dir = tmp_path / "deepspeed"
    cmd = [
        *(str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2"),
        *("--master_port", str(free_port()), "--module", "launcher"),
        *("--config", str(REPO / "configs" / "tiny.yaml"), "--run.output_dir", str(run_dir)),
        *ds_args(stage),
    ]
    result = run(cmd, cwd=tmp_path)
    assert result.returncode == 0, result.output
    assert "--local_rank=1" in result.output
    assert_same_losses(ref, run_dir)
    assert_same_weights(ref / f"checkpoint-{STEPS}", run_dir / f"checkpoint-{STEPS}")


@pytest.mark.parametrize("reference", [2], indirect=True, ids=["zero2"])
def test_shards_go_through_an_object_store(tmp_path, reference):
    """ZeRO-2 with async saves to a real S3-compatible server (moto on 127.0.0.1): each rank
    uploads the shards DeepSpeed wrote into its local staging folder; a resume downloads and
    checks them. After a SIGTERM and a relaunch, the losses and the consolidated weights equal
    the uninterrupted local run's."""
    stage, ref = reference
    s3 = S3Server()
    try:
        url = s3.bucket("deepspeed") + "/run"
        run_dir = tmp_path / "run"
        remote = (*ds_args(stage), "--checkpoint.dir", url, "--checkpoint.async_save", "true")
        proc = start(run_dir, 2, *remote, env=s3.env())
        try:
            assert wait_for(lambda: logged_steps(run_dir) >= 10, proc)
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                kill_tree(proc)
        assert "preempted at step" in out, out
        result = run_launcher(run_dir, 2, *remote, env=s3.env())
        assert result.returncode == 0, result.output
        assert f"resumed from {url}/checkpoint-" in result.output
        assert_same_losses(ref, run_dir)
        local = tmp_path / "fetched"
        s3.fs().get(f"{url}/checkpoint-{STEPS}/", str(local), recursive=True)
        verify(local)  # every shard arrived whole
        assert_same_weights(ref / f"checkpoint-{STEPS}", local)
    finally:
        s3.stop()

"""Hugging Face models and tokenizers under torchrun (2 processes, gloo), from the ready configs
configs/hf-pretrain.yaml and configs/sft-chat.yaml with a tiny local Llama and tokenizer: the
pretraining run after random SIGKILLs (some mid-save), relaunched with the same command until
done, and the chat run resumed mid-epoch end bit-identical to the uninterrupted run (every logged
loss, model and optimizer with torch.equal); a ZeRO-3 or FSDP
run resumes exactly after a SIGKILL and its checkpoint exports (--hf) a model whose logits equal
the live one's. (ZeRO 1 and 2 keep a model file and an optimizer partition per rank whatever the
model: their resumes are tests/test_core/engines/test_deepspeed.py's, on TinyGPT.)
Tokenising runs on the first rank only; the others read its cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from checkpointing.cli import main as export_main
from tests.checkpoints import assert_same_checkpoint, assert_same_losses, seed_resume_dir
from tests.conftest import free_port
from tests.launch import (
    REPO,
    kill_and_finish,
    last_checkpoint,
    launch,
    launcher_cmd,
    read_metrics,
    run,
)

pytest.importorskip("transformers")

PRETRAIN = str(REPO / "configs" / "hf-pretrain.yaml")
SFT = str(REPO / "configs" / "sft-chat.yaml")
STEPS = 24


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> dict[str, str]:
    """datasets' cache for every run of this module (as on one machine): a temp dir."""
    return {"HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("hf_datasets_cache"))}


def pretrain_args(assets) -> tuple[str, ...]:
    """configs/hf-pretrain.yaml at test size: the tiny local Llama and tokenizer."""
    return (
        "--config",
        PRETRAIN,
        "--model.name",
        f"hf:{assets.llama}",
        "--data.tokenizer",
        f"hf:{assets.tokenizer}",
        "--data.source",
        str(assets.text),
        "--data.num_proc",
        "2",
        "--data.seq_len",
        "32",
        "--train.per_device_batch_size",
        "4",
        "--train.gradient_accumulation_steps",
        "1",
        "--train.max_steps",
        str(STEPS),
        "--train.logging_steps",
        "1",
        "--checkpoint.save_steps",
        "3",
    )


def sft_args(assets) -> tuple[str, ...]:
    """configs/sft-chat.yaml at test size: 3 epochs of 118 conversations, accumulation 4."""
    return (
        "--config",
        SFT,
        "--model.name",
        f"hf:{assets.llama}",
        "--data.tokenizer",
        f"hf:{assets.tokenizer}",
        "--data.source",
        str(assets.chat),
        "--data.num_proc",
        "1",
        "--data.seq_len",
        "96",
        "--train.per_device_batch_size",
        "2",
        "--train.logging_steps",
        "1",
        "--checkpoint.save_steps",
        "3",
    )


@pytest.fixture(scope="module")
def pretrain_ref(hf_assets, cache, tmp_path_factory) -> Path:
    ref = tmp_path_factory.mktemp("pretrain") / "ref"
    output = launch(ref, pretrain_args(hf_assets), cache)
    assert "LlamaForCausalLM" in output and "token vocabulary" in output
    return ref


def test_hf_pretrain_config_trains_and_resumes_bit_identically_after_sigkills(
    hf_assets, cache, pretrain_ref, tmp_path
):
    run_dir = tmp_path / "run"
    kill_and_finish(run_dir, pretrain_args(hf_assets), cache, ["save", "step"], seed=19)
    assert_same_losses(pretrain_ref, run_dir)
    assert_same_checkpoint(last_checkpoint(pretrain_ref), last_checkpoint(run_dir))


def test_sft_chat_config_with_accumulation_resumes_bit_identically(hf_assets, cache, tmp_path):
    """Resumed from step 9, in its second epoch (SIGKILLs of an HF run: the pretraining test's;
    what this config adds is the chat data, its masks and accumulation 4)."""
    args = (*sft_args(hf_assets), "--checkpoint.save_total_limit", "null")  # keep checkpoint-9
    ref = tmp_path / "ref"
    output = launch(ref, args, cache)
    assert "train_on assistant" in output
    run_dir = tmp_path / "run"
    seed_resume_dir(ref, run_dir, 9)
    assert f"resumed from {run_dir / 'checkpoint-9'}" in launch(run_dir, args, cache)
    assert [m["epoch"] for m in read_metrics(ref)][8] > 1  # step 9 is in the second epoch
    assert_same_losses(ref, run_dir)
    assert_same_checkpoint(last_checkpoint(ref), last_checkpoint(run_dir))


# -- DeepSpeed ----------------------------------------------------------------------------------


def sharded_args(assets, *engine: str) -> tuple[str, ...]:
    """A short pretraining run with accumulation, fp32, under a sharding engine."""
    return (
        *pretrain_args(assets),
        "--train.max_steps",
        "12",
        "--train.gradient_accumulation_steps",
        "2",
        "--train.bf16",
        "false",  # exports hold the fp32 master weights: compare like with like
        "--checkpoint.save_steps",
        "4",
        *engine,
    )


def ds_args(assets, stage: int) -> tuple[str, ...]:
    config = str(REPO / "configs" / "deepspeed" / f"zero{stage}.json")
    return sharded_args(assets, "--engine.name", "deepspeed", "--engine.deepspeed_config", config)


@pytest.mark.parametrize("engine", ["zero3", "fsdp"])
def test_sharded_engine_resumes_after_sigkill_and_exports_the_live_model(
    hf_assets, cache, tmp_path, engine
):
    """ZeRO-3 and FSDP (wrapping LlamaDecoderLayer, the model's _no_split_modules)."""
    from transformers import AutoModelForCausalLM

    if engine == "zero3":
        pytest.importorskip("deepspeed")
        args = ds_args(hf_assets, 3)
    else:
        args = sharded_args(hf_assets, "--engine.name", "fsdp")
    ref = tmp_path / "ref"
    ref.mkdir()
    cmd = launcher_cmd(2, ["--run.output_dir", str(ref), *args])
    cmd[cmd.index("launcher")] = "tests.ds_worker"  # trains as the launcher does, then save_model
    cmd.insert(cmd.index("tests.ds_worker") + 1, str(tmp_path / "live"))
    result = run(cmd, tmp_path, env=cache)
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "run"
    kill_and_finish(run_dir, args, cache, ["step"], seed=3)
    assert_same_losses(ref, run_dir)
    exported = tmp_path / "export"
    # The CLI in this process, as tests/test_core/models/test_hf_models.py runs it.
    assert export_main(["export", str(run_dir / "checkpoint-12"), str(exported), "--hf"]) == 0
    ids = torch.arange(5, 37).reshape(2, 16)
    out = []
    for path in (exported, tmp_path / "live"):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            out.append(model(input_ids=ids).logits)
    assert torch.equal(*out)


# -- tokenising once ------------------------------------------------------------------------


MODES = ("builds", "differs", "fails")


def _build_worker(rank: int, port: int, tmp: str, assets, results) -> None:
    """Each of MODES in turn, in one process group (its own cache directory per mode)."""
    import datasets
    import torch.distributed as dist

    from core.config import DataConfig
    from core.data import DataError, build_dataset, dataset_fingerprint
    from core.data.ranks import check_same_data, main_process_first
    from core.data.tokenizers import HFTokenizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    encode = HFTokenizer.encode
    try:
        for mode in MODES:
            cache_dir = Path(tmp) / mode / "cache"
            datasets.config.HF_DATASETS_CACHE = cache_dir
            source = str(assets.text)
            if mode == "differs" and rank == 1:  # this node's copy of the file is another
                source = str(cache_dir.parent / "other.txt")
                cache_dir.parent.mkdir(parents=True, exist_ok=True)
                Path(source).write_text("a checkpoint keeps every state\n" * 80)
            cfg = DataConfig(source=source, tokenizer=f"hf:{assets.tokenizer}", seq_len=32)
            if rank == 1 and mode == "builds":

                def refuse(*args, **kwargs):
                    raise AssertionError("rank 1 tokenised instead of reading rank 0's cache")

                HFTokenizer.encode = refuse  # this process only, for this mode
            if mode == "fails" and rank == 0:
                cfg = DataConfig(source=source, tokenizer="hf:/no/such/tokenizer")
            try:
                ds = main_process_first(lambda cfg=cfg: build_dataset(cfg), rank, rank)
                check_same_data(dataset_fingerprint(ds), rank)
                results[(mode, rank)] = len(ds)
            except DataError as e:
                results[(mode, rank)] = f"DataError: {e}"
            finally:
                HFTokenizer.encode = encode
    finally:
        dist.destroy_process_group()


def test_the_first_rank_tokenises_and_the_others_read_its_cache(hf_assets, tmp_path):
    """`builds`: rank 1 reads rank 0's cache (its tokenizer would raise); `differs`: ranks that
    built other samples stop before training; `fails`: rank 0's error stops rank 1 too, no hang
    (one pair of processes runs the three in turn: a failed build leaves the group usable)."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _build_worker,
            args=(free_port(), str(tmp_path), hf_assets, results),
            nprocs=2,
            start_method="spawn",
        )  # joins both
        got = dict(results)
    assert got[("builds", 0)] == got[("builds", 1)] > 100
    assert got[("differs", 0)] == (
        "DataError: data: another rank built other samples than rank 0 (see its log)"
    )
    assert got[("differs", 1)].startswith("DataError: data: rank 1 built other samples than rank 0")
    assert got[("fails", 0)].startswith("DataError: data.tokenizer: no such directory")
    assert got[("fails", 1)] == (
        "DataError: data: building the datasets failed on another rank (see its log)"
    )

"""Exactness on a GPU, run by hand on a CUDA machine (not by pytest):

    python tests/gpu_check.py [pretrain_bf16 | pretrain_bf16_full_determinism | sft_chat_gc_bf16
                               | pretrain_bf16_async]

configs/hf-pretrain.yaml and configs/sft-chat.yaml with the tiny local Llama and tokenizer on one
device (torchrun, nccl on CUDA): a reference run of 30 steps (Trainer.save_model at the end) and a
run resumed from its checkpoint-10; losses and model/optimizer state compared with torch.equal,
and the --hf export's logits against the live model's. One JSON line per check.
"""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))
import torch

from tests.checkpoints import assert_same_checkpoint, seed_resume_dir
from tests.hf_assets import make_assets
from tests.launch import read_metrics

ROOT = Path("/tmp/gpu_check")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
shutil.rmtree(ROOT, ignore_errors=True)
A = make_assets(ROOT / "assets")


def torchrun(module: str, *args: str, timeout: int = 300) -> tuple[int, str, float]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
        module,
        *args,
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0


def report(name: str, **kw) -> None:
    print(json.dumps({"check": name, **kw}), flush=True)


COMMON = [
    "--model.name",
    f"hf:{A.llama}",
    "--data.tokenizer",
    f"hf:{A.tokenizer}",
    "--train.logging_steps",
    "1",
    "--train.progress_bar",
    "never",
    "--checkpoint.save_steps",
    "10",
    "--train.max_steps",
    "30",
    "--data.num_proc",
    "4",
    "--checkpoint.save_total_limit",
    "5",
]
PRETRAIN = [
    "--config",
    "configs/hf-pretrain.yaml",
    *COMMON,
    "--data.source",
    str(A.text),
    "--data.seq_len",
    "64",
    "--train.per_device_batch_size",
    "8",
    "--train.gradient_accumulation_steps",
    "2",
    "--run.report_to",
    "[jsonl]",
]
SFT = [
    "--config",
    "configs/sft-chat.yaml",
    *COMMON,
    "--data.source",
    str(A.chat),
    "--data.seq_len",
    "96",
    "--train.per_device_batch_size",
    "4",
    "--train.num_epochs",
    "null",
]


def exactness(name: str, args: list[str]) -> None:
    ref = ROOT / name / "ref"
    code, out, secs = torchrun(
        "tests.ds_worker", str(ROOT / name / "live"), "--run.output_dir", str(ref), *args
    )
    if code != 0:
        report(name, ok=False, stage="ref", tail=out[-3000:])
        return
    run = ROOT / name / "resumed"
    seed_resume_dir(ref, run, 10)
    code, out2, _ = torchrun("launcher", "--run.output_dir", str(run), *args)
    if code != 0:
        report(name, ok=False, stage="resume", tail=out2[-3000:])
        return
    la = [(m["step"], m["loss"]) for m in read_metrics(ref)]
    lb = [(m["step"], m["loss"]) for m in read_metrics(run)]
    same_losses = la == lb
    try:
        assert_same_checkpoint(ref / "checkpoint-30", run / "checkpoint-30")
        same_state = True
        why = ""
    except AssertionError as e:
        same_state, why = False, str(e)[:300]
    diffs = [abs(a[1] - b[1]) for a, b in zip(la, lb, strict=False)]
    report(
        name,
        ok=same_losses and same_state,
        losses_equal=same_losses,
        state_equal=same_state,
        max_loss_diff=max(diffs) if diffs else None,
        why=why,
        ref_seconds=round(secs, 1),
        device=[ln for ln in out.splitlines() if "device cuda" in ln][:1],
    )
    # Export from the checkpoint vs the live model save_model wrote: logits on the GPU.
    exported = ROOT / name / "export"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "checkpointing",
            "export",
            str(ref / "checkpoint-30"),
            str(exported),
            "--hf",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if p.returncode != 0:
        report(name + "_export", ok=False, tail=(p.stdout + p.stderr)[-2000:])
        return
    from transformers import AutoModelForCausalLM

    ids = torch.arange(3, 67, device=DEV).reshape(2, 32)
    logits = []
    for path in (exported, ROOT / name / "live"):
        m = AutoModelForCausalLM.from_pretrained(path).to(DEV).eval()
        with torch.no_grad():
            logits.append(m(input_ids=ids).logits)
    report(
        name + "_export",
        ok=bool(torch.equal(*logits)),
        max_abs_diff=float((logits[0] - logits[1]).abs().max()),
    )


import transformers  # noqa: E402

report(
    "versions",
    torch=torch.__version__,
    transformers=transformers.__version__,
    cuda=torch.cuda.get_device_name(0) if DEV == "cuda" else "none",
)
CHECKS = {
    "pretrain_bf16": PRETRAIN,
    "pretrain_bf16_full_determinism": [*PRETRAIN, "--run.full_determinism", "true"],
    "sft_chat_gc_bf16": SFT,
    # Saves staged into pinned buffers on a side stream (checkpointing/staging.py): the resumed
    # run starts from a checkpoint-10 that must hold step 10's state, not step 11's.
    "pretrain_bf16_async": [*PRETRAIN, "--checkpoint.async_save", "true"],
}
for name, args in CHECKS.items():
    if len(sys.argv) == 1 or name in sys.argv[1:]:
        exactness(name, args)

"""Against the Hugging Face Trainer on a Hugging Face model: steps/s of `python -m launcher`
training a tiny Llama against `transformers.Trainer` training the same.

Built here, nothing downloads: a byte-level BPE (bench/tokenize_throughput.py's, trained on the
first `--train-mb` MB of the stdlib corpus) and a `LlamaConfig` of `--hidden` x `--layers` with
the tokenizer's vocabulary, initialised after `torch.manual_seed(0)` and written with
`save_pretrained` (tokenizer beside it). Both sides then run configs/tiny.yaml with
`model.name hf:<dir>`, `model.pretrained true` and `data.tokenizer hf:<dir>`: the same weights,
the same packed dataset (`core.data.build_dataset`, collated by `core.data.collate`), batch
size, AdamW parameter groups (`core.optim.build_optimizer`, handed to the Trainer as
`optimizers=` with the LambdaLR of `core.schedules.build_schedule`), clipping at 1.0 and a loss
sync every step (both log every step). The Trainer takes its samples in the launcher's order
(the sampler's first epoch), so the first losses are comparable: `same_losses_first_steps`
and `max_abs_loss_diff` over the first `--check` steps.

Each run is a fresh subprocess (bench/peers.py's helpers), alternating, `--reps` times;
steps/s over the steps after the first 10%, medians. Figure `vs_trainer_hf`: ratio ours /
theirs (target >= 1).

    .venv/bin/python bench/peers_hf.py [--steps 300] [--reps 3] [--hidden 64] [--layers 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import detail, figure  # noqa: E402
from bench.loop_overhead import CONFIG, run_side, steady_rates  # noqa: E402
from bench.peers import WARMUP, peer_run  # noqa: E402
from bench.tokenize_throughput import corpus_lines, make_tokenizer  # noqa: E402


def make_llama(out: Path, hidden: int, layers: int) -> dict:
    """A tiny LlamaForCausalLM over the tokenizer saved in `out`, saved beside it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    return {"hidden": hidden, "layers": layers, "vocab": len(tok), "params": n_params}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--reps", type=int, default=3, help="runs of each side, alternating")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for both sides")
    p.add_argument("--check", type=int, default=10, help="leading losses compared")
    p.add_argument("--hidden", type=int, default=64, help="Llama hidden size")
    p.add_argument("--layers", type=int, default=2, help="Llama layers")
    p.add_argument("--vocab", type=int, default=8000, help="BPE vocabulary size")
    p.add_argument("--train-mb", type=float, default=5.0, help="MB the BPE is trained on")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="data.max_bytes (stdlib)")
    args = p.parse_args()
    if importlib.util.find_spec("transformers") is None:
        detail("peers_hf_skipped", why="transformers not installed: pip install .[bench]")
        return 0

    start = time.perf_counter()
    losses: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {"ours": [], "trainer": []}
    with tempfile.TemporaryDirectory(prefix="peers_hf_") as tmp:
        # Children inherit it (child_env copies the environment): no side reads or fills the
        # user's datasets cache.
        os.environ["HF_DATASETS_CACHE"] = str(Path(tmp, "datasets"))
        model_dir = make_tokenizer(Path(tmp, "llama"), corpus_lines(args.train_mb), args.vocab)
        model = make_llama(model_dir, args.hidden, args.layers)
        overrides = ["--model.name", f"hf:{model_dir}", "--model.pretrained", "true"]
        overrides += ["--data.tokenizer", f"hf:{model_dir}"]
        overrides += ["--data.max_bytes", str(args.max_bytes)]
        for rep in range(args.reps):
            for side in ("ours", "trainer") if rep % 2 == 0 else ("trainer", "ours"):
                if side == "ours":
                    run = run_side("ours", args.steps, args.threads, extra=overrides)
                else:
                    run = peer_run("trainer", args.steps, args.threads, overrides, same_order=True)
                losses.setdefault(side, run[0])
                rates[side].append(steady_rates(run[1], WARMUP)[0])
                detail("peers_hf_run", side=side, rep=rep, steps_per_s=round(rates[side][-1], 3))
    k = min(args.check, args.steps)
    first = {side: values[:k] for side, values in losses.items()}
    diffs = [abs(a - b) for a, b in zip(first["ours"], first["trainer"], strict=True)]
    ratios = [a / b for a, b in zip(rates["ours"], rates["trainer"], strict=True)]
    ours, theirs = statistics.median(rates["ours"]), statistics.median(rates["trainer"])
    figure(
        "vs_trainer_hf",
        round(ours, 3),
        "steps/s",
        ratio_to="transformers.Trainer, same Llama weights, data order, optimizer, schedule, batch",
        ratio=round(statistics.median(ratios), 4),
        config={
            "model": f"llama {model['layers']} x {model['hidden']}, vocab {model['vocab']}",
            "params": model["params"],
            "data": f"{CONFIG} data, stdlib {args.max_bytes} bytes, hf tokenizer",
            "steps": args.steps,
            "reps": args.reps,
            "threads": args.threads,
            "same_losses_first_steps": first["ours"] == first["trainer"],
            "max_abs_loss_diff": max(diffs),
            "compared_steps": k,
        },
        theirs_steps_per_s=round(theirs, 3),
        ratio_of_medians=round(ours / theirs, 4),
        ours_all=[round(r, 3) for r in rates["ours"]],
        theirs_all=[round(r, 3) for r in rates["trainer"]],
        first_losses={side: [round(x, 6) for x in v[:3]] for side, v in first.items()},
        wall_s=round(time.perf_counter() - start, 1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

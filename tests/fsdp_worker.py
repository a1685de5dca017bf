"""A torchrun worker for the FSDP state tests: build a TinyGPT under an engine, train two steps
or load a checkpoint, optionally save one, and dump the gathered full state (rank 0).

    torchrun ... tests/fsdp_worker.py ENGINE --train | --load CKPT [--save DIR] --dump FILE
                                      [--then ENGINE ... ]

Each `--then` starts another leg in the same processes (a fresh model and engine, the same
process group), so one launch checks several loads.

The dump is the whole model and the optimizer state by parameter name, gathered from every
rank (`<FILE>.safetensors`, and the param groups in `<FILE>.json`), so tests compare the state
right after a load with the state that was saved, whatever the engines and rank counts.
Sizes are odd on purpose: 22-wide layers and 256 vocab rows do not split evenly over 3 ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from checkpointing.comm import control_group
from checkpointing.manager import CheckpointManager
from checkpointing.manifest import read_manifest
from checkpointing.stateful import Entry
from core.config import OptimConfig
from core.engines.ddp import DDPEngine
from core.engines.fsdp import FSDPEngine
from core.engines.named_state import param_names, to_names
from core.models.tiny_gpt import TinyGPT
from core.optim import build_optimizer
from core.schedules import build_schedule
from launcher.dist import destroy_distributed, exit_worker

DEVICE = torch.device("cpu")
OPTIM = OptimConfig(name="adamw_torch", lr=1e-2, weight_decay=0.1)


def engine(name: str, seed: int):
    torch.manual_seed(seed)  # another seed for a loading run: nothing equal by chance
    model = TinyGPT(n_layer=2, n_head=2, n_embd=22, block_size=16, dropout=0.0)

    def schedule(opt):
        return build_schedule(opt, "linear", 10, 2, 0.0, {})

    if name == "fsdp":
        return FSDPEngine(model, lambda m: build_optimizer(m, OPTIM, DEVICE), schedule, DEVICE)
    opt = build_optimizer(model, OPTIM, DEVICE)
    return DDPEngine(model, opt, schedule(opt), DEVICE)


def train(eng, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        ids = torch.randint(0, 256, (4, 16), generator=g)
        for i in range(2):  # two micro-batches: accumulation without sync, then with
            with eng.accumulate(sync=i == 1):
                eng.backward(eng.forward({"input_ids": ids, "labels": ids}), 2)
        eng.optimizer_step(1.0)


def dump(eng, name: str, out: Path) -> None:
    if name == "fsdp":
        full = StateDictOptions(full_state_dict=True)
        model = get_model_state_dict(eng.model, options=full)
        optim = get_optimizer_state_dict(eng.model, eng.optimizer, options=full)
    else:
        model = eng.model.state_dict()
        optim = to_names(eng.optimizer.state_dict(), param_names(eng.model, eng.optimizer))
    if dist.get_rank() != 0:
        return
    tensors = {f"model/{k}": v.detach().clone() for k, v in model.items()}
    for fqn, per in optim["state"].items():
        for key, v in per.items():
            tensors[f"optim/{fqn}/{key}"] = v.detach().clone()
    save_file(tensors, f"{out}.safetensors")
    Path(f"{out}.json").write_text(json.dumps(optim["param_groups"], sort_keys=True))


def run(args: argparse.Namespace) -> None:
    eng = engine(args.engine, seed=0 if args.train else 1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.train:
        train(eng)
    entries = {name: Entry(obj) for name, obj in eng.stateful().items()}
    if args.load:
        manager = CheckpointManager(Path(args.load).parent, rank, world, group=control_group())
        manager.load(manager.storage.child(Path(args.load).name), read_manifest(args.load), entries)
    if args.save:
        manager = CheckpointManager(
            args.save, rank, world, engine=args.engine, group=control_group()
        )
        manager.save(7, entries, {}, "test", checks={}, rank_checks={})
    dump(eng, args.engine, Path(args.dump))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("engine", choices=["ddp", "fsdp"])
    p.add_argument("--train", action="store_true")
    p.add_argument("--load")
    p.add_argument("--save")
    p.add_argument("--dump", required=True)
    legs, leg = [], []
    for arg in sys.argv[1:]:
        if arg == "--then":
            legs, leg = [*legs, leg], []
        else:
            leg.append(arg)
    legs = [p.parse_args(a) for a in [*legs, leg]]
    dist.init_process_group("gloo")  # torchrun's environment
    for args in legs:
        run(args)  # returns holding nothing: the teardown below destroys the groups themselves
    destroy_distributed(clean=True)


if __name__ == "__main__":
    main()
    exit_worker(0)

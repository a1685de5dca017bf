"""Reading the files DeepSpeed's `save_checkpoint` wrote inside one of our checkpoints.

A checkpoint of engine `deepspeed` holds one directory entry: DeepSpeed's save_dir, with its
shards under one tag sub-directory. Call these only on a checkpoint `verify` has passed; every
shard is then read with `torch.load(weights_only=True)` (checkpointing/deepspeed_safe_load.py),
so a file that would run code when unpickled is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from checkpointing.manifest import CheckpointError, Manifest


def deepspeed_tag_dir(path: Path, manifest: Manifest) -> Path:
    """`<checkpoint>/<entry>/<tag>/`: where the shards of a verified checkpoint lie."""
    names = [n for n, kind in manifest.entries.items() if kind == "directory"]
    if len(names) != 1:
        raise CheckpointError(f"{path}: expected one DeepSpeed directory entry, found {names}")
    tags = sorted(p for p in (path / names[0]).iterdir() if p.is_dir())
    if len(tags) != 1:
        raise CheckpointError(f"{path / names[0]}: expected one tag directory, found {tags}")
    return tags[0]


def universal_copy(tag_dir: Path, out_dir: Path) -> None:
    """Convert the verified shards in `tag_dir` into a DeepSpeed universal checkpoint at
    `out_dir` (DeepSpeed's ds_to_universal, in this process, every torch.load in it forced to
    weights_only=True): what DeepSpeed loads on a different number of ranks. The converter
    also writes `latest_universal` beside `out_dir`."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint import ds_to_universal

    from checkpointing.deepspeed_safe_load import weights_only_torch_loads

    args = argparse.Namespace(
        input_folder=str(tag_dir),
        output_folder=str(out_dir),
        num_extract_workers=1,  # no process pool inside a training worker
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # a plain nn.Module carries no universal_checkpoint_info
    )
    with weights_only_torch_loads(tag_dir), contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal.main(args)  # its progress goes to stdout: kept out of the run's log


def deepspeed_weights(path: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a verified DeepSpeed checkpoint: ZeRO 1-3 shards consolidated by
    DeepSpeed's own zero_to_fp32 (exact: it concatenates the fp32 partitions); without ZeRO,
    the module state DeepSpeed saved whole. A shard that pickles more than DeepSpeed's tensors
    and plain state is a CheckpointCorruptError naming it; nothing in it runs."""
    from checkpointing.deepspeed_safe_load import (
        check_deepspeed_files,
        load_deepspeed_file,
        weights_only_torch_loads,
    )

    tag_dir = deepspeed_tag_dir(path, manifest)
    check_deepspeed_files(tag_dir)  # names the file a refusal inside zero_to_fp32 would not
    if any(tag_dir.glob("*zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # zero_to_fp32 calls torch.load(weights_only=False) itself and takes no loader, and its
        # consolidation of already loaded dicts is private: torch's own switch forces its loads
        # to weights_only=True, with the same allow-list.
        with weights_only_torch_loads(tag_dir):
            return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    # Stage 0 in fp32: the module's state is saved whole by rank 0.
    state = load_deepspeed_file(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu")
    return {k: v.float() if v.is_floating_point() else v for k, v in state["module"].items()}

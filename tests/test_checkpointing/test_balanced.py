"""checkpointing.balanced: replicated state (DDP's model and optimizer) written in shares of
equal bytes, read back whole from any number of them. The multi-process runs (tests/test_resume,
tests/test_elastic, tests/test_core/engines/test_fsdp) save and load this layout through the
launcher."""

from __future__ import annotations

import pytest
import torch

from checkpointing.balanced import row_ranges, share
from checkpointing.digest import FileDigest
from checkpointing.encoding import Share
from checkpointing.serialize import save_state
from checkpointing.sharded import SavedState
from checkpointing.stateful import rank_name
from checkpointing.storage import LocalStorage
from core.models.tiny_gpt import TinyGPT
from tests.checkpoints import assert_tensors_equal


def model_and_adam() -> dict:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def odd_state() -> dict:
    """Tied views, a 0-dim tensor, an empty one, a 1-row tensor, several dtypes, values."""
    emb = torch.randn(50, 6)
    return {
        "emb": emb,
        "head": emb,  # tied: one tensor under two names
        "bias": torch.arange(7, dtype=torch.int64),
        "row": torch.randn(1, 300, dtype=torch.float64),
        "half": torch.randn(9, 2, 3).to(torch.bfloat16),
        "empty": torch.empty(0, 4),
        "step": torch.tensor(5.0),
        "groups": [{"lr": 0.1, "params": [0, 1]}],
        3: (1, "x", None),
    }


def write_shares(root, state, world: int) -> SavedState:
    storage = LocalStorage(root)
    files: dict = {}
    for r in range(world):
        digests: dict[str, FileDigest] = save_state(
            storage, rank_name("e", r), share(state, r, world)
        )
        files.update({rel: d.record() for rel, d in digests.items()})
    return SavedState(storage, files, [rank_name("e", r) for r in range(world)], 0)


def share_bytes(state, rank: int, world: int) -> int:
    """Bytes of rank's pieces, each distinct view once (tied weights are written once)."""
    views = {}

    def walk(node):
        if isinstance(node, Share):
            views[(node.local.data_ptr(), tuple(node.local.shape))] = node.local
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list | tuple):
            for v in node:
                walk(v)

    walk(share(state, rank, world))
    return sum(t.numel() * t.element_size() for t in views.values())


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shares_read_back_whole_and_exact(tmp_path, world):
    state = odd_state()
    saved = write_shares(tmp_path, state, world)
    back = saved.full()
    assert_tensors_equal(back, state)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_each_rank_writes_about_one_wth_of_the_bytes(world):
    """Within one row of total / W: the figure save_bytes_per_rank measures on a real save."""
    state = model_and_adam()
    sizes = [share_bytes(state, r, world) for r in range(world)]
    ranges = row_ranges(state, world)
    assert all(len(r) == world for r in ranges.values())
    total = sum(sizes)
    tensors = [*state["model"].values()]
    widest_row = max(t.numel() // t.shape[0] * t.element_size() for t in tensors if t.dim())
    assert max(sizes) <= total / world + widest_row, sizes
    assert max(sizes) / (total / world) < 1.1, sizes


def test_tied_views_share_one_split_and_are_written_once(tmp_path):
    state = odd_state()
    for r in range(3):
        s = share(state, r, 3)
        assert s["emb"].offsets == s["head"].offsets
        assert s["emb"].local.data_ptr() == s["head"].local.data_ptr()
    saved = write_shares(tmp_path, state, 3)
    assert torch.equal(saved.full()["head"], state["emb"])


def test_a_share_of_another_state_is_refused(tmp_path):
    """Every rank must cut the same state: pieces of two different states do not tile."""
    a, b = odd_state(), odd_state()
    b["bias"] = torch.arange(9, dtype=torch.int64)
    storage = LocalStorage(tmp_path)
    files: dict = {}
    for r, st in enumerate((a, b)):
        digests = save_state(storage, rank_name("e", r), share(st, r, 2))
        files.update({rel: d.record() for rel, d in digests.items()})
    with pytest.raises(Exception, match="bias"):
        SavedState(storage, files, [rank_name("e", r) for r in range(2)], 0)

"""The resumable distributed sampler: coverage, determinism, O(1) jumps, state round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from core.data.sampler import ResumableDistributedSampler


def make(n=103, world=1, rank=0, batch=4, seed=0, **kw):
    return ResumableDistributedSampler(n, world, rank, batch, seed, **kw)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_disjoint_and_complete_with_padding(world):
    n = 103
    per_rank = [list(make(n, world, r, drop_last=False)) for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1  # every rank the same count
    flat = [i for p in per_rank for i in p]
    assert set(flat) == set(range(n))  # complete
    assert len(flat) == -(-n // world) * world  # padded only up to a multiple of the world


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_disjoint_with_drop_last(world):
    n, batch = 103, 4
    per_rank = [list(make(n, world, r, batch=batch)) for r in range(world)]
    flat = [i for p in per_rank for i in p]
    assert len(flat) == len(set(flat))  # disjoint, no duplicates
    assert len(flat) == (n // (batch * world)) * batch * world


def test_same_seed_and_epoch_same_order_other_epoch_differs():
    a, b = make(seed=5), make(seed=5)
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b)
    b.set_epoch(4)
    assert list(a) != list(b)
    c = make(seed=6)
    c.set_epoch(3)
    assert list(a) != list(c)


def test_global_order_is_interleaved_by_rank():
    world = 3
    order = make(world=world, drop_last=False).epoch_order()
    for r in range(world):
        assert list(make(world=world, rank=r, drop_last=False)) == order[r::world].tolist()


@pytest.mark.parametrize("position", [0, 4, 40, 96])
def test_jump_to_position(position):
    world = 2
    full = [list(make(world=world, rank=r)) for r in range(world)]
    for r in range(world):
        s = make(world=world, rank=r)
        s.advance(position)
        assert list(s) == full[r][position // world :]
        assert len(s) == len(full[r]) - position // world


class RecordingDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n, self.fetched = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.fetched.append(i)
        return i


def test_jump_fetches_no_skipped_sample():
    """A resumed DataLoader fetches only the samples after the position."""
    world, batch, n = 2, 10, 10_000
    s = make(n=n, world=world, rank=1, batch=batch)
    expected_rest = list(s)[4_990:]
    s.advance(9_980)
    ds = RecordingDataset(n)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, sampler=s)
    got = [int(i) for b in loader for i in b]
    assert ds.fetched == got == expected_rest


def test_state_round_trip_through_json():
    s = make(world=2, rank=1, seed=9)
    s.set_epoch(2)
    s.advance(16)
    state = json.loads(json.dumps(s.state_dict()))
    t = make(world=2, rank=1, seed=0)
    t.load_state_dict(state)
    assert (t.epoch, t.position, t.seed) == (2, 16, 9)
    assert list(t) == list(s)


def test_state_refuses_other_dataset_size():
    s = make(n=100)
    with pytest.raises(ValueError, match="for 100 samples, the dataset has 50"):
        make(n=50).load_state_dict(s.state_dict())


def test_length_grouping_sorts_within_megabatches_and_keeps_coverage():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 64, size=500).tolist()
    s = make(n=500, batch=4, lengths=lengths, drop_last=False)
    order = s.epoch_order()
    assert sorted(order.tolist()) == list(range(500))
    mega = 4 * 50
    first = [lengths[i] for i in order[:mega]]
    assert first == sorted(first, reverse=True)
    plain = make(n=500, batch=4, drop_last=False).epoch_order()
    assert set(order[:mega].tolist()) == set(plain[:mega].tolist())  # same shuffle, regrouped


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        make(n=5, world=2, batch=4)


@pytest.mark.parametrize("grouped", [False, True])
def test_epoch_is_the_same_on_any_ranks_with_the_same_global_batch(grouped):
    """Global batch 16 as 4 ranks x 4, 2 ranks x 4 x 2 accumulation, 1 rank x 8 x 2: the
    same epoch (length cut in whole steps, length-grouped megabatches) and the same step
    contents, so a resume on another number of ranks continues the same stream."""
    n = 1003
    lengths = np.random.default_rng(1).integers(2, 64, size=n).tolist() if grouped else None
    layouts = [(4, 4, 1), (2, 4, 2), (1, 8, 2)]
    orders = []
    for world, batch, accumulation in layouts:
        samplers = [
            make(n, world, r, batch, seed=3, accumulation=accumulation, lengths=lengths)
            for r in range(world)
        ]
        assert samplers[0].total_size == (n // 16) * 16
        orders.append(samplers[0].epoch_order().tolist())
        # Step 7 (all ranks' micro-batches of it) is global entries [7 * 16, 8 * 16).
        for s in samplers:
            s.advance(7 * 16)
        drawn = [i for s in samplers for i in list(s)[: batch * accumulation]]
        assert sorted(drawn) == sorted(orders[-1][7 * 16 : 8 * 16])
    assert orders[0] == orders[1] == orders[2]


def test_state_refuses_an_epoch_of_another_length():
    s = make(n=103, world=2, batch=4)  # 96 samples an epoch
    with pytest.raises(ValueError, match="epoch of 96 samples, this run's epoch has 100"):
        make(n=103, world=1, batch=4).load_state_dict(s.state_dict())


def test_state_from_before_the_global_batch_cut_is_checked_against_its_own_cut():
    """A state written before the epoch was cut in whole optimizer steps (no total_size):
    1003 samples in micro-batches of 8 were 1000 an epoch; in steps of 8 x 5 they are 1000 too
    (accepted), in steps of 8 x 3 they are 984 (refused: not another epoch layout)."""
    old = make(n=1003, batch=8).state_dict()
    del old["total_size"]
    make(n=1003, batch=8, accumulation=5).load_state_dict(old)
    with pytest.raises(ValueError, match="epoch of 1000 samples, this run's epoch has 984"):
        make(n=1003, batch=8, accumulation=3).load_state_dict(old)

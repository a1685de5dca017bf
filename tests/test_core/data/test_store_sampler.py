"""The order of a token store's epoch: the Feistel permutation (a seeded bijection over [0, n),
uniform enough to shuffle) and the bijective sampler (the same global order on any number of
ranks, every sample once, exact resume, O(1) memory at a trillion samples)."""

from __future__ import annotations

import json
import time
import tracemalloc

import numpy as np
import pytest

from core.data.permutation import FeistelPermutation
from core.data.sampler import BijectiveSampler, ResumableDistributedSampler


# -- the permutation --------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 4097, 10**5])
@pytest.mark.parametrize("key", [(0,), (1, 0), (1, 1), (-1,), (2**63 + 5, 7)])
def test_feistel_is_a_deterministic_bijection(n, key):
    perm = FeistelPermutation(n, *key)
    image = perm(np.arange(n))
    assert image.dtype == np.int64
    assert np.array_equal(np.sort(image), np.arange(n))
    assert np.array_equal(FeistelPermutation(n, *key)(np.arange(n)), image)
    a, b = n // 3, n // 3 + min(n - n // 3, 97)  # any slice, computed on its own
    assert np.array_equal(perm(np.arange(a, b)), image[a:b])
    assert np.array_equal(perm(np.arange(n)[::-1]), image[::-1])
    with pytest.raises(IndexError):
        perm(np.array([n]))


def test_feistel_refuses_empty_and_huge_domains():
    with pytest.raises(ValueError):
        FeistelPermutation(0, 1)
    with pytest.raises(ValueError):
        FeistelPermutation(2**62 + 1, 1)


def test_feistel_keys_give_unrelated_orders():
    n = 1000
    keys = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (0,), (0, 0, 0)]
    orders = [FeistelPermutation(n, *k)(np.arange(n)) for k in keys]
    for i in range(len(orders)):
        for j in range(i):
            agree = np.mean(orders[i] == orders[j])
            assert agree < 0.02, (keys[i], keys[j], agree)  # about 1/n for unrelated orders
    assert np.mean(orders[0] == np.arange(n)) < 0.02  # not the identity either


def chi2(values: np.ndarray, n: int, bins: int = 10) -> float:
    counts = np.bincount(values * bins // n, minlength=bins)
    expected = len(values) / bins
    return float(((counts - expected) ** 2 / expected).sum())


def test_feistel_looks_uniform():
    # Over 2000 keys: where element 0 lands and what index 0 maps to are uniform over
    # [0, n) (9 degrees of freedom: 40 is p < 1e-5).
    n, keys = 1000, range(2000)
    position = np.array(
        [np.flatnonzero(FeistelPermutation(n, k)(np.arange(n)) == 0)[0] for k in keys]
    )
    assert chi2(position, n) < 40
    image = np.array([FeistelPermutation(n, k)(np.array([0]))[0] for k in keys])
    assert chi2(image, n) < 40
    walked = np.array([FeistelPermutation(4097, k)(np.array([4096]))[0] for k in keys])
    assert chi2(walked, 4097) < 40  # cycle walking in a domain 4x the size: no bias either
    # One order: no trace of the index in the image, nor of neighbours in each other.
    m = 10**5
    order = FeistelPermutation(m, 42)(np.arange(m))
    assert abs(np.corrcoef(np.arange(m), order)[0, 1]) < 0.02
    assert abs(np.corrcoef(order[:-1], order[1:])[0, 1]) < 0.02
    assert np.mean(np.abs(np.diff(order)) <= 2) < 0.001
    assert abs(np.mean(order[: m // 2] < m // 2) - 0.5) < 0.02


# -- the bijective sampler --------------------------------------------------------------------
def interleave(samplers: list) -> list[int]:
    """The global order from the ranks' own iterators (rank r takes every world-th entry)."""
    per_rank = [list(s) for s in samplers]
    assert len({len(p) for p in per_rank}) == 1
    return [i for group in zip(*per_rank, strict=True) for i in group]


def ranks(n: int, world: int, global_batch: int, seed: int = 7, **kw: object) -> list:
    return [BijectiveSampler(n, world, r, global_batch // world, seed, **kw) for r in range(world)]


def test_bijective_order_does_not_depend_on_the_world_size():
    n, g = 1000, 12
    orders = [interleave(ranks(n, world, g)) for world in (1, 2, 3)]
    assert orders[0] == orders[1] == orders[2]
    assert len(orders[0]) == n // g * g == 996  # whole global batches
    assert len(set(orders[0])) == 996 and set(orders[0]) <= set(range(n))
    assert orders[0] == ranks(n, 1, g)[0].upcoming(996)
    assert orders[0] != sorted(orders[0])  # shuffled
    assert interleave(ranks(n, 2, g, seed=8)) != orders[0]


def test_bijective_epoch_holds_every_sample_exactly_once():
    n, g = 1008, 12  # a whole number of global batches: nothing dropped
    epochs = []
    for epoch in range(3):
        samplers = ranks(n, 3, g)
        for s in samplers:
            s.set_epoch(epoch)
        order = interleave(samplers)
        assert sorted(order) == list(range(n))
        epochs.append(order)
    assert epochs[0] != epochs[1] != epochs[2]
    assert interleave(ranks(n, 2, g, shuffle=False)) == list(range(n))
    padded = interleave(ranks(1000, 3, 12, drop_last=False))  # wraps to a multiple of 3
    assert len(padded) == 1002 and set(padded) == set(range(1000))
    assert padded[1000:] == padded[:2]


def test_bijective_resume_continues_the_same_ids_on_any_world_size():
    n, g = 1000, 12
    first = ranks(n, 1, g, seed=3)[0]
    first.set_epoch(2)
    whole = list(first)
    first.advance(120)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint holds
    assert list(first) == whole[120:]
    for world in (1, 2, 3):
        samplers = ranks(n, world, g, seed=99)  # the seed comes from the state
        for s in samplers:
            s.load_state_dict(state)
        assert interleave(samplers) == whole[120:]
        assert samplers[0].upcoming(24) == whole[120:144]
    with pytest.raises(ValueError, match="num_samples"):
        ranks(n + 1, 1, g)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="total_size"):
        ranks(n, 1, 8)[0].load_state_dict(state)


def test_sampler_kinds_refuse_each_other_state():
    bijective = BijectiveSampler(1000, 1, 0, 12, 3)
    plain = ResumableDistributedSampler(1000, 1, 0, 12, 3)
    with pytest.raises(ValueError, match="token store"):
        plain.load_state_dict(bijective.state_dict())
    with pytest.raises(ValueError, match="permuted dataset"):
        bijective.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="length"):
        BijectiveSampler(1000, 1, 0, 12, 3, lengths=[16] * 1000)


def test_bijective_sampler_at_a_trillion_samples_needs_no_array():
    n, world = 10**12 + 7, 4
    tracemalloc.start()
    start = time.perf_counter()
    sampler = BijectiveSampler(n, world, 1, 8, 5)
    sampler.set_epoch(3)
    sampler.advance(sampler.total_size - 320)  # 10 global batches before the end
    upcoming = sampler.upcoming(320)
    mine = list(sampler)
    resumed = BijectiveSampler(n, world, 1, 8, 0)
    resumed.load_state_dict(sampler.state_dict())
    again = list(resumed)
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 5 and peak < 16 << 20, (elapsed, peak)
    assert len(set(upcoming)) == 320 and all(0 <= i < n for i in upcoming)
    assert mine == again == upcoming[1::world] and len(sampler) == 80
    sample = FeistelPermutation(n, 5, 3)(np.arange(n - 10**5, n))  # injective on a window
    assert len(np.unique(sample)) == 10**5 and sample.max() < n

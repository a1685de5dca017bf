"""A seeded bijection over [0, n) computed per index: the epoch order of a token store.

`torch.randperm(n)` holds n int64s (8 GB for a billion blocks) and costs O(n) at every epoch
start and every resume. A Feistel network over the smallest even number of bits that covers n is
a permutation of [0, 2^bits) for any round function; cycle walking (re-applying it while the
value is >= n) restricts it to a permutation of [0, n), since the cycle through any x < n returns
to values < n. The domain is less than 4n, so a walk takes fewer than 4 applications on average.
Memory is O(1) in n and any slice of the order is computed on its own, vectorised in NumPy.

The round function is the splitmix64 finaliser of (right half XOR round key), which mixes every
input bit into every output bit; six rounds (three per half) make the order look uniform for
shuffling purposes (tests/test_store_sampler.py measures it). This is not cryptography.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (multiplications wrap mod 2^64)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """`perm(indices)`: where each index of [0, n) goes, for a bijection keyed by the integers
    `key` (e.g. seed and epoch)."""

    def __init__(self, n: int, *key: int) -> None:
        if n <= 0:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        if n > 2**62:
            raise ValueError(f"n = {n} exceeds 2^62")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = np.uint64((1 << self.half) - 1)
        seeds = np.random.SeedSequence([k & (2**64 - 1) for k in (*key, n)])
        self.keys = [np.uint64(k) for k in seeds.generate_state(ROUNDS, dtype=np.uint64)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = x >> shift, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << shift) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        x = np.asarray(indices, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"index {int(x.max())} out of range for a permutation of {self.n}")
        y = self._encrypt(x)
        outside = np.flatnonzero(y >= np.uint64(self.n))
        while outside.size:  # cycle walking
            y[outside] = self._encrypt(y[outside])
            outside = outside[y[outside] >= np.uint64(self.n)]
        return y.astype(np.int64)

"""A resumable distributed sampler: a seeded permutation of the global index space, sliced by rank.

torch's DistributedSampler cannot resume mid-epoch without iterating the skipped indices, and its
state is implicit. Ours has an explicit `position` (global samples consumed in the epoch), so a
resume jumps to any batch in O(1) batches fetched: the epoch's permutation is recomputed from the
stored generator state (the same O(N) work at any position) and iteration starts at `position`.

Order: rank r takes `order[position + r], order[position + r + world], ...`. Interleaving keeps
the global order independent of the rank count: one global micro-batch is `world * batch_size`
consecutive entries of `order`, and optimizer step s consumes entries
`[s * G, (s + 1) * G)` with G = world * batch_size * accumulation (the global batch). The epoch
(its length with drop_last, its length-grouped megabatches) is cut in units of G, never of the
world size, so a resume on another number of ranks with the same global batch continues the
very same stream of samples (see docs/elastic.md).
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from core.data.permutation import FeistelPermutation

# Megabatches of this many global batches (optimizer steps) are sorted by length when grouping
# (as the Hugging Face LengthGroupedSampler does with its mega_batch_mult).
MEGABATCH_MULT = 50


class ResumableDistributedSampler(Sampler[int]):
    """Yields this rank's dataset indices for the current epoch, starting at `position`.

    The loop calls `advance(n)` with the global number of samples it has consumed (all ranks,
    whole micro-batches) and `set_epoch(e)` at every epoch start; `state_dict()` is then enough
    to continue at the exact next batch.
    """

    def __init__(
        self,
        num_samples: int,
        num_replicas: int,
        rank: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        lengths: Sequence[int] | None = None,
        accumulation: int = 1,
    ) -> None:
        if num_samples <= 0:
            raise ValueError("the dataset is empty")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} out of range for {num_replicas} replicas")
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError("lengths must have one entry per sample")
        self.num_samples = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.lengths = np.asarray(lengths, dtype=np.int64) if lengths is not None else None
        self.global_batch = batch_size * num_replicas * accumulation
        """Samples of one optimizer step, all ranks together."""
        if drop_last:
            # Whole optimizer steps only: the epoch is the same on any number of ranks that
            # keeps the global batch.
            self.total_size = (num_samples // self.global_batch) * self.global_batch
            if self.total_size == 0:
                raise ValueError(
                    f"the dataset has {num_samples} samples, fewer than one global batch "
                    f"({batch_size} x {num_replicas} ranks x {accumulation} accumulation "
                    "steps); lower the batch size or set data.drop_last: false"
                )
        else:
            # Pad by wrapping around so every rank sees the same number of samples.
            self.total_size = -(-num_samples // num_replicas) * num_replicas
        self.epoch = 0
        self.position = 0
        self._generator_state = self._seeded_state(0)
        self._order: np.ndarray | None = None  # the epoch's order, computed once per epoch

    # -- epoch and position -------------------------------------------------------------------
    def _seeded_state(self, epoch: int) -> torch.Tensor:
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return g.get_state()

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first sample."""
        self.epoch = epoch
        self.position = 0
        self._generator_state = self._seeded_state(epoch)
        self._order = None

    def advance(self, num_global_samples: int) -> None:
        """Record that all ranks together consumed this many more samples of the epoch."""
        self.position += num_global_samples

    @property
    def samples_per_rank(self) -> int:
        """Samples this rank sees in a whole epoch."""
        return self.total_size // self.num_replicas

    def batches_per_epoch(self, drop_last_batch: bool) -> int:
        """Micro-batches per rank in a whole epoch, as a DataLoader over this sampler yields."""
        n = self.samples_per_rank
        return n // self.batch_size if drop_last_batch else -(-n // self.batch_size)

    # -- the order ----------------------------------------------------------------------------
    def epoch_order(self) -> np.ndarray:
        """The global order of the current epoch (total_size indices, identical on every rank).

        Computed once per epoch (the loop, the DataLoader's iterator and every checkpoint's
        self-check all ask for it) and returned read-only."""
        if self._order is None:
            self._order = self._compute_order()
            self._order.flags.writeable = False
        return self._order

    def _compute_order(self) -> np.ndarray:
        if self.shuffle:
            g = torch.Generator()
            g.set_state(self._generator_state)
            order = torch.randperm(self.num_samples, generator=g).numpy()
        else:
            order = np.arange(self.num_samples)
        if self.total_size <= self.num_samples:
            order = order[: self.total_size]
        else:
            order = np.resize(order, self.total_size)  # wrap-around padding
        if self.lengths is not None:
            order = self._group_by_length(order)
        return order

    def _group_by_length(self, order: np.ndarray) -> np.ndarray:
        mega = self.global_batch * MEGABATCH_MULT
        out = np.empty_like(order)
        for start in range(0, len(order), mega):
            chunk = order[start : start + mega]
            # Stable descending sort: ties keep the shuffled order, so the result is deterministic.
            keys = -self.lengths[chunk]
            out[start : start + len(chunk)] = chunk[np.argsort(keys, kind="stable")]
        return out

    def upcoming(self, count: int) -> list[int]:
        """The global sample ids of the next `count` samples the ranks will consume together."""
        return self.epoch_order()[self.position : self.position + count].tolist()

    def __iter__(self) -> Iterator[int]:
        if self.position % self.num_replicas:
            raise RuntimeError(f"position {self.position} is not a multiple of the world size")
        mine = self.epoch_order()[self.position + self.rank :: self.num_replicas]
        return iter(mine.tolist())

    def __len__(self) -> int:
        return max(0, (self.total_size - self.position) // self.num_replicas)

    # -- Stateful -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "total_size": self.total_size,
            "generator_state": base64.b64encode(self._generator_state.numpy().tobytes()).decode(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") == BijectiveSampler.KIND:
            raise ValueError("sampler state is for a token store (data.store), not this dataset")
        if state["num_samples"] != self.num_samples:
            raise ValueError(
                f"sampler state is for {state['num_samples']} samples, "
                f"the dataset has {self.num_samples}"
            )
        saved_size = state.get("total_size")
        if saved_size is None:
            # Written before the epoch was cut in whole global batches, on this run's ranks
            # (resumes on other ranks were refused then): the cut of that version.
            unit = self.batch_size * self.num_replicas
            n = self.num_samples
            saved_size = n // unit * unit if self.drop_last else self.total_size
        if saved_size != self.total_size:
            how = (
                f"cut to whole global batches of {self.global_batch}"
                if self.drop_last
                else f"padded to a multiple of {self.num_replicas} ranks (data.drop_last false)"
            )
            raise ValueError(
                f"sampler state is for an epoch of {saved_size} samples, this run's epoch has "
                f"{self.total_size} ({self.num_samples} samples {how})"
            )
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.position = state["position"]
        raw = np.frombuffer(base64.b64decode(state["generator_state"]), dtype=np.uint8)
        self._generator_state = torch.from_numpy(raw.copy())
        self._order = None


class LazyOrder:
    """An epoch's global order computed on demand, slice by slice (a token store's epoch may hold
    billions of blocks): `order[a:b]`, `order[a:b:step]`, `order[i]` and `len(order)`."""

    def __init__(self, perm: FeistelPermutation | None, num_samples: int, total_size: int) -> None:
        self.perm, self.num_samples, self.total_size = perm, num_samples, total_size

    def __len__(self) -> int:
        return self.total_size

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The sample ids at these positions of the epoch (wrapping around past num_samples, as
        padding without drop_last does)."""
        k = np.asarray(positions, dtype=np.int64) % self.num_samples
        return k if self.perm is None else self.perm(k)

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            return self.at(np.arange(*key.indices(self.total_size), dtype=np.int64))
        if not -self.total_size <= key < self.total_size:
            raise IndexError(f"position {key} out of range for an epoch of {self.total_size}")
        return int(self.at(np.array([key % self.total_size]))[0])


class BijectiveSampler(ResumableDistributedSampler):
    """The resumable sampler for data too large for a permutation array (a token store): the
    epoch's order is a seeded bijection over [0, num_samples) (core/data/permutation.py), keyed
    by (seed, epoch), computed for the positions asked for. Memory O(1) in num_samples; a resume
    at any position costs the same. Positions, epochs, global batches and the elastic rules are
    those of ResumableDistributedSampler; only the order differs (so its state says which kind
    it is, and the other kind's state is refused)."""

    KIND = "bijection"
    CHUNK = 1 << 16  # sample ids computed at once while iterating

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("lengths") is not None:
            raise ValueError("a bijective sampler does not group by length")
        super().__init__(*args, **kwargs)

    def _order_for_epoch(self) -> LazyOrder:
        perm = None
        if self.shuffle:
            perm = FeistelPermutation(self.num_samples, self.seed, self.epoch)
        return LazyOrder(perm, self.num_samples, self.total_size)

    def epoch_order(self) -> LazyOrder:  # type: ignore[override]
        if self._order is None:
            self._order = self._order_for_epoch()  # type: ignore[assignment]
        return self._order  # type: ignore[return-value]

    def upcoming(self, count: int) -> list[int]:
        return self.epoch_order()[self.position : self.position + count].tolist()

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(ids.tolist() for ids in self.rank_chunks())

    def rank_chunks(self) -> Iterator[np.ndarray]:
        """This rank's ids from the current position, as arrays (what __iter__ yields one by
        one): a loader that reads whole batches needs no Python int per sample."""
        if self.position % self.num_replicas:
            raise RuntimeError(f"position {self.position} is not a multiple of the world size")
        return self._chunks(self.epoch_order(), self.position + self.rank)

    def _chunks(self, order: LazyOrder, first: int) -> Iterator[np.ndarray]:
        step = self.num_replicas
        for start in range(first, self.total_size, self.CHUNK * step):
            stop = min(start + self.CHUNK * step, self.total_size)
            yield order[start:stop:step]

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.KIND,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "total_size": self.total_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.KIND:
            raise ValueError(
                "sampler state is for a permuted dataset, not a token store (data.store)"
            )
        for key in ("num_samples", "total_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state is for {key} {state[key]}, this run has {getattr(self, key)}"
                    " (another token store, eval holdout or global batch)"
                )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = None

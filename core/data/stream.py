"""Iterable (streaming) datasets: a position in the stream in place of the resumable sampler.

Items are taken in groups of world-size: rank r takes item r of each complete group, so every
rank sees the same number of items and no collective waits on a rank that ran dry. When the
stream ends, the epoch ends (a partial optimizer step is discarded) and the next epoch iterates
it again (after `set_epoch(epoch)` where the dataset has one, as HF's does).

A resume must reach the saved position. A dataset that offers `state_dict()` /
`load_state_dict()` (Hugging Face `datasets.IterableDataset` since datasets 3) is asked for its
state as items are read, and the checkpoint holds its state at exactly the saved position: a
resume loads it and reads on from the saved shard and example. Contract for such a dataset:
`state_dict()` describes the position just after the latest item its live iterator yielded,
as plain JSON; `load_state_dict(s)` makes the next iteration start just after that item (in
the epoch `set_epoch` chose). Any other iterable is re-read and the items before the position
discarded: O(position). Where a state would not resume exactly (an HF shuffle buffer, whose
contents the state lacks; a state that is not JSON) the stream falls back to re-reading, and
says so once: a resume is never inexact.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import datasets
from torch.utils.data import IterableDataset

logger = logging.getLogger(__name__)

# Stands in for "unknown" wherever the loop asks how long an epoch is.
ENDLESS = 2**62

Snapshot = tuple[int, dict[str, Any]]
"""(items read since the epoch began, the dataset's state right after them)."""


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, (IterableDataset, datasets.IterableDataset)) or not hasattr(
        dataset, "__getitem__"
    )


def has_state(dataset: Any) -> bool:
    """Whether `dataset` offers the state_dict / load_state_dict pair of the contract above."""
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


def why_state_is_inexact(dataset: Any) -> str | None:
    """Why resuming `dataset` from its state would not continue exactly (None: it would).
    Only HF datasets are known to have such cases; their own docs name them."""
    if not isinstance(dataset, datasets.IterableDataset):
        return None
    if getattr(dataset, "_distributed", None) is not None:
        return "it is split by node, so its state differs between ranks"
    # The pipeline is private; a version whose structure we cannot walk counts as unknown.
    todo = [getattr(dataset, "_ex_iterable", None)]
    if todo[0] is None:
        return "this datasets version's pipeline cannot be inspected"
    while todo:
        node = todo.pop()
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return "its state does not hold the shuffle buffer's contents"
        formatting = getattr(node, "formatting", None)
        if getattr(node, "batched", False) and getattr(formatting, "is_table", False):
            return "a batched map over a table format may skip a batch on resume"
        todo.extend(n for n in [getattr(node, "ex_iterable", None)] if n is not None)
        todo.extend(getattr(node, "ex_iterables", None) or [])
    return None


def _is_json(state: Any) -> bool:
    try:
        return json.loads(json.dumps(state)) == state
    except (TypeError, ValueError):
        return False


class _Shard(IterableDataset):
    """Rank `rank`'s items of `source`, after discarding `skip` items. `start`: items of the
    epoch already behind the source's first item (it was resumed from a state);
    `on_read(read)` is called after each complete group, with the items read this epoch."""

    def __init__(
        self,
        source: Iterable[Any],
        skip: int,
        rank: int,
        world: int,
        start: int = 0,
        on_read: Callable[[int], None] | None = None,
    ) -> None:
        self.source, self.skip, self.rank, self.world = source, skip, rank, world
        self.start, self.on_read = start, on_read

    def __iter__(self) -> Iterator[Any]:
        items = itertools.islice(iter(self.source), self.skip, None)
        read = self.start + self.skip
        while len(group := list(itertools.islice(items, self.world))) == self.world:
            read += self.world
            if self.on_read is not None:
                self.on_read(read)  # before the item leaves: the state is at `read` now
            yield group[self.rank]


class StreamPosition:
    """The sampler interface the loop uses, for an iterable dataset (Stateful)."""

    def __init__(
        self, num_replicas: int, rank: int, batch_size: int, seed: int, accumulation: int = 1
    ) -> None:
        self.num_replicas, self.rank, self.batch_size, self.seed = (
            num_replicas,
            rank,
            batch_size,
            seed,
        )
        self.global_batch = batch_size * num_replicas * accumulation
        """Items of one optimizer step, all ranks together."""
        self.epoch = 0
        self.position = 0
        self.total_size = ENDLESS
        self.lengths = None
        self._snapshots: deque[Snapshot] = deque()
        """Dataset states of this epoch captured while reading (the loop reads ahead of
        `position`): none past the latest at or before `position` is dropped."""
        self._restored: Snapshot | None = None
        """The dataset state a checkpoint restored, for the epoch it was saved in."""
        self._use_state = True
        """False once this stream's dataset state proved unusable: re-read from then on."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position = epoch, 0
        self._snapshots, self._restored = deque(), None

    def advance(self, num_global_samples: int) -> None:
        self.position += num_global_samples
        self._drop_old(self._snapshots)

    def batches_per_epoch(self, drop_last_batch: bool) -> int:
        return ENDLESS

    def epoch_order(self) -> range:
        return range(ENDLESS)  # item ids are stream positions

    def upcoming(self, count: int) -> list[int]:
        return list(range(self.position, self.position + count))

    def __len__(self) -> int:
        return ENDLESS - self.position

    def shard(self, dataset: Any) -> _Shard:
        """This rank's items from the current position of the current epoch."""
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(self.epoch)
        if not (has_state(dataset) and self._state_usable(dataset)):
            return _Shard(dataset, self.position, self.rank, self.num_replicas)
        found = self._latest()
        if found is not None and not self._epoch_matches(dataset, found[1]):
            found = None
        if found is not None:
            dataset.load_state_dict(copy.deepcopy(found[1]))
        elif isinstance(dataset, datasets.IterableDataset):
            # HF keeps a loaded state for every later iteration of its epoch: forget it.
            dataset.load_state_dict(None)
        start = 0 if found is None else found[0]
        # A fresh deque per reader: an abandoned reader's late captures go nowhere.
        self._snapshots = snapshots = deque([] if found is None else [found])
        return _Shard(
            dataset,
            self.position - start,
            self.rank,
            self.num_replicas,
            start=start,
            on_read=lambda read: self._capture(dataset, snapshots, read),
        )

    def _capture(self, dataset: Any, snapshots: deque[Snapshot], read: int) -> None:
        # Checkpoints fall on optimizer-step boundaries: capture only those.
        if self._use_state and read % self.global_batch == 0:
            state = dataset.state_dict()
            if not isinstance(dataset, datasets.IterableDataset):
                state = copy.deepcopy(state)  # HF hands out a copy already
            snapshots.append((read, state))
            self._drop_old(snapshots)

    def _drop_old(self, snapshots: deque[Snapshot]) -> None:
        while len(snapshots) > 1 and snapshots[1][0] <= self.position:
            snapshots.popleft()

    def _latest(self) -> Snapshot | None:
        """The known dataset state latest at or before the position (captured or restored)."""
        known = [*self._snapshots, *([self._restored] if self._restored else [])]
        before = [s for s in known if s[0] <= self.position]
        return max(before, key=lambda s: s[0]) if before else None

    def _state_usable(self, dataset: Any) -> bool:
        if self._use_state and (why := why_state_is_inexact(dataset)) is not None:
            self._stop_using_state(f"the dataset's state would not resume exactly: {why}")
        return self._use_state

    def _epoch_matches(self, dataset: Any, state: dict[str, Any]) -> bool:
        # HF ignores a state of another epoch without a word: check before relying on it.
        if not isinstance(dataset, datasets.IterableDataset) or state.get("epoch") == self.epoch:
            return True
        self._stop_using_state(
            f"the dataset's saved state is for epoch {state.get('epoch')}, not {self.epoch}"
        )
        return False

    def _stop_using_state(self, why: str) -> None:
        self._use_state, self._snapshots = False, deque()
        if self.rank == 0:
            logger.warning(
                "%s; a resume re-reads the stream up to its position instead (exact, O(position))",
                why,
            )

    def state_dict(self) -> dict[str, Any]:
        state = {"kind": "stream", "epoch": self.epoch, "position": self.position}
        state.update(seed=self.seed, dataset=None)
        found = self._latest()
        if self._use_state and self.position > 0 and found is not None:
            if _is_json(found[1]):
                state["dataset"] = {"position": found[0], "state": found[1]}
            else:
                self._stop_using_state("the dataset's state_dict() is not plain JSON")
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "stream":
            raise ValueError("the checkpoint's sampler is for a map-style dataset, not a stream")
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
        self._snapshots = deque()
        # Checkpoints written before dataset states were kept have none: re-read.
        saved = state.get("dataset")
        self._restored = None if saved is None else (saved["position"], saved["state"])

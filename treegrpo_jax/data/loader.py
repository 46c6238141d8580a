"""Batches of QA rows: deterministic per-epoch shuffling, a resumable position, a per-host split.

How an epoch is laid out (the same on every host, so no communication is needed):

1. The epoch's order is a permutation of all N rows drawn from `seed` with the epoch number folded
   in (`np.random.default_rng([seed, epoch])`), so every epoch is reshuffled and any epoch can be
   recomputed from the two numbers alone.
2. The order is cut into *global* batches of `batch_size * process_count` rows. Host p takes the
   p-th slice of `batch_size` rows of each global batch, so hosts see disjoint rows, and their
   batches put side by side are exactly the single-host batch of the same global size.
3. Drop remainder (`drop_remainder=True`, the default): the last N mod (batch_size * process_count)
   rows of the epoch's order are not used in that epoch (they are different rows in the next
   epoch, because the order changes). Every batch then has exactly `batch_size` rows, which keeps
   jitted shapes fixed. With `drop_remainder=False` the leftover rows form one short final global
   batch, dealt to hosts in turn (host p gets leftover[p::process_count]); a host may then receive
   fewer rows, even none, but every host always yields the same number of batches per epoch, so
   multi-host collectives stay in step.

The position is `{"epoch": e, "index": i}` with i the number of rows of epoch e's order already
consumed (by all hosts together). It is plain JSON, so it goes into a checkpoint as is, and
restoring it makes the loader yield exactly the batches that would have come next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

__all__ = ["LoaderConfig", "RowLoader"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """How rows are batched and ordered.

    Attributes:
        batch_size: prompts per batch *on each host*.
        seed: shuffling seed (the epoch number is folded in).
        shuffle: reshuffle every epoch; if False, file order every epoch.
        drop_remainder: drop the rows that do not fill a whole global batch (see module docstring).
        num_epochs: stop after this many epochs; None repeats forever.
    """

    batch_size: int
    seed: int = 0
    shuffle: bool = True
    drop_remainder: bool = True
    num_epochs: int | None = None

    def __post_init__(self):
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"LoaderConfig.batch_size must be a positive int, got {self.batch_size!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"LoaderConfig.seed must be a non-negative int, got {self.seed!r}")
        if self.num_epochs is not None and (not isinstance(self.num_epochs, int) or self.num_epochs < 1):
            raise ValueError(
                f"LoaderConfig.num_epochs must be a positive int or None, got {self.num_epochs!r}"
            )


class RowLoader(Generic[T]):
    """Iterator over batches (tuples) of rows for one host; see the module docstring.

    Args:
        rows: random-access rows (a tuple of `QARow`, a `QARowSource`, ...); read lazily by index.
        cfg: batching and ordering.
        process_index: this host's index, in [0, process_count).
        process_count: number of hosts sharing the data.
    """

    def __init__(self, rows: Sequence[T], cfg: LoaderConfig, *, process_index: int, process_count: int):
        if process_count < 1:
            raise ValueError(f"process_count must be >= 1, got {process_count}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
        if not len(rows):
            raise ValueError("no rows to load")
        self._rows = rows
        self._cfg = cfg
        self._process_index = process_index
        self._process_count = process_count
        self._global_batch = cfg.batch_size * process_count
        if cfg.drop_remainder and len(rows) < self._global_batch:
            raise ValueError(
                f"{len(rows)} rows cannot fill one global batch of {cfg.batch_size} x {process_count} "
                "hosts with drop_remainder=True"
            )
        self._epoch = 0
        self._index = 0
        self._order_epoch = -1
        self._order = np.arange(0)

    @property
    def steps_per_epoch(self) -> int:
        """Batches each host yields per epoch (the same on every host)."""
        full, rest = divmod(len(self._rows), self._global_batch)
        return full + (1 if rest and not self._cfg.drop_remainder else 0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Returns the row indices of `epoch` in the order all hosts together consume them.

        Args:
            epoch: the epoch number (0-based).

        Returns:
            An int64 array, a permutation of range(N) (identity when shuffling is off).
        """
        if not self._cfg.shuffle:
            return np.arange(len(self._rows))
        # A SeedSequence over [seed, epoch] folds the epoch in: independent, reproducible orders.
        return np.random.default_rng([self._cfg.seed, epoch]).permutation(len(self._rows))

    def _usable(self) -> int:
        """Rows of an epoch's order that are consumed before the epoch ends."""
        n = len(self._rows)
        return n - n % self._global_batch if self._cfg.drop_remainder else n

    def get_state(self) -> dict[str, int]:
        """Returns the position as a JSON-serialisable dict `{"epoch", "index"}`."""
        return {"epoch": self._epoch, "index": self._index}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores a position saved by `get_state` (on any host; the position is global).

        Args:
            state: `{"epoch": e, "index": i}`; i must lie on a global batch boundary.

        Raises:
            ValueError: for a malformed state or an index that is not a batch boundary.
        """
        epoch, index = state.get("epoch"), state.get("index")
        if not isinstance(epoch, int) or not isinstance(index, int) or epoch < 0 or index < 0:
            raise ValueError(
                f"loader state must be {{'epoch': int >= 0, 'index': int >= 0}}, got {dict(state)}"
            )
        if index > self._usable() or (index % self._global_batch and index != self._usable()):
            raise ValueError(
                f"loader state index {index} is not a batch boundary for global batch {self._global_batch} "
                f"and {len(self._rows)} rows (batch size or host count changed?)"
            )
        self._epoch, self._index = epoch, index
        self._normalise()

    def _normalise(self) -> None:
        # A position at the end of an epoch is the start of the next one, so a state saved after the
        # last batch of an epoch reads the same as one saved before the first batch of the next.
        if self._index >= self._usable():
            self._epoch += 1
            self._index = 0

    def __iter__(self) -> Iterator[tuple[T, ...]]:
        return self

    def __next__(self) -> tuple[T, ...]:
        if self._cfg.num_epochs is not None and self._epoch >= self._cfg.num_epochs:
            raise StopIteration
        if self._order_epoch != self._epoch:
            self._order = self.epoch_order(self._epoch)
            self._order_epoch = self._epoch
        start = self._index
        stop = min(start + self._global_batch, self._usable())
        global_indices = self._order[start:stop]
        if stop - start == self._global_batch:
            p, b = self._process_index, self._cfg.batch_size
            local = global_indices[p * b : (p + 1) * b]
        else:
            # The short last batch (drop_remainder=False): deal the leftover rows in turn.
            local = global_indices[self._process_index :: self._process_count]
        self._index = stop
        self._normalise()
        return tuple(self._rows[int(i)] for i in local)

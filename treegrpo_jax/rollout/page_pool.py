"""Host-side bookkeeping of the paged KV cache: which pages are free, and who shares which.

Legend: S sequences (the engine's slots), NP pages, P tokens per page, MP = T / P.

A page is referenced by every sequence whose table lists it. Branches of a tree share the
full pages of their common prefix (fork increments their counts); a page returns to the
free list when its last reference is dropped. Pages are only ever *written* by the one
sequence whose length is inside them — a forked branch gets its own copy of the partial
last page (copy-on-write at fork time), and full pages are never written again — so a shared
page is immutable and needs no locking or copy later.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from treegrpo_jax.validation import check_int

KV_LAYOUTS = ("slots", "paged")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """How the rollout engine stores K/V (the `kv_cache` config block).

    Attributes:
      layout: `slots` (every sequence reserves the whole context; a fork copies a slot) or
        `paged` (pages of `page_size` tokens shared between branches; this module).
      page_size: tokens per page (a power of two ≤ 128).
      pages: pages in the pool (0: the slot layout's memory for the same sequences).
    """

    layout: str = "slots"
    page_size: int = 16
    pages: int = 0

    def __post_init__(self):
        if self.layout not in KV_LAYOUTS:
            raise ValueError(f"kv_cache.layout={self.layout!r}; allowed: {list(KV_LAYOUTS)}")
        p = self.page_size
        if isinstance(p, bool) or not isinstance(p, int) or p < 1 or p > 128 or p & (p - 1):
            raise ValueError(f"kv_cache.page_size must be a power of two in [1, 128], got {p!r}")
        check_int("kv_cache.pages", self.pages, 0, "(0: the slot layout's memory)")


class OutOfSlotsError(RuntimeError):
    """The pool has fewer free slots (sequences) than requested."""


class OutOfPagesError(OutOfSlotsError):
    """The paged pool has fewer free pages than an operation needs (nothing was changed)."""


class PagePool:
    """Reference-counted pages with page tables, on the host (the device copy is pushed by the
    engine when `table_changed`)."""

    def __init__(self, *, num_pages: int, num_slots: int, pages_per_seq: int, page_size: int):
        self.num_pages, self.page_size, self.pages_per_seq = num_pages, page_size, pages_per_seq
        self.refs = np.zeros(num_pages, np.int32)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: lowest page first
        self.table = np.full((num_slots, pages_per_seq), num_pages, np.int32)  # NP: no page
        self.held = np.zeros(num_slots, np.int64)  # pages at the head of each table row
        self.table_changed = True
        self.peak = 0  # most pages in use at once since `reset_peak`
        self.copied = 0  # pages copied on write (forks from inside a page)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.num_pages - len(self._free)

    def reset_peak(self) -> None:
        self.peak, self.copied = self.in_use, 0

    def pages_for(self, tokens: int) -> int:
        return min(-(-int(tokens) // self.page_size), self.pages_per_seq)

    def copies_for_fork(self, lengths) -> int:
        """Pages a fork of prefixes of these lengths copies: one per prefix that ends inside a page."""
        return sum(1 for n in lengths if int(n) % self.page_size)

    def distinct_held(self, slots) -> int:
        """Distinct pages the sequences in `slots` hold (shared pages counted once)."""
        held = [self.table[s, : self.held[s]] for s in slots]
        return len(np.unique(np.concatenate(held))) if held else 0

    def need(self, slot: int, tokens: int) -> int:
        """New pages `slot` needs to hold its first `tokens` positions."""
        return max(0, self.pages_for(tokens) - int(self.held[slot]))

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} of {self.num_pages} free")
        taken = [self._free.pop() for _ in range(n)]
        self.refs[taken] = 1
        self.peak = max(self.peak, self.in_use)
        return taken

    def _release(self, pages) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self._free.append(int(page))

    def grow(self, needs: dict[int, int]) -> None:
        """Gives each slot pages for its first `needs[slot]` positions; all or nothing."""
        extra = {s: self.need(s, t) for s, t in needs.items()}
        total = sum(extra.values())
        if total > len(self._free):
            raise OutOfPagesError(f"need {total} pages, {len(self._free)} of {self.num_pages} free")
        for slot, n in extra.items():
            if n:
                h = int(self.held[slot])
                self.table[slot, h : h + n] = self._take(n)
                self.held[slot] = h + n
                self.table_changed = True

    def trim(self, slot: int, tokens: int) -> None:
        """Drops the pages of `slot` past its first `tokens` positions."""
        keep, h = self.pages_for(tokens), int(self.held[slot])
        if keep < h:
            self._release(self.table[slot, keep:h])
            self.table[slot, keep:h] = self.num_pages
            self.held[slot] = keep
            self.table_changed = True

    def free(self, slot: int) -> None:
        self.trim(slot, 0)

    def fork(self, src: list[int], dst: list[int], lengths: list[int]) -> tuple[list[int], list[int]]:
        """dst[i] shares the full pages of src[i]'s first `lengths[i]` tokens and gets a copy of
        the partial page after them; returns the (source, copy) page pairs to copy on the device.
        All or nothing."""
        partial = self.copies_for_fork(lengths)
        if partial > len(self._free):
            raise OutOfPagesError(f"fork needs {partial} pages, {len(self._free)} of {self.num_pages} free")
        copies_src, copies_dst = [], []
        for s, d, n in zip(src, dst, lengths, strict=True):
            if self.held[d]:
                self.free(d)
            full = n // self.page_size
            shared = self.table[s, :full]
            self.refs[shared] += 1
            self.table[d, :full] = shared
            held = full
            if n % self.page_size:
                (page,) = self._take(1)
                copies_src.append(int(self.table[s, full]))
                copies_dst.append(page)
                self.table[d, full] = page
                held += 1
            self.held[d] = held
        self.copied += len(copies_dst)
        self.table_changed = True
        return copies_src, copies_dst

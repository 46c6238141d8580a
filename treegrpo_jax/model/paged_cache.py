"""KV cache in pages: a sequence's memory is the pages its tokens fill, and pages are shared.

Legend: L layers, K kv heads, NP pages in the pool, P tokens per page, D head dim,
S sequences (page-table rows), MP = T / P pages per sequence at most, B rows of a call.

Layout [L, K, NP, P, D]: one layer's `[K, NP, P, D]` is exactly what the JAX Pallas
paged-attention kernels take (GPU and TPU, `paged_kernels.py`), so no call copies the pool.
`page_table[s, j]` is the page holding tokens `j·P .. j·P+P-1` of sequence `s`; an entry
≥ NP means "no page" (writes there are dropped, reads are masked by the length).

Sequences that share a prefix point at the same pages: a tree's branches hold one copy of
their common tokens. Who owns what is the host's business (`rollout/page_pool.py` counts
references); this module only reads and writes through the table, with the same interface
as the slot cache (`cache.py`): `offsets`, `write`, `read`, `decode_native`, `prefill_native`,
`attend_pallas`, `add_lengths`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from treegrpo_jax._pytree import pytree_dataclass
from treegrpo_jax.model.cache import scatter
from treegrpo_jax.model.config import ModelConfig

PAGED_CACHE_AXES = ("layers", "kv_heads", "pages", "page", "head_dim")


@pytree_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    k: Float[Array, "L K NP P D"]
    v: Float[Array, "L K NP P D"]
    page_table: Int[Array, "S MP"]  # ≥ NP: no page
    lengths: Int[Array, " S"]  # tokens already written in each sequence

    pallas_on_tpu: ClassVar[bool] = True  # `paged_kernels.py` runs on GPU and TPU

    @property
    def num_slots(self) -> int:
        return self.page_table.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def max_len(self) -> int:
        return self.page_table.shape[1] * self.page_size

    # ------------------------------------------------ the decoder's interface
    def offsets(self, slots: Int[ArrayLike, " B"]) -> Int[Array, " B"]:
        return self.lengths[jnp.minimum(slots, self.num_slots - 1)]

    def row_pages(self, slots: Int[ArrayLike, " B"]) -> Int[Array, "B MP"]:
        """Each row's page table; rows past the sequences (padding) get "no page" everywhere."""
        pages = self.page_table[jnp.minimum(slots, self.num_slots - 1)]
        return jnp.where((slots < self.num_slots)[:, None], pages, self.num_pages)

    def write(
        self, layer, slots: Int[ArrayLike, " B"], write_pos: Int[ArrayLike, "B C"], k_BCKD, v_BCKD
    ) -> PagedKVCache:
        """Writes row b's chunk at positions `write_pos[b]` of its sequence; positions
        ≥ max_len, padding rows and positions without a page are dropped."""
        p = self.page_size
        table = self.row_pages(slots)  # [B, MP]
        in_range = write_pos < self.max_len
        page = jnp.take_along_axis(table, jnp.where(in_range, write_pos // p, 0), axis=1)
        page = jnp.where(in_range, page, self.num_pages)  # [B, C]; NP: dropped
        off = write_pos % p
        # Advanced indices around the kv-head slice: the update is laid out [B, C, K, D].
        k = scatter(self.k, (layer, slice(None), page, off), k_BCKD)
        v = scatter(self.v, (layer, slice(None), page, off), v_BCKD)
        return dataclasses.replace(self, k=k, v=v)

    def read(self, layer, slots: Int[ArrayLike, " B"] | None, span: int) -> tuple[Array, Array]:
        """The first `span` keys and values (a multiple of P) of each row's sequence,
        gathered page by page: `[B, K, span, D]`. Positions without a page read page NP-1;
        the caller masks them by length."""
        if span % self.page_size:
            raise ValueError(
                f"PagedKVCache.read: span {span} is not a multiple of the page size {self.page_size}"
            )
        if slots is None:
            slots = jnp.arange(self.num_slots)
        pages = jnp.minimum(self.row_pages(slots)[:, : span // self.page_size], self.num_pages - 1)  # [B, M]
        b, m = pages.shape

        def gather(pool):
            layer_pages = jax.lax.dynamic_index_in_dim(pool, layer, keepdims=False)  # [K, NP, P, D]
            rows = layer_pages[:, pages]  # [K, B, M, P, D]
            return rows.transpose(1, 0, 2, 3, 4).reshape(b, pool.shape[1], m * self.page_size, pool.shape[-1])

        return gather(self.k), gather(self.v)

    def decode_native(self, layer, q_BHD, k_BKD, v_BKD, slots, write_pos, live_lens):
        """The CPU kernel over pages: write each row's new key/value, attend its live keys."""
        from treegrpo_jax.model.decode_attention import decode_attention_native

        o, k, v = decode_attention_native(
            q_BHD,
            k_BKD,
            v_BKD,
            self.k,
            self.v,
            layer,
            self.row_pages(slots),
            write_pos,
            live_lens,
            paged=True,
        )
        return o, dataclasses.replace(self, k=k, v=v)

    def prefill_native(self, layer, q_NHD, k_NKD, v_NKD, slots, row_start, attend):
        """The CPU prefill kernel over pages (flat tokens; see `KVCache.prefill_native`)."""
        from treegrpo_jax.model.prefill_attention import prefill_attention_native

        o, k, v = prefill_attention_native(
            q_NHD,
            k_NKD,
            v_NKD,
            self.k,
            self.v,
            layer,
            self.row_pages(slots),
            row_start,
            self.offsets(slots),
            paged=True,
            attend=attend,
        )
        return o, dataclasses.replace(self, k=k, v=v)

    def attend_pallas(self, layer, q_BHD, slots, live_lens, span: int | None = None):
        """Decode attention of `layer` with the backend's Pallas kernel (after `write`); the page
        table bounds what each row reads (`span` is the slot cache's, unused here)."""
        del span
        from treegrpo_jax.model.paged_kernels import paged_attention_pallas, platform_for_backend

        platform, interpret = platform_for_backend()
        k = jax.lax.dynamic_index_in_dim(self.k, layer, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(self.v, layer, keepdims=False)
        pages = self.row_pages(slots)
        return paged_attention_pallas(q_BHD, k, v, pages, live_lens, platform=platform, interpret=interpret)

    def add_lengths(self, slots: Int[ArrayLike, " B"], chunk_lens: Int[ArrayLike, " B"]) -> PagedKVCache:
        lengths = self.lengths.at[slots].add(chunk_lens.astype(self.lengths.dtype), mode="drop")
        return dataclasses.replace(self, lengths=lengths)


def init_paged_cache(
    cfg: ModelConfig, *, num_slots: int, max_len: int, num_pages: int, page_size: int, dtype=None
) -> PagedKVCache:
    """An empty pool of `num_pages` pages of `page_size` tokens for `num_slots` sequences of at
    most `max_len` tokens (a multiple of the page size); no sequence holds a page yet."""
    if page_size < 1 or max_len % page_size:
        raise ValueError(f"paged cache: max_len {max_len} must be a multiple of page_size {page_size} ≥ 1")
    if num_pages < 1 or num_slots < 1:
        raise ValueError(f"paged cache: needs num_pages ≥ 1 and num_slots ≥ 1, got {num_pages}, {num_slots}")
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    dtype = cfg.jnp_dtype if dtype is None else dtype
    return PagedKVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        page_table=jnp.full((num_slots, max_len // page_size), num_pages, jnp.int32),
        lengths=jnp.zeros((num_slots,), jnp.int32),
    )


def copy_pages(cache: PagedKVCache, src: Int[ArrayLike, " N"], dst: Int[ArrayLike, " N"]) -> PagedKVCache:
    """Copies page src[i] into page dst[i] in every layer (copy-on-write of a branch's partial
    last page); pairs with dst ≥ NP are ignored, which lets callers pad N."""
    src = jnp.minimum(src, cache.num_pages - 1)
    index = (slice(None), slice(None), dst)
    k = scatter(cache.k, index, cache.k[:, :, src])
    v = scatter(cache.v, index, cache.v[:, :, src])
    return dataclasses.replace(cache, k=k, v=v)

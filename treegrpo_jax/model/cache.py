"""KV cache as a pool of slots (the contiguous layout; `paged_cache.py` is the paged one).

Legend: L layers, S slots, K kv heads, T max tokens per slot, D head dim.

Layout [L, S, K, T, D]: for one slot and kv head, keys are contiguous [T, D] rows, so
attention over a slot is a plain matrix product with no transpose per decode step.

Every slot has its own length, so every row writes at its own position: this is what
lets one batch hold the nodes of a tree at different depths (peers that keep one write
index for the whole batch cannot). Forking a branch is a copy of one slot into others.

The decoder reaches a cache only through these methods, which `PagedKVCache` implements too:
`offsets` (each row's length), `write` (a chunk of keys/values at per-row positions), `read`
(the first `span` keys/values of each row's sequence), `decode_native` (the CPU kernel's
write-then-attend), `prefill_native` (the CPU kernel's chunked write-then-attend over flat
tokens), `attend_pallas` (the Pallas decode kernel) and `add_lengths`, and one capability,
`pallas_on_tpu` (whether `attend_pallas` has a TPU kernel). `slots` are sequence ids in both:
here a slot *is* its memory.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from treegrpo_jax._pytree import pytree_dataclass
from treegrpo_jax.model.config import ModelConfig

CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")


@pytree_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: Float[Array, "L S K T D"]
    v: Float[Array, "L S K T D"]
    lengths: Int[Array, " S"]  # tokens already written in each slot

    pallas_on_tpu: ClassVar[bool] = False  # the slot kernel is GPU-only (TPU decodes through XLA)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    # ------------------------------------------------ the decoder's interface
    def offsets(self, slots: Int[ArrayLike, " B"]) -> Int[Array, " B"]:
        """Tokens already written in each row's slot (rows past the pool read the last slot)."""
        return self.lengths[jnp.minimum(slots, self.num_slots - 1)]

    def write(
        self, layer, slots: Int[ArrayLike, " B"], write_pos: Int[ArrayLike, "B C"], k_BCKD, v_BCKD
    ) -> KVCache:
        """Writes row b's chunk at positions `write_pos[b]` of slot `slots[b]` in `layer`;
        positions ≥ max_len and slots ≥ S are dropped."""
        idx = jnp.broadcast_to(slots[:, None], write_pos.shape)
        # Advanced indices around the kv-head slice: the update is laid out [B, C, K, D].
        k = scatter(self.k, (layer, idx, slice(None), write_pos), k_BCKD)
        v = scatter(self.v, (layer, idx, slice(None), write_pos), v_BCKD)
        return dataclasses.replace(self, k=k, v=v)

    def read(self, layer, slots: Int[ArrayLike, " B"] | None, span: int) -> tuple[Array, Array]:
        """The first `span` keys and values of each row's slot, `[B, K, span, D]` (`slots` None:
        row b is slot b, read in place)."""
        keys = jax.lax.dynamic_index_in_dim(self.k, layer, keepdims=False)[:, :, :span]
        values = jax.lax.dynamic_index_in_dim(self.v, layer, keepdims=False)[:, :, :span]
        if slots is not None:  # gather only the rows' slots (a batch smaller than the pool)
            keys, values = keys[slots], values[slots]
        return keys, values

    def decode_native(self, layer, q_BHD, k_BKD, v_BKD, slots, write_pos, live_lens):
        """The CPU kernel: write each row's new key/value, then attend its live keys in place."""
        from treegrpo_jax.model.decode_attention import decode_attention_native

        o, k, v = decode_attention_native(
            q_BHD, k_BKD, v_BKD, self.k, self.v, layer, slots[:, None], write_pos, live_lens, paged=False
        )
        return o, dataclasses.replace(self, k=k, v=v)

    def prefill_native(self, layer, q_NHD, k_NKD, v_NKD, slots, row_start, attend):
        """The CPU prefill kernel over flat tokens: row r (slot `slots[r]`) writes tokens
        `row_start[r] .. row_start[r+1]` at its offset, then they attend causally in place."""
        from treegrpo_jax.model.prefill_attention import prefill_attention_native

        o, k, v = prefill_attention_native(
            q_NHD,
            k_NKD,
            v_NKD,
            self.k,
            self.v,
            layer,
            slots[:, None],
            row_start,
            self.offsets(slots),
            paged=False,
            attend=attend,
        )
        return o, dataclasses.replace(self, k=k, v=v)

    def attend_pallas(self, layer, q_BHD, slots, live_lens, span: int):
        """Decode attention of `layer` with the Pallas GPU kernel (after `write`; interpreted off
        GPU, for tests) over each row's first `live_lens` keys of its slot's first `span`."""
        from treegrpo_jax.model.slot_kernels import slot_attention_pallas

        keys, values = self.read(layer, slots, span)
        return slot_attention_pallas(q_BHD, keys, values, live_lens, interpret=jax.default_backend() != "gpu")

    def add_lengths(self, slots: Int[ArrayLike, " B"], chunk_lens: Int[ArrayLike, " B"]) -> KVCache:
        lengths = self.lengths.at[slots].add(chunk_lens.astype(self.lengths.dtype), mode="drop")
        return dataclasses.replace(self, lengths=lengths)


def scatter(cache: ArrayLike, index, update: ArrayLike) -> Array:
    """`cache.at[index].set(update)` (out-of-range writes dropped), bf16 stored as its bits.

    XLA:CPU has no bf16 scatter: it converts the whole operand to f32 and back around it
    (measured: 100 ms per decode step for a 134 MB pool). The same bits as uint16 scatter
    in place; the values written are the update rounded to bf16, as with a plain scatter.
    """
    if cache.dtype != jnp.bfloat16:
        return cache.at[index].set(update.astype(cache.dtype), mode="drop")
    bits = jax.lax.bitcast_convert_type(cache, jnp.uint16)
    new = jax.lax.bitcast_convert_type(update.astype(jnp.bfloat16), jnp.uint16)
    return jax.lax.bitcast_convert_type(bits.at[index].set(new, mode="drop"), jnp.bfloat16)


def init_cache(cfg: ModelConfig, num_slots: int, max_len: int, dtype=None) -> KVCache:
    """An empty pool of `num_slots` slots of `max_len` tokens each."""
    shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
    dtype = cfg.jnp_dtype if dtype is None else dtype
    return KVCache(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((num_slots,), jnp.int32)
    )


def cache_abstract(cfg: ModelConfig, num_slots: int, max_len: int, dtype=None) -> KVCache:
    return jax.eval_shape(lambda: init_cache(cfg, num_slots, max_len, dtype))


def fork_slots(
    cache: KVCache,
    src: Int[ArrayLike, " N"],
    dst: Int[ArrayLike, " N"],
    lengths: Int[ArrayLike, " N"],
    span: int | None = None,
) -> KVCache:
    """Copies the first `span` positions of slot src[i] into slot dst[i] (all of them when
    `span` is None) and sets dst[i]'s length to lengths[i] (each ≤ span).

    A static span keeps the shapes static; positions past a slot's length are never
    attended to and are overwritten before they are, so what dst held there before does not
    matter. A length shorter than the source's starts a branch from a prefix. Pairs with
    dst == S (out of range) are ignored, which lets callers pad N.
    """
    t = cache.k.shape[3] if span is None else span
    k = cache.k.at[:, dst, :, :t].set(cache.k[:, src, :, :t], mode="drop")
    v = cache.v.at[:, dst, :, :t].set(cache.v[:, src, :, :t], mode="drop")
    return KVCache(k=k, v=v, lengths=cache.lengths.at[dst].set(lengths, mode="drop"))


FORK_CHUNK = 64  # positions per block copy of `copy_prefixes`


def copy_prefixes(
    cache: KVCache, src: Int[ArrayLike, " N"], dst: Int[ArrayLike, " N"], lengths: Int[ArrayLike, " N"]
) -> KVCache:
    """`fork_slots` as in-place block copies: what the engine's forks run.

    Pair i copies its own first `lengths[i]` positions (rounded up to `FORK_CHUNK`) of every
    layer and kv head, one contiguous [chunk, D] block per (layer, kv head) at a time, in a
    loop over pairs and chunks: the bytes its prefix holds, at copy speed. `fork_slots`
    gathers and scatters a static span for every pair — the longest prefix's power-of-two
    bucket for each, padding pairs included — which XLA:CPU runs at ~1–2 GB/s (a tree
    rollout's forks were 7 % of its wall). Positions past a length may differ between the
    two (never attended, overwritten before they are). Pairs with dst ≥ S are skipped; no
    dst may be another pair's src (pairs run in order, not all reads before all writes).
    """
    num_layers, num_slots, num_kv, max_len, dim = cache.k.shape
    src, dst, lengths = jnp.asarray(src), jnp.asarray(dst), jnp.asarray(lengths)
    chunk = min(FORK_CHUNK, max_len)
    block = (num_layers, 1, num_kv, chunk, dim)

    def copy_pair(i, kv):
        s, d = src[i], dst[i]

        def copy_chunk(c, kv):
            # A start past max_len - chunk is clamped to it, in src and dst alike: the block
            # copied then ends at max_len and still holds the same positions of both.
            at_src, at_dst = (0, s, 0, c * chunk, 0), (0, d, 0, c * chunk, 0)
            return tuple(
                jax.lax.dynamic_update_slice(x, jax.lax.dynamic_slice(x, at_src, block), at_dst) for x in kv
            )

        chunks = jnp.where(d < num_slots, (lengths[i] + chunk - 1) // chunk, 0)
        return jax.lax.fori_loop(0, chunks, copy_chunk, kv)

    k, v = jax.lax.fori_loop(0, src.shape[0], copy_pair, (cache.k, cache.v))
    return KVCache(k=k, v=v, lengths=cache.lengths.at[dst].set(lengths, mode="drop"))

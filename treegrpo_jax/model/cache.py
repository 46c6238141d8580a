"""KV cache as a pool of slots.

Legend: L layers, S slots, K kv heads, T max tokens per slot, D head dim.

Layout [L, S, K, T, D]: for one slot and kv head, keys are contiguous [T, D] rows, so
attention over a slot is a plain matrix product with no transpose per decode step.

Every slot has its own length, so every row writes at its own position: this is what
lets one batch hold the nodes of a tree at different depths (peers that keep one write
index for the whole batch cannot). Forking a branch is a copy of one slot into others.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from treegrpo_jax.model.config import ModelConfig

CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: Float[Array, "L S K T D"]
    v: Float[Array, "L S K T D"]
    lengths: Int[Array, " S"]  # tokens already written in each slot

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


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
    cache: KVCache, src: Int[Array, " N"], dst: Int[Array, " N"], lengths: Int[Array, " N"]
) -> KVCache:
    """Copies slot src[i] into slot dst[i] and sets dst[i]'s length to lengths[i].

    Copying the whole slot rather than the first `length` tokens keeps the shapes static;
    positions past the length are never attended to, so the result is the same. A length
    shorter than the source's starts a branch from a prefix. Pairs with dst == S (out of
    range) are ignored, which lets callers pad N.
    """
    k = cache.k.at[:, dst].set(cache.k[:, src], mode="drop")
    v = cache.v.at[:, dst].set(cache.v[:, src], mode="drop")
    return KVCache(k=k, v=v, lengths=cache.lengths.at[dst].set(lengths, mode="drop"))

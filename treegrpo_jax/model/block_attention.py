"""Block-sparse attention: each query block attends only the key blocks it lists.

Legend: B rows, T tokens, NQ blocks per row (T = NQ·C), C tokens per block, J key blocks
listed per query block (U = J·C keys), H query heads, K kv heads, G = H/K, D head dim.

A dense `[B, T, T]` mask costs T² per row whatever it hides. Packed trees
(`rl.packed`) hide most of it: a token sees only its own path, so a query block needs the
few key blocks its paths pass through. `BlockMask` lists them (`key_blocks`, -1 for an
unused slot) with the element mask inside them (`visible`); the attention gathers those key
and value blocks and runs a softmax over U = J·C keys instead of T. Same result as the
dense mask whenever the listed blocks hold every visible key once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int

from treegrpo_jax._pytree import pytree_dataclass

_NEG_INF = -1e30  # finite, as in decoder.py: a query that sees nothing must not produce NaNs


@pytree_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockMask:
    """Which keys each query sees, block by block.

    Attributes:
      key_blocks: the key blocks of each query block, each at most once; -1 marks an unused slot.
      visible: `visible[b, n, i, j·C + u]`: query i of block n sees key u of listed block j
        (False for unused slots).
    """

    key_blocks: Int[Array, "B NQ J"]
    visible: Bool[Array, "B NQ C U"]


def block_sparse_attention(q_BTHD: ArrayLike, k_BKTD: ArrayLike, v_BKTD: ArrayLike, mask: BlockMask) -> Array:
    """Grouped-query attention over the listed key blocks; returns `[B, T, H, D]`.

    Keys and values come head-major (`[B, K, T, D]`, the decoder's layout). The queries may be a
    run of whole query blocks of the keys' rows (`mask` then lists those blocks only): what
    `decoder.attention_chunk` computes one chunk at a time.
    """
    b, t, h, d = q_BTHD.shape
    k_heads = k_BKTD.shape[1]
    nq, j = mask.key_blocks.shape[1:]
    c = t // nq
    q = q_BTHD.reshape(b, nq, c, k_heads, h // k_heads, d)
    rows = jnp.arange(b)[:, None, None]
    idx = jnp.maximum(mask.key_blocks, 0)
    # Advanced indices on axes 0 and 2 around a slice: the gathered blocks come [B, NQ, J, K, C, D].
    k = k_BKTD.reshape(b, k_heads, -1, c, d)[rows, :, idx]
    v = v_BKTD.reshape(b, k_heads, -1, c, d)[rows, :, idx]
    scores = jnp.einsum("bnqkgd,bnjkud->bkgnqju", q, k, preferred_element_type=jnp.float32)
    scores = (scores * (d**-0.5)).reshape(*scores.shape[:5], j * c)
    # An added bias rather than a select: the backward then keeps no mask-shaped residual.
    scores = scores + jnp.where(mask.visible[:, None, None], 0.0, _NEG_INF).astype(jnp.float32)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(*scores.shape[:5], j, c)
    out = jnp.einsum("bkgnqju,bnjkud->bnqkgd", probs, v)
    return out.reshape(b, t, h, d)

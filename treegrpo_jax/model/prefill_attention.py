"""Chunked-prefill attention over flat (unpadded) tokens, read straight from the KV cache.

Legend: N tokens of a call (every row's chunk, concatenated, then padding), R rows, H query
heads, K kv heads, D head dim, MP pages per row.

Contract: row r's new tokens are `[row_start[r], row_start[r+1])` of the flat arrays; token j of
row r sits at position `offsets[r] + j` of the row's sequence. The call writes every new key and
value at its position, then each new token attends the row's keys `0 .. its position` (causal
within the chunk). Tokens past `row_start[R]` are padding (zeros out).

Only the CPU kernel (`treegrpo_jax/native/prefill_attention.cc`) implements it: the reference
it is tested against is the decoder's padded XLA `append` (rows × chunk bucket × span bucket,
`Decoder.append`), which stays the path on GPU / TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from treegrpo_jax.native import build as native_build


def prefill_attention_native(
    q_NHD: Float[ArrayLike, "N H D"],
    k_new_NKD: Float[ArrayLike, "N K D"],
    v_new_NKD: Float[ArrayLike, "N K D"],
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    layer: Int[ArrayLike, ""],
    pages_RM: Int[ArrayLike, "R M"],
    row_start: Int[ArrayLike, " R1"],
    offsets: Int[ArrayLike, " R"],
    *,
    paged: bool,
    attend: Int[ArrayLike, ""] | Bool[ArrayLike, ""] | bool = True,
) -> tuple[Float[Array, "N H D"], Array, Array]:
    """Writes the chunk's keys/values in place, then attends causally; returns (out, k, v).

    Args:
      q_NHD, k_new_NKD, v_new_NKD: the flat chunk's queries, keys, values (RoPE applied).
      k_cache, v_cache: slots `[L, S, K, T, D]` (`paged=False`, `pages_RM` = each row's slot
        as `[R, 1]`) or pages `[L, K, NP, P, D]` (`paged=True`, `pages_RM` = page tables);
        passed whole and returned aliased (the decoder's layer scan carries them).
      layer: the layer written and read.
      row_start: `[R + 1]` non-decreasing token offsets of the rows.
      offsets: `[R]` keys each row held before this chunk.
      attend: a traced or static flag; false writes only (out is zeros) — the last layer of a
        prefill whose hidden states nobody reads.
    """
    native_build.library()  # registers the FFI target (builds once if needed)
    n, h, d = q_NHD.shape
    call = jax.ffi.ffi_call(
        "treegrpo_prefill_attention",
        (
            jax.ShapeDtypeStruct((n, h, d), jnp.float32),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ),
        input_output_aliases={3: 1, 4: 2},
    )
    i32 = jnp.int32
    return call(
        q_NHD.astype(jnp.float32),
        k_new_NKD.astype(jnp.float32),
        v_new_NKD.astype(jnp.float32),
        k_cache,
        v_cache,
        jnp.asarray(layer, i32),
        jnp.asarray(attend, i32),
        pages_RM.astype(i32),
        row_start.astype(i32),
        offsets.astype(i32),
        scale=np.float32(d**-0.5),
        paged=np.int32(paged),
    )

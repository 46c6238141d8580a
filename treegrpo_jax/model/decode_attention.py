"""One-query (decode) attention read straight from the stacked slot cache.

Legend: B rows, H query heads, K kv heads, G = H/K, D head dim, L layers, S slots,
T slot capacity.

Two implementations of one contract — row b attends the first `lengths[b]` keys of slot
`slots[b]` in layer `layer` of `[L, S, K, T, D]` caches, in f32 whatever the stored dtype:

  * `xla`: gather the rows' slots and attend a masked span (any backend; the reference);
  * `native`: the CPU kernel of `treegrpo_jax/native/decode_attention.cc` through the XLA
    FFI, which reads each row's live keys once, in place, for its whole GQA group.

Which one runs is `treegrpo_jax.native.Kernels`, resolved once per engine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from treegrpo_jax.native import build as native_build

_NEG_INF = -1e30


def decode_attention_xla(
    q_BHD: Float[ArrayLike, "B H D"],
    k_LSKTD: ArrayLike,
    v_LSKTD: ArrayLike,
    layer: Int[ArrayLike, ""],
    slots: Int[ArrayLike, " B"],
    lengths: Int[ArrayLike, " B"],
    *,
    attend_len: int | None = None,
) -> Float[Array, "B H D"]:
    """Reference: gather, mask keys at or past each row's length, softmax in f32.

    `attend_len` bounds the span read (≥ every row's length). Rows whose slot is out of range
    read the last slot (their output is ignored by callers).
    """
    _, s, k, t, d = k_LSKTD.shape
    u = t if attend_len is None else attend_len
    b, h, _ = q_BHD.shape
    rows = jnp.minimum(slots, s - 1)
    keys = jax.lax.dynamic_index_in_dim(k_LSKTD, layer, keepdims=False)[rows, :, :u].astype(jnp.float32)
    values = jax.lax.dynamic_index_in_dim(v_LSKTD, layer, keepdims=False)[rows, :, :u].astype(jnp.float32)
    q = q_BHD.reshape(b, k, h // k, d).astype(jnp.float32)
    scores = jnp.einsum("bkgd,bkud->bkgu", q, keys) * (d**-0.5)
    live = jnp.arange(u)[None, :] < lengths[:, None]  # [B, U]
    scores = jnp.where(live[:, None, None, :], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgu,bkud->bkgd", probs, values)
    return out.reshape(b, h, d)


def decode_attention_native(
    q_BHD: Float[ArrayLike, "B H D"],
    k_new_BKD: Float[ArrayLike, "B K D"],
    v_new_BKD: Float[ArrayLike, "B K D"],
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    layer: Int[ArrayLike, ""],
    pages_BM: Int[ArrayLike, "B M"],
    write_pos: Int[ArrayLike, " B"],
    lengths: Int[ArrayLike, " B"],
    *,
    paged: bool,
) -> tuple[Float[Array, "B H D"], Array, Array]:
    """The CPU kernel: writes each row's new key/value at `write_pos[b]` (≥ M·P: none), then
    attends as `decode_attention_xla`; returns (out, k cache, v cache).

    `paged=False`: slot caches `[L, S, K, T, D]`, `pages_BM` = each row's slot as `[B, 1]`;
    `paged=True`: page pools `[L, K, NP, P, D]`, `pages_BM` = each row's page table.
    The caches are passed whole and come back aliased (updated in place): inside the
    decoder's layer scan they are the loop carry, so neither a per-layer slice nor a scatter
    (which XLA:CPU runs on bf16 by converting the whole operand to f32) touches the pool.
    Rows whose first page is out of range or whose length is 0 give zeros.
    """
    native_build.library()  # registers the FFI target (builds once if needed)
    b, h, d = q_BHD.shape
    call = jax.ffi.ffi_call(
        "treegrpo_decode_attention",
        (
            jax.ShapeDtypeStruct((b, h, d), jnp.float32),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ),
        input_output_aliases={3: 1, 4: 2},
    )
    i32 = jnp.int32
    return call(
        q_BHD.astype(jnp.float32),
        k_new_BKD.astype(jnp.float32),
        v_new_BKD.astype(jnp.float32),
        k_cache,
        v_cache,
        jnp.asarray(layer, i32),
        pages_BM.astype(i32),
        write_pos.astype(i32),
        lengths.astype(i32),
        scale=np.float32(d**-0.5),
        paged=np.int32(paged),
    )

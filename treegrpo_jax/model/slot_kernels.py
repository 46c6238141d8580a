"""Decode attention over the slot cache with JAX's Pallas GPU kernel (Triton), per-row lengths.

Legend: B rows, H query heads, K kv heads, U keys attended (the engine's `attend_len`), D head dim.

`jax.experimental.pallas.ops.gpu.decode_attention.gqa` splits each row's keys into `k_splits`
chunks that run in parallel (flash-decoding) and stops reading a row at its own length, so a decode
step reads each row's live keys once instead of the whole `[B, K, U, D]` span an XLA softmax touches.
It takes keys sequence-major (`[B, U, K, D]`) and swaps them back to head-major itself; our cache is
head-major (`[B, K, U, D]`), so the swap we hand it and the one it makes cancel in XLA and nothing
is copied. It runs on CPU in interpret mode, so its exactness test runs in CI.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int


def _split(u: int) -> tuple[int, int] | None:
    """(k_splits, block_k) the kernel accepts for `u` keys: splits of ≥ 16 keys, each a multiple
    of its block (≥ 16); as many splits as divide `u` up to 16. None when `u` allows none."""
    for splits in (16, 8, 4, 2, 1):
        per = u // splits
        if u % splits or per < 16:
            continue
        for block in (128, 64, 32, 16):
            if per % block == 0:
                return splits, block
    return None


def slot_attention_pallas(
    q_BHD: Float[ArrayLike, "B H D"],
    k_BKUD: ArrayLike,
    v_BKUD: ArrayLike,
    lengths: Int[ArrayLike, " B"],
    *,
    interpret: bool = False,
) -> Float[Array, "B H D"]:
    """Softmax attention of each row's query over its first `lengths[b]` keys (rows of length 0
    give zeros). Keys and values come head-major, as the slot cache stores them."""
    from jax.experimental.pallas.ops.gpu import decode_attention as gpu

    b, k_heads, u, d = k_BKUD.shape
    split = _split(u)
    if split is None:  # pad the span to a multiple of 16: the padding lies past every row's length
        widths = ((0, 0), (0, 0), (0, max(16, -(-u // 16) * 16) - u), (0, 0))
        k_BKUD, v_BKUD = jnp.pad(k_BKUD, widths), jnp.pad(v_BKUD, widths)
        split = _split(k_BKUD.shape[2])
    splits, block = split
    out = gpu.gqa(
        q_BHD.astype(k_BKUD.dtype),  # Triton's dot takes one dtype
        k_BKUD.swapaxes(1, 2),
        v_BKUD.swapaxes(1, 2),
        kv_seq_len=jnp.maximum(lengths, 1).astype(jnp.int32),  # 0 would divide by a zero sum
        sm_scale=d**-0.5,
        block_k=block,
        k_splits=splits,
        interpret=interpret,
    )
    return jnp.where((lengths > 0)[:, None, None], out.astype(jnp.float32), 0.0)


__all__ = ["slot_attention_pallas"]

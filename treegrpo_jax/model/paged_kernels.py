"""Decode attention over pages with JAX's Pallas kernels (GPU, TPU), and its XLA reference.

Legend: B rows, H query heads, K kv heads, G = H/K, NP pages, P tokens per page, D head dim,
M pages per row.

One layer's pages `[K, NP, P, D]` (the paged cache's layout, so nothing is copied) and each
row's page table `[B, M]` go to

  * GPU: `jax.experimental.pallas.ops.gpu.paged_attention` (Triton; block tables + lengths, GQA);
  * TPU: `jax.experimental.pallas.ops.tpu.paged_attention` (Mosaic; the decode-only kernel —
    the newer `ragged_paged_attention` mixes prefill and decode in one call, but its TPU
    interpret mode fails in this JAX (0.10.2: a reshaped ref in the interpreter), so its
    exactness could not be tested here; decode is all the engine asks of a kernel);

and both run on CPU in interpret mode, so their exactness tests run in CI without a GPU or
TPU. The TPU kernel computes with K/V rounded to bf16 (it dequantises every page to bf16), so it
is exact for bf16 storage — the default on accelerators — and within bf16 rounding for f32.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from treegrpo_jax.model.decode_attention import decode_attention_xla

PLATFORMS = ("gpu", "tpu")


def paged_attention_xla(
    q_BHD: Float[ArrayLike, "B H D"],
    k_pages: ArrayLike,
    v_pages: ArrayLike,
    pages_BM: Int[ArrayLike, "B M"],
    lengths: Int[ArrayLike, " B"],
) -> Float[Array, "B H D"]:
    """Reference: each row's pages gathered in table order are a slot; attend it with the slot
    cache's reference (`decode_attention_xla`). Rows of length 0 give zeros."""
    k_heads, num_pages, p, d = k_pages.shape
    b, m = pages_BM.shape
    pages = jnp.clip(pages_BM, 0, num_pages - 1)

    def as_slots(pool):  # [1, B, K, M·P, D]: one layer of B slots
        return pool[:, pages].transpose(1, 0, 2, 3, 4).reshape(1, b, k_heads, m * p, d)

    out = decode_attention_xla(q_BHD, as_slots(k_pages), as_slots(v_pages), 0, jnp.arange(b), lengths)
    return jnp.where((lengths > 0)[:, None, None], out, 0.0)


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest power of two ≤ `at_most` dividing `n` (kernel block counts must divide M)."""
    k = 1
    while k * 2 <= at_most and n % (k * 2) == 0:
        k *= 2
    return k


def paged_attention_pallas(
    q_BHD: Float[ArrayLike, "B H D"],
    k_pages: ArrayLike,
    v_pages: ArrayLike,
    pages_BM: Int[ArrayLike, "B M"],
    lengths: Int[ArrayLike, " B"],
    *,
    platform: str,
    interpret: bool = False,
) -> Float[Array, "B H D"]:
    """The Pallas kernel of `platform` ("gpu" or "tpu"); `interpret` runs it on any backend.

    Rows of length 0 (padding) give zeros. Page ids are clipped into the pool (entries past a
    row's length are masked by the kernels).
    """
    if platform not in PLATFORMS:
        raise ValueError(f"paged_attention_pallas: platform={platform!r}; allowed: {list(PLATFORMS)}")
    num_pages = k_pages.shape[1]
    m = pages_BM.shape[1]
    d = q_BHD.shape[-1]
    pages = jnp.clip(pages_BM, 0, num_pages - 1).astype(jnp.int32)
    lens = jnp.maximum(lengths, 1).astype(jnp.int32)  # length 0 would divide by a zero sum
    q = q_BHD.astype(jnp.float32) * (d**-0.5)  # both kernels take q pre-scaled
    if platform == "gpu":
        q = q.astype(k_pages.dtype)  # Triton's dot takes one dtype (the TPU kernel upcasts itself)
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu

        splits = _largest_divisor(m, 16)
        out = gpu.paged_attention(
            q,
            k_pages,
            v_pages,
            pages,
            lens,
            block_h=16,
            k_splits=splits,
            pages_per_compute_block=_largest_divisor(m // splits, 8),
            interpret=interpret,
        )
    else:
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as tpu

        mode = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
        with mode:
            out = tpu.paged_attention(
                q, k_pages, v_pages, lens, pages, pages_per_compute_block=_largest_divisor(m, 8)
            )
    return jnp.where((lengths > 0)[:, None, None], out.astype(jnp.float32), 0.0)


def platform_for_backend(backend: str | None = None) -> tuple[str, bool]:
    """(kernel platform, interpret) for a JAX backend: its own kernel on GPU / TPU, the GPU kernel
    interpreted elsewhere (CPU: tests only — far slower than the native CPU kernel)."""
    backend = backend or jax.default_backend()
    if backend in PLATFORMS:
        return backend, False
    return "gpu", True


__all__ = ["paged_attention_pallas", "paged_attention_xla", "platform_for_backend"]

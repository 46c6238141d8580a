"""Causal attention over left-aligned rows through `jax.nn.dot_product_attention`: cuDNN's fused
(flash) kernel on GPU, XLA elsewhere.

Legend: B rows, T tokens, H query heads, K kv heads, D head dim.

A `[B, T, T]` mask can say anything, so the decoder's general path materialises `[B, H, T, T]`
scores. The commonest mask says only "causal, and row b has `lengths[b]` real tokens" (path rows
of the RL step, a cold-start batch, `rl.token_logprobs`): `CausalMask` states exactly that, and
then the fused kernel runs without ever forming the scores. Real queries see the same keys as under
`decoder.causal_mask(valid)`; a padding query sees the row's real keys (not token 0), which changes
only outputs at padding positions that nothing reads.

Where cuDNN does not run (CPU, TPU, f32 compute: cuDNN takes bf16 / f16 only) the decoder keeps
its own dense path with `causal_mask` (`implementation` returns "dense"), so CPU results are
unchanged to the bit. The XLA implementation of the same call is what the tests hold the fused
path to (`tests/model/test_causal_attention.py`); on a GPU, `benchmarks/gpu_check.py` compares
cuDNN with it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int

from treegrpo_jax._pytree import pytree_dataclass


@pytree_dataclass
@dataclasses.dataclass(frozen=True)
class CausalMask:
    """Causal attention within each row's first `lengths[b]` tokens (left-aligned rows)."""

    lengths: Int[Array, " B"]

    def valid(self, t: int) -> Array:
        """`[B, T]`: the real tokens."""
        return jnp.arange(t)[None, :] < self.lengths[:, None]


def implementation(dtype) -> str:
    """ "cudnn" on a GPU with bf16 / f16 compute, else "dense" (the decoder's own masked path)."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if jax.default_backend() == "gpu" and half else "dense"


def causal_attention(
    q_BTHD: ArrayLike, k_BTKD: ArrayLike, v_BTKD: ArrayLike, mask: CausalMask, *, impl: str
) -> Array:
    """Grouped-query causal attention, `[B, T, H, D]` (sequence-major inputs); `impl` is
    `jax.nn.dot_product_attention`'s ("cudnn", or "xla": the reference)."""
    # A row of length 0 (padding rows) would see no key: give it token 0, as `causal_mask` does.
    lengths = jnp.maximum(mask.lengths, 1).astype(jnp.int32)
    return jax.nn.dot_product_attention(
        q_BTHD, k_BTKD, v_BTKD, is_causal=True, key_value_seq_lengths=lengths, implementation=impl
    )


__all__ = ["CausalMask", "causal_attention", "implementation"]

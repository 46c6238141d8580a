"""The CPU decode-attention kernel against the XLA reference, and inside the decoder."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.cache import init_cache
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decode_attention import decode_attention_native, decode_attention_xla
from treegrpo_jax.native import Kernels, build

pytestmark = pytest.mark.skipif(not build.available(), reason="CPU kernels not built (no compiler)")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 32), (3, 3, 8), (9, 3, 64), (8, 1, 16)])
def test_kernel_equals_reference(dtype, heads, kv_heads, head_dim):
    """Ragged lengths (1 .. T), rows in any slot order, every layer; bf16 storage read as f32."""
    layers, slots, t, b = 3, 7, 40, 5
    rng = jax.random.split(jax.random.key(0), 3)
    k = jax.random.normal(rng[0], (layers, slots, kv_heads, t, head_dim)).astype(dtype)
    v = jax.random.normal(rng[1], (layers, slots, kv_heads, t, head_dim)).astype(dtype)
    q = jax.random.normal(rng[2], (b, heads, head_dim))
    rows = jnp.asarray([6, 0, 3, 2, 5], jnp.int32)
    lengths = jnp.asarray([1, 40, 17, 33, 2], jnp.int32)
    for layer in range(layers):
        want = jax.jit(decode_attention_xla)(q, k, v, layer, rows, lengths)
        got = jax.jit(decode_attention_native)(q, k, v, layer, rows, lengths)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)


def test_padding_rows_and_empty_rows_give_zeros():
    k = jnp.ones((1, 2, 1, 8, 4))
    q = jnp.ones((3, 2, 4))
    out = decode_attention_native(q, k, k, 0, jnp.asarray([0, 2, 1]), jnp.asarray([0, 5, 3]))
    np.testing.assert_array_equal(np.asarray(out[:2]), 0.0)  # no keys; a slot out of range
    np.testing.assert_allclose(np.asarray(out[2]), 1.0)


def test_bad_shapes_are_refused_with_a_message():
    k = jnp.ones((1, 2, 3, 8, 4))
    with pytest.raises(Exception, match="inconsistent q / cache"):
        decode_attention_native(jnp.ones((2, 4, 4)), k, k, 0, jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32))
    with pytest.raises(Exception, match="k and v must both be float32 or bfloat16"):
        decode_attention_native(
            jnp.ones((2, 3, 4)), k, k.astype(jnp.float16), 0, jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32)
        )


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16])
def test_decoder_decode_step_native_equals_xla(kv_dtype):
    """Decoder.append with one token per row: same logits and cache with either kernel."""
    cfg = ModelConfig(
        vocab_size=61, embed_dim=48, mlp_dim=64, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8
    )
    model = init_model(cfg, seed=3)
    cache = init_cache(cfg, num_slots=5, max_len=32, dtype=kv_dtype)
    prompts = jax.random.randint(jax.random.key(1), (5, 12), 1, 61)
    chunk = jnp.asarray([12, 3, 7, 0, 9])
    _, cache = model.append(prompts, chunk, cache)
    tokens = jnp.asarray([[4], [5], [6], [7]])
    slots = jnp.asarray([2, 0, 5, 4])  # slot 5 is out of range: a padding row
    lens = jnp.asarray([1, 1, 1, 1])
    outs = {}
    for kernels in (Kernels.XLA, Kernels.NATIVE):
        step = jax.jit(lambda t, n, c, s, kernels=kernels: model.append(t, n, c, slots=s, kernels=kernels))
        outs[kernels] = step(tokens, lens, cache, slots)
    (lx, cx), (ln, cn) = outs[Kernels.XLA], outs[Kernels.NATIVE]
    np.testing.assert_allclose(np.asarray(ln)[[0, 1, 3]], np.asarray(lx)[[0, 1, 3]], atol=1e-5)
    # Layer 0's keys are written before any attention: equal; later layers' to rounding.
    np.testing.assert_array_equal(np.asarray(cn.k[0]), np.asarray(cx.k[0]))
    np.testing.assert_allclose(np.asarray(cn.k, np.float32), np.asarray(cx.k, np.float32), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(cn.lengths), np.asarray(cx.lengths))

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


def _native(q, k, v, layer, slots, lengths, *, k_new=None, v_new=None, write_pos=None):
    """The kernel; by default it writes nothing (write positions out of range)."""
    b, _, d = q.shape
    kv = k.shape[2]
    k_new = jnp.zeros((b, kv, d)) if k_new is None else k_new
    v_new = jnp.zeros((b, kv, d)) if v_new is None else v_new
    write_pos = jnp.full((b,), k.shape[3], jnp.int32) if write_pos is None else write_pos
    return decode_attention_native(
        q, k_new, v_new, k, v, layer, slots[:, None], write_pos, lengths, paged=False
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(4, 2, 32), (3, 3, 8), (9, 3, 64), (8, 1, 16), (14, 2, 128), (10, 2, 32)],
)
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
        got, k_out, v_out = jax.jit(_native)(q, k, v, layer, rows, lengths)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)
        np.testing.assert_array_equal(np.asarray(k_out), np.asarray(k))  # nothing written


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_writes_the_new_keys_in_place_then_attends_them(dtype):
    """Same cache as XLA's scatter (bf16 rounded to nearest even) and the row sees its own key."""
    layers, slots, kv, t, d, b = 2, 4, 2, 16, 8, 3
    rng = jax.random.split(jax.random.key(1), 6)
    k = jax.random.normal(rng[0], (layers, slots, kv, t, d)).astype(dtype)
    v = jax.random.normal(rng[1], (layers, slots, kv, t, d)).astype(dtype)
    q = jax.random.normal(rng[2], (b, 4, d))
    k_new = jax.random.normal(rng[3], (b, kv, d))
    v_new = jax.random.normal(rng[4], (b, kv, d))
    rows = jnp.asarray([3, 1, 9], jnp.int32)  # row 2 is padding
    pos = jnp.asarray([5, 15, 2], jnp.int32)
    lengths = pos + 1
    k_ref = k.at[1, rows, :, pos].set(k_new.astype(dtype), mode="drop")
    v_ref = v.at[1, rows, :, pos].set(v_new.astype(dtype), mode="drop")
    want = decode_attention_xla(q, k_ref, v_ref, 1, rows, lengths)
    got, k_out, v_out = jax.jit(_native, donate_argnums=(1, 2))(
        q, k, v, 1, rows, lengths, k_new=k_new, v_new=v_new, write_pos=pos
    )
    np.testing.assert_array_equal(np.asarray(k_out, np.float32), np.asarray(k_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(v_out, np.float32), np.asarray(v_ref, np.float32))
    np.testing.assert_allclose(np.asarray(got)[:2], np.asarray(want)[:2], atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got)[2], 0.0)


def test_padding_rows_and_empty_rows_give_zeros():
    k = jnp.ones((1, 2, 1, 8, 4))
    q = jnp.ones((3, 2, 4))
    out, _, _ = _native(q, k, k, 0, jnp.asarray([0, 2, 1]), jnp.asarray([0, 5, 3]))
    np.testing.assert_array_equal(np.asarray(out[:2]), 0.0)  # no keys; a slot out of range
    np.testing.assert_allclose(np.asarray(out[2]), 1.0)


def test_bad_shapes_are_refused_with_a_message():
    k = jnp.ones((1, 2, 3, 8, 4))
    with pytest.raises(Exception, match="inconsistent q / cache"):
        _native(jnp.ones((2, 4, 4)), k, k, 0, jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32))
    with pytest.raises(Exception, match="k and v must both be float32 or bfloat16"):
        _native(
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

"""The Pallas GPU decode kernel over slots (interpreted on CPU) against the XLA reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.cache import init_cache
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decode_attention import decode_attention_xla
from treegrpo_jax.model.slot_kernels import _split, slot_attention_pallas
from treegrpo_jax.native import Kernels


def _problem(u, d, dtype, *, b=4, h=8, k=2, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, h, d)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(b, k, u, d)), dtype)
    values = jnp.asarray(rng.normal(size=(b, k, u, d)), dtype)
    lengths = jnp.asarray([1, 17, u // 2 + 3, u], jnp.int32)[:b]
    return q, keys, values, lengths


def _reference(q, keys, values, lengths):
    # `decode_attention_xla` reads layer 0 of a [L, S, K, T, D] pool, row b from slot b.
    b = q.shape[0]
    return decode_attention_xla(q, keys[None], values[None], 0, jnp.arange(b), lengths)


@pytest.mark.parametrize("u", [128, 2048, 100, 8])  # split 16 ways, 8 ways; padded spans
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_decode_kernel_interpreted_equals_reference(u, dtype):
    q, keys, values, lengths = _problem(u, 64, dtype)
    lengths = jnp.minimum(lengths, u)
    got = slot_attention_pallas(q, keys, values, lengths, interpret=True)
    # The kernel takes q in the storage dtype (one dtype per dot); for bf16 it also rounds the
    # probabilities and its output to bf16 (2^-8 relative each): a few bf16 ulps of slack.
    want = _reference(q.astype(dtype).astype(jnp.float32), keys, values, lengths)
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == jnp.bfloat16 else dict(rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)


def test_padding_rows_give_zeros_and_every_span_has_a_split():
    q, keys, values, _ = _problem(128, 32, jnp.float32)
    got = slot_attention_pallas(q, keys, values, jnp.asarray([0, 3, 0, 9]), interpret=True)
    np.testing.assert_array_equal(np.asarray(got)[[0, 2]], 0.0)
    assert _split(128) == (8, 16) and _split(4096) == (16, 128) and _split(100) is None


def test_decoder_decode_over_slots_with_the_pallas_kernel_equals_xla():
    cfg = ModelConfig(
        vocab_size=61, embed_dim=64, mlp_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    model = init_model(cfg, seed=2)
    cache = init_cache(cfg, num_slots=4, max_len=256)
    prompts = jax.random.randint(jax.random.key(1), (4, 40), 1, 61)
    _, cache = model.append(prompts, jnp.asarray([40, 7, 13, 0]), cache)
    outs = {}
    for kernels in (Kernels.XLA, Kernels.PALLAS):
        c, logits = cache, []
        step = jax.jit(
            lambda t, n, c, s, kernels=kernels: model.append(
                t, n, c, slots=s, attend_len=128, kernels=kernels
            )
        )
        for i in range(3):  # rows of different lengths; row 3 (slot 0 again) is a batch smaller than the pool
            out, c = step(jnp.asarray([[3 + i], [4], [5]]), jnp.ones(3, jnp.int32), c, jnp.asarray([0, 1, 2]))
            logits.append(np.asarray(out))
        outs[kernels] = logits
    for a, b in zip(outs[Kernels.XLA], outs[Kernels.PALLAS], strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)

"""`CausalMask`: the fused-attention path (cuDNN on GPU; its XLA implementation here) against the
decoder's dense causal mask, and the CPU path unchanged to the bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.model import causal_attention as ca
from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import causal_mask

CFG = ModelConfig(
    vocab_size=61, embed_dim=48, mlp_dim=64, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8
)
LENGTHS = jnp.asarray([24, 9, 1, 0], jnp.int32)  # full, partial, one token, a padding row


def _valid_rows(x, lengths):
    return [np.asarray(x[b, : max(int(n), 0)]) for b, n in enumerate(lengths)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_call_equals_the_dense_mask_on_real_tokens(dtype):
    model = init_model(CFG, seed=0)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(4, 24, 6, 8)), dtype)
    k = jnp.asarray(rng.normal(size=(4, 24, 2, 8)), dtype)
    v = jnp.asarray(rng.normal(size=(4, 24, 2, 8)), dtype)
    mask = ca.CausalMask(LENGTHS)
    got = ca.causal_attention(q, k, v, mask, impl="xla")
    bias = jnp.where(causal_mask(mask.valid(24)), 0.0, -1e30)[:, None, None]
    want = model._attend(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), bias)
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-6
    for g, w in zip(_valid_rows(got, LENGTHS), _valid_rows(want, LENGTHS), strict=True):
        np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), atol=tol, rtol=tol)
    assert np.all(np.isfinite(np.asarray(got, np.float32)))  # padding rows too


def test_decoder_hidden_with_the_fused_path_equals_dense(monkeypatch):
    model = init_model(CFG, seed=1)
    tokens = jax.random.randint(jax.random.key(0), (4, 24), 1, 61)
    positions = jnp.broadcast_to(jnp.arange(24), (4, 24))
    mask = ca.CausalMask(LENGTHS)
    dense = model.hidden(tokens, positions, causal_mask(mask.valid(24)))
    same = model.hidden(tokens, positions, mask)  # CPU: the dense path, bit for bit
    np.testing.assert_array_equal(np.asarray(same), np.asarray(dense))
    monkeypatch.setattr(ca, "implementation", lambda dtype: "xla")  # what cuDNN computes on a GPU
    from treegrpo_jax.model import decoder

    monkeypatch.setattr(decoder, "causal_implementation", lambda dtype: "xla")
    fused = model.hidden(tokens, positions, mask)
    for g, w in zip(_valid_rows(fused, LENGTHS), _valid_rows(dense, LENGTHS), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)


def test_cudnn_only_on_gpu_with_half_precision():
    assert ca.implementation(jnp.bfloat16) == ("cudnn" if jax.default_backend() == "gpu" else "dense")
    assert ca.implementation(jnp.float32) == "dense"

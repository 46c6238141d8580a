"""Cascade attention equals per-row attention over each row's prefix + own keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.model.cascade_attention import cascade_attention
from treegrpo_jax.model.decode_attention import decode_attention_xla


def _per_row(q, sk, sv, s_len, ok, ov, o_len):
    """The reference: each row's keys laid out as one slot (prefix, then own), attended alone."""
    g, r, h, d = q.shape
    rows_k, rows_v, lens = [], [], []
    for gi in range(g):
        for ri in range(r):
            n = int(s_len[gi])
            rows_k.append(jnp.concatenate([sk[gi][:, :n], ok[gi, ri]], axis=1))
            rows_v.append(jnp.concatenate([sv[gi][:, :n], ov[gi, ri]], axis=1))
            lens.append(n + int(o_len[gi, ri]))
    t = max(x.shape[1] for x in rows_k)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, t - x.shape[1]), (0, 0)))  # noqa: E731
    k = jnp.stack([pad(x) for x in rows_k])[None]
    v = jnp.stack([pad(x) for x in rows_v])[None]
    out = decode_attention_xla(q.reshape(g * r, h, d), k, v, 0, jnp.arange(g * r), jnp.asarray(lens))
    return out.reshape(g, r, h, d)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_equals_per_row_attention(heads, kv_heads):
    g, r, s, u, d = 3, 6, 40, 8, 16
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (g, r, heads, d))
    sk = jax.random.normal(ks[1], (g, kv_heads, s, d))
    sv = jax.random.normal(ks[2], (g, kv_heads, s, d))
    ok = jax.random.normal(ks[3], (g, r, kv_heads, u, d))
    ov = jax.random.normal(ks[4], (g, r, kv_heads, u, d))
    s_len = jnp.asarray([40, 17, 0])  # the last group shares nothing
    o_len = jnp.asarray([[8, 1, 0, 5, 8, 3], [2, 2, 8, 0, 1, 7], [8, 4, 1, 2, 3, 6]])  # row 0,2: prefix only
    got = jax.jit(cascade_attention)(q, sk, sv, s_len, ok, ov, o_len)
    want = _per_row(q, sk, sv, s_len, ok, ov, o_len)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6)


def test_a_row_with_no_keys_gives_zeros_not_nan():
    q = jnp.ones((1, 2, 2, 4))
    k = jnp.ones((1, 1, 3, 4))
    own = jnp.ones((1, 2, 1, 2, 4))
    out = cascade_attention(q, k, k, jnp.asarray([0]), own, own, jnp.asarray([[0, 2]]))
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_array_equal(np.asarray(out[0, 0]), 0.0)
    np.testing.assert_allclose(np.asarray(out[0, 1]), 1.0)

"""Shared-prefix ("cascade") decode attention: a group's common prefix is read once for all its rows.

Legend: G groups, R rows per group, H query heads, K kv heads, Q = H/K query heads per kv head,
S shared-prefix keys, U own keys per row, D head dim.

The rows of a group (the M trees of a prompt, the branches of a node) attend the same prefix
keys. Per-row attention reads them R times; here the prefix is one matmul of all the group's
queries `[K, R·Q, D]` against its keys `[K, S, D]`, and each row's own suffix is a per-row
product. Softmax over the union is exact from the two parts' log-sum-exps:

    out = (e^{lse_1} · out_1 + e^{lse_2} · out_2) / (e^{lse_1} + e^{lse_2})

with each part's `out_i` normalised within the part. A part with no keys has lse = -inf and
weight 0. `benchmarks/rollout.py --parts=paged` measures it against per-row attention (and the
crossover prefix length where it starts to pay).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

_NEG_INF = -1e30


def _part(scores, values, live):
    """(normalised output, log-sum-exp) of one part; rows with no live key get lse = -inf."""
    scores = jnp.where(live, scores, _NEG_INF)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - m)
    total = jnp.sum(p, axis=-1, keepdims=True)
    out = values(p / total)
    any_live = jnp.any(live, axis=-1, keepdims=True)
    lse = jnp.where(any_live, m + jnp.log(total), -jnp.inf)
    return jnp.where(any_live, out, 0.0), lse


def cascade_attention(
    q_GRHD: Float[ArrayLike, "G R H D"],
    shared_k_GKSD: ArrayLike,
    shared_v_GKSD: ArrayLike,
    shared_len: Int[ArrayLike, " G"],
    own_k_GRKUD: ArrayLike,
    own_v_GRKUD: ArrayLike,
    own_len: Int[ArrayLike, "G R"],
) -> Float[Array, "G R H D"]:
    """Attention of every row over its group's first `shared_len[g]` prefix keys followed by its
    own first `own_len[g, r]` keys, in f32; equal to per-row attention over the concatenation."""
    g, r, h, d = q_GRHD.shape
    k_heads = shared_k_GKSD.shape[1]
    qh = h // k_heads
    q = q_GRHD.astype(jnp.float32).reshape(g, r, k_heads, qh, d) * (d**-0.5)
    # The prefix: the whole group's queries in one product per kv head, each key read once.
    q_shared = q.transpose(0, 2, 1, 3, 4).reshape(g, k_heads, r * qh, d)
    sk, sv = shared_k_GKSD.astype(jnp.float32), shared_v_GKSD.astype(jnp.float32)
    scores = jnp.einsum("gkqd,gksd->gkqs", q_shared, sk)
    live = (jnp.arange(sk.shape[2])[None, :] < shared_len[:, None])[:, None, None, :]
    out_s, lse_s = _part(scores, lambda p: jnp.einsum("gkqs,gksd->gkqd", p, sv), live)
    out_s = out_s.reshape(g, k_heads, r, qh, d).transpose(0, 2, 1, 3, 4)
    lse_s = lse_s.reshape(g, k_heads, r, qh, 1).transpose(0, 2, 1, 3, 4)
    # Each row's own suffix.
    ok, ov = own_k_GRKUD.astype(jnp.float32), own_v_GRKUD.astype(jnp.float32)
    scores = jnp.einsum("grkqd,grkud->grkqu", q, ok)
    live = (jnp.arange(ok.shape[3])[None, None, :] < own_len[:, :, None])[:, :, None, None, :]
    out_o, lse_o = _part(scores, lambda p: jnp.einsum("grkqu,grkud->grkqd", p, ov), live)
    # Exact merge by the parts' log-sum-exps.
    lse = jnp.logaddexp(lse_s, lse_o)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w_s = jnp.where(jnp.isfinite(lse_s), jnp.exp(lse_s - safe), 0.0)
    w_o = jnp.where(jnp.isfinite(lse_o), jnp.exp(lse_o - safe), 0.0)
    return (w_s * out_s + w_o * out_o).reshape(g, r, h, d)

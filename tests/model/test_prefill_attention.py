"""The CPU chunked-prefill kernel against a float64 NumPy reference, and `Decoder.prefill`
against the decoder's padded XLA `append` (slots and pages, f32 and bf16 K/V)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.cache import init_cache
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.paged_cache import init_paged_cache
from treegrpo_jax.model.prefill_attention import prefill_attention_native
from treegrpo_jax.native import Kernels, build

pytestmark = pytest.mark.skipif(not build.available(), reason="CPU kernels not built (no compiler)")


def _reference(q, k_new, v_new, k, v, layer, slots, row_start, offsets):
    """Plain loops in float64 over the slot cache [L, S, K, T, D]: write, then attend causally."""
    k, v = np.array(k, np.float64), np.array(v, np.float64)
    q, k_new, v_new = (np.asarray(x, np.float64) for x in (q, k_new, v_new))
    n, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    out = np.zeros((n, h, d))
    for r, s in enumerate(slots):
        if s >= k.shape[1]:
            continue
        for j, i in enumerate(range(row_start[r], row_start[r + 1])):
            k[layer, s, :, offsets[r] + j] = k_new[i]
            v[layer, s, :, offsets[r] + j] = v_new[i]
    for r, s in enumerate(slots):
        for j, i in enumerate(range(row_start[r], row_start[r + 1])):
            if s >= k.shape[1]:
                continue
            seen = offsets[r] + j + 1
            for head in range(h):
                keys, vals = k[layer, s, head // g, :seen], v[layer, s, head // g, :seen]
                scores = keys @ q[i, head] / np.sqrt(d)
                w = np.exp(scores - scores.max())
                out[i, head] = (w / w.sum()) @ vals
    return out, k, v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 32), (9, 3, 8), (8, 1, 64), (6, 6, 16)])
def test_kernel_equals_reference(dtype, heads, kv_heads, head_dim):
    """Ragged rows (1 to 23 tokens, at offsets 0 to 30), a padding row, padding tokens, rows in any
    slot order; tiles of 16 queries cut tokens' head groups (G = 3) and span several tokens."""
    layers, slots, t = 2, 6, 64
    rng = np.random.default_rng(0)
    k = rng.normal(size=(layers, slots, kv_heads, t, head_dim)).astype(np.float32)
    v = rng.normal(size=(layers, slots, kv_heads, t, head_dim)).astype(np.float32)
    k, v = (np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32)) for x in (k, v))
    row_slots = np.asarray([4, 0, 6, 2, 5], np.int32)  # slot 6 is out of range: a padding row
    chunk = np.asarray([23, 1, 0, 9, 16])
    offsets = np.asarray([0, 30, 0, 7, 21], np.int32)
    row_start = np.concatenate([[0], np.cumsum(chunk)]).astype(np.int32)
    n = int(row_start[-1]) + 5  # padding tokens
    q = rng.normal(size=(n, heads, head_dim)).astype(np.float32)
    k_new = rng.normal(size=(n, kv_heads, head_dim)).astype(np.float32)
    v_new = rng.normal(size=(n, kv_heads, head_dim)).astype(np.float32)
    k_new, v_new = (np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32)) for x in (k_new, v_new))
    layer = 1
    call = jax.jit(prefill_attention_native, static_argnames=("paged",), donate_argnums=(3, 4))
    got, k_out, v_out = call(
        jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(k).astype(dtype),
        jnp.asarray(v).astype(dtype), layer, jnp.asarray(row_slots)[:, None], jnp.asarray(row_start),
        jnp.asarray(offsets), paged=False,
    )  # fmt: skip
    want, k_want, v_want = _reference(q, k_new, v_new, k, v, layer, row_slots, row_start, offsets)
    np.testing.assert_allclose(np.asarray(got), want, atol=3e-5, rtol=1e-4)
    assert not np.asarray(got)[row_start[-1] :].any()  # padding tokens: zeros
    np.testing.assert_array_equal(np.asarray(k_out, np.float32), k_want.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(v_out, np.float32), v_want.astype(np.float32))


def test_write_only_writes_and_returns_zeros():
    rng = np.random.default_rng(1)
    k = jnp.zeros((1, 2, 2, 16, 8))
    q = jnp.asarray(rng.normal(size=(4, 4, 8)), jnp.float32)
    k_new = jnp.asarray(rng.normal(size=(4, 2, 8)), jnp.float32)
    out, k_out, _ = prefill_attention_native(
        q, k_new, k_new, k, jnp.zeros_like(k), 0, jnp.asarray([[1]]), jnp.asarray([0, 3]),
        jnp.asarray([2]), paged=False, attend=False,
    )  # fmt: skip
    assert not np.asarray(out).any()
    np.testing.assert_array_equal(np.asarray(k_out[0, 1, :, 2:5]), np.asarray(k_new[:3]).transpose(1, 0, 2))
    assert not np.asarray(k_out[0, 0]).any() and not np.asarray(k_out[0, 1, :, 5:]).any()


def test_bad_row_start_is_refused():
    k = jnp.zeros((1, 2, 2, 16, 8))
    q = jnp.zeros((4, 4, 8))
    with pytest.raises(Exception, match="row_start must be non-decreasing"):
        prefill_attention_native(
            q, q[:, :2], q[:, :2], k, k + 0, 0, jnp.asarray([[0], [1]]), jnp.asarray([0, 3, 2]),
            jnp.asarray([0, 0]), paged=False,
        )  # fmt: skip


CFG = ModelConfig(
    vocab_size=61, embed_dim=48, mlp_dim=64, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8
)


def _cache(layout, kv_dtype):
    if layout == "slots":
        return init_cache(CFG, num_slots=5, max_len=64, dtype=kv_dtype)
    cache = init_paged_cache(CFG, num_slots=5, max_len=64, num_pages=24, page_size=8, dtype=kv_dtype)
    table = np.full((5, 8), 24, np.int32)  # pages scattered over the pool, in no order
    order = np.random.default_rng(2).permutation(24)
    for s in range(5):
        table[s, : 24 // 5] = order[s * (24 // 5) : (s + 1) * (24 // 5)]
    return cache.__class__(k=cache.k, v=cache.v, page_table=jnp.asarray(table), lengths=cache.lengths)


@pytest.mark.parametrize("layout", ["slots", "paged"])
@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.bfloat16])
def test_decoder_prefill_equals_padded_xla_append(layout, kv_dtype):
    """Two rounds of ragged appends (the second at each slot's own offset, across page edges):
    the same K/V at every live position and the same lengths as `append` with XLA attention;
    the last layer's K/V too, although the prefill skips that layer's attention and MLP."""
    model = init_model(CFG, seed=3)
    rng = np.random.default_rng(4)
    rounds = [
        {0: 12, 1: 3, 3: 7, 4: 1},  # slot 2 untouched
        {4: 20, 0: 5, 2: 9, 1: 1},
    ]
    caches = {}
    for path in ("xla", "prefill"):
        cache = _cache(layout, kv_dtype)
        rng = np.random.default_rng(4)
        for chunk in rounds:
            slots = np.asarray(list(chunk), np.int32)
            lens = np.asarray(list(chunk.values()), np.int32)
            toks = [rng.integers(1, 61, n) for n in lens]
            if path == "xla":
                padded = np.zeros((len(slots), lens.max()), np.int32)
                for i, t in enumerate(toks):
                    padded[i, : len(t)] = t
                fn = jax.jit(lambda t, n, c, s: model.append(t, n, c, slots=s, kernels=Kernels.XLA)[1])
                cache = fn(jnp.asarray(padded), jnp.asarray(lens), cache, jnp.asarray(slots))
            else:
                flat = np.concatenate(toks + [np.zeros(3, np.int64)]).astype(np.int32)  # 3 padding tokens
                rows = np.concatenate([np.repeat(np.arange(len(slots)), lens), [0, 0, 0]]).astype(np.int32)
                start = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
                fn = jax.jit(lambda t, r, st, c, s: model.prefill(t, r, st, c, slots=s))
                cache = fn(
                    jnp.asarray(flat), jnp.asarray(rows), jnp.asarray(start), cache, jnp.asarray(slots)
                )
        caches[path] = cache
    x, p = caches["xla"], caches["prefill"]
    np.testing.assert_array_equal(np.asarray(p.lengths), np.asarray(x.lengths))
    lengths = np.asarray(x.lengths)
    for s, n in enumerate(lengths):
        for name in ("k", "v"):
            want, got = (_live(c, name, s, n) for c in (x, p))
            tol = 1e-5 if kv_dtype == jnp.float32 else 1e-2  # bf16: one rounding step of a value
            np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def _live(cache, name, slot, n):
    """[L, K, n, D] f32: the first n positions of a sequence, from slots or through its pages."""
    a = np.asarray(getattr(cache, name), np.float32)
    if a.shape[1] == cache.lengths.shape[0] and not hasattr(cache, "page_table"):
        return a[:, slot, :, :n]
    p = a.shape[3]
    pages = np.asarray(cache.page_table)[slot]
    return np.concatenate([a[:, :, pages[i]] for i in range(-(-n // p))], axis=2)[:, :, :n]

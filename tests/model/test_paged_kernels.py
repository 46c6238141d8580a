"""The Pallas paged-attention kernels (GPU and TPU, interpreted on CPU) against the XLA reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.paged_cache import init_paged_cache
from treegrpo_jax.model.paged_kernels import paged_attention_pallas, paged_attention_xla
from treegrpo_jax.native import Kernels


def _problem(d, dtype, *, b=4, h=8, k=2, p=16, num_pages=40, m=8, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, h, d)), jnp.float32)
    kp = jnp.asarray(rng.normal(size=(k, num_pages, p, d)), dtype)
    vp = jnp.asarray(rng.normal(size=(k, num_pages, p, d)), dtype)
    table = jnp.asarray(rng.permutation(num_pages)[: b * m].reshape(b, m), jnp.int32)
    lengths = jnp.asarray([5, 17, 100, m * p], jnp.int32)[:b]
    return q, kp, vp, table, lengths


def test_xla_reference_equals_attention_written_out():
    """The reference against softmax(q·k) v computed row by row over each row's pages in order."""
    q, kp, vp, table, lengths = _problem(32, jnp.float32)
    got = np.asarray(paged_attention_xla(q, kp, vp, table, lengths))
    for b in range(4):
        n = int(lengths[b])
        for h in range(8):
            kh = h // 4
            keys = np.concatenate([np.asarray(kp[kh, p]) for p in np.asarray(table[b])])[:n]
            vals = np.concatenate([np.asarray(vp[kh, p]) for p in np.asarray(table[b])])[:n]
            s = keys @ np.asarray(q[b, h]) / np.sqrt(32)
            w = np.exp(s - s.max())
            np.testing.assert_allclose(got[b, h], (w / w.sum()) @ vals, atol=2e-5)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_kernel_interpreted_equals_reference(d, dtype):
    q, kp, vp, table, lengths = _problem(d, dtype)
    got = paged_attention_pallas(q, kp, vp, table, lengths, platform="gpu", interpret=True)
    # The GPU kernel takes q in the storage dtype (one dtype per dot) and, for bf16, also rounds
    # the probabilities and its output to bf16 (2^-8 relative each): a few bf16 ulps of slack.
    want = paged_attention_xla(q.astype(dtype).astype(jnp.float32), kp, vp, table, lengths)
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == jnp.bfloat16 else dict(rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)


@pytest.mark.parametrize("d", [64, 128])
def test_tpu_kernel_interpreted_equals_reference_on_bf16_pages(d):
    """The TPU kernel rounds K/V to bf16 inside; with bf16 storage it matches to f32 rounding."""
    q, kp, vp, table, lengths = _problem(d, jnp.bfloat16, seed=1)
    got = paged_attention_pallas(q, kp, vp, table, lengths, platform="tpu", interpret=True)
    want = paged_attention_xla(q, kp, vp, table, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_padding_rows_give_zeros_and_bad_platform_is_refused():
    q, kp, vp, table, _ = _problem(64, jnp.float32)
    lengths = jnp.asarray([0, 3, 0, 9], jnp.int32)
    got = paged_attention_pallas(q, kp, vp, table, lengths, platform="gpu", interpret=True)
    np.testing.assert_array_equal(np.asarray(got)[[0, 2]], 0.0)
    with pytest.raises(ValueError, match="platform='cuda'"):
        paged_attention_pallas(q, kp, vp, table, lengths, platform="cuda")


def test_decoder_decode_with_the_pallas_kernel_equals_xla():
    cfg = ModelConfig(
        vocab_size=61, embed_dim=64, mlp_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    model = init_model(cfg, seed=2)
    cache = init_paged_cache(cfg, num_slots=3, max_len=64, num_pages=14, page_size=16)
    table = np.full((3, 4), 14, np.int32)
    table[:, :3] = np.random.default_rng(0).permutation(14)[:9].reshape(3, 3)
    cache = dataclasses.replace(cache, page_table=jnp.asarray(table))
    prompts = jax.random.randint(jax.random.key(1), (3, 20), 1, 61)
    _, cache = model.append(prompts, jnp.asarray([20, 7, 13]), cache)
    outs = {}
    for kernels in (Kernels.XLA, Kernels.PALLAS):
        c = cache
        logits = []
        step = jax.jit(lambda t, n, c, s, kernels=kernels: model.append(t, n, c, slots=s, kernels=kernels))
        for i in range(3):  # row 0 crosses into its second page
            out, c = step(jnp.asarray([[3 + i], [4], [5]]), jnp.ones(3, jnp.int32), c, jnp.asarray([0, 1, 2]))
            logits.append(np.asarray(out))
        outs[kernels] = logits
    for a, b in zip(outs[Kernels.XLA], outs[Kernels.PALLAS], strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)

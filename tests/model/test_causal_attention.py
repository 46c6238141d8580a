"""`CausalMask`: the fused-attention path (cuDNN on GPU; its XLA implementation here) against the
decoder's dense causal mask, and the CPU path unchanged to the bit."""

import importlib

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


def test_the_train_step_on_path_rows_through_the_fused_path_equals_the_tree_mask(monkeypatch):
    """What a GPU runs for path rows (`token_logprobs` with `CausalMask` → the fused call) against
    the CPU path (the dense tree mask): the same loss and gradient step."""
    from flax import nnx

    from treegrpo_jax.model import decoder
    from treegrpo_jax.rl import BatchLayout, LossConfig, OptimConfig, create_train_state
    from treegrpo_jax.rl.layouts import batch_from_trees
    from treegrpo_jax.rl.train_step import jit_train_step
    from treegrpo_jax.testing.forest import random_forest

    # The module (the package attribute `rl.train_step` is the function of that name).
    train_step_module = importlib.import_module("treegrpo_jax.rl.train_step")
    model = init_model(CFG, seed=3)
    trees = random_forest(np.random.default_rng(5), num_prompts=2, trees=2, branches=2, rounds=1, vocab=61)
    optim = OptimConfig(learning_rate=1e-3, warmup_ratio=0.0, total_steps=10)
    batch = batch_from_trees(trees, BatchLayout(length_buckets=(32, 64), row_multiple=2, kind="paths"))
    out, calls = {}, []
    for fused in (False, True):
        if fused:
            monkeypatch.setattr(train_step_module, "causal_implementation", lambda dtype: "xla")
            monkeypatch.setattr(decoder, "causal_implementation", lambda dtype: "xla")
            real = train_step_module.token_logprobs

            def counted(*args, real=real, **kwargs):
                calls.append(1)
                return real(*args, **kwargs)

            monkeypatch.setattr(train_step_module, "token_logprobs", counted)
        step = jit_train_step(None, loss_cfg=LossConfig(entropy_coef=0.01), optim_cfg=optim)
        params = jax.tree.map(jnp.copy, nnx.state(model))
        state = create_train_state(nnx.merge(nnx.graphdef(model), params), optim)[0]
        out[fused] = step(state, batch, jax.tree.map(jnp.copy, nnx.state(model)))
    assert calls  # the fused branch was taken (traced) for path rows
    (s0, m0), (s1, m1) = out[False], out[True]
    for key in ("loss", "pg_loss", "entropy", "kl", "logp_gap"):
        np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6)

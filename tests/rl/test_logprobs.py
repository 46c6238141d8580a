"""Chunked log-probs equal the full-logits ones; the tree loss gradient is the sum over its paths."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.rl.tiny import compile_fast
from treegrpo_jax.model.decoder import causal_mask
from treegrpo_jax.rl import advantages
from treegrpo_jax.rl.batch import BatchLayout, build_batch, rows_from_trees
from treegrpo_jax.rl.logprobs import token_logprobs
from treegrpo_jax.rl.loss import LossConfig, policy_loss
from treegrpo_jax.rl.token_weights import row_weights
from treegrpo_jax.testing.forest import random_forest


def _rows(seed=0, b=3, t=13):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 64, (b, t)), jnp.int32)
    lens = np.array([t, t - 4, 5])[:b]
    valid = jnp.asarray(np.arange(t)[None] < lens[:, None])
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    return tokens, positions, valid


def test_chunked_equals_unchunked_and_full_logits(tiny_model):
    graphdef, params = nnx.split(tiny_model)
    tokens, positions, valid = _rows()
    m = valid.astype(jnp.float32)

    def run(params, chunk):
        def objective(params):
            lp, ent = token_logprobs(nnx.merge(graphdef, params), tokens, positions, valid, chunk=chunk)
            return jnp.sum(lp * m) + 0.1 * jnp.sum(ent * m), (lp, ent)

        (_, (lp, ent)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        logits = nnx.merge(graphdef, params)(tokens, positions, causal_mask(valid))
        return lp, ent, grads, logits

    jitted = jax.jit(run, static_argnums=1)
    full_lp, full_ent, g_full, logits = compile_fast(jitted, params, 64)(params)
    # 12 targets in 3 chunks of 5 (3 padded): forward and remat'ed backward.
    chunk_lp, chunk_ent, g_chunk, _ = compile_fast(jitted, params, 5)(params)
    np.testing.assert_allclose(chunk_lp, full_lp, atol=1e-6)
    np.testing.assert_allclose(chunk_ent, full_ent, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_chunk), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
    # Against log_softmax of the decoder's own [B, T, V] logits.
    ls = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    want = jnp.take_along_axis(ls, tokens[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(full_lp[:, 1:], want, atol=1e-5)
    np.testing.assert_allclose(full_ent[:, 1:], -(jnp.exp(ls) * ls).sum(-1), atol=1e-5)
    assert np.all(np.asarray(full_lp[:, 0]) == 0)


def test_tree_loss_gradient_is_sum_of_per_path_gradients(tiny_model):
    """A node shared by c leaves is trained once per leaf: the batch gradient is the per-path sum."""
    rng = np.random.default_rng(3)
    rows = rows_from_trees(random_forest(rng, num_prompts=1, trees=2, branches=2, rounds=1))
    batch = build_batch(rows, BatchLayout(length_buckets=(32,), row_multiple=1)).reshape_rows(-1)
    adv = advantages.compute(batch.reward, batch.tree_id, batch.prompt_id, batch.row_valid, "tree")
    mask = batch.loss_mask * batch.row_valid[:, None]
    n_tok = float(mask.sum())  # the fixed (mini-batch) normaliser
    cfg = LossConfig(kl_coef=0.0, entropy_coef=0.0)
    graphdef, params = nnx.split(tiny_model)

    def grad(params, tokens, positions, valid, mask, adv):
        def loss(params):
            lp, ent = token_logprobs(nnx.merge(graphdef, params), tokens, positions, valid, chunk=8)
            old = jax.lax.stop_gradient(lp)
            w = row_weights(adv, mask, cfg.aggregation)
            return policy_loss(lp, old, None, ent, w, cfg=cfg, num_tokens=n_tok, num_rows=1.0)[0]

        return jax.grad(loss)(params)

    def whole_and_per_path(params, *fields):
        # Per path: each row alone as a batch of one (vmap over rows), gradients summed after.
        one_row = jax.vmap(lambda *row: grad(params, *(x[None] for x in row)))
        return grad(params, *fields), jax.tree.map(lambda g: g.sum(0), one_row(*fields))

    fields = (batch.tokens, batch.positions, batch.valid, mask, adv)
    whole, summed = compile_fast(jax.jit(whole_and_per_path), params, *fields)(params, *fields)
    assert len(rows) >= 3 and np.any(np.abs(adv) > 0.1)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(summed), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_written_out_head_backward_equals_autodiff(tied):
    """`_head_logp`'s hand-written VJP against autodiff of the plain log-softmax head."""
    from treegrpo_jax.rl.logprobs import _head_logp

    k = jax.random.split(jax.random.key(3), 5)
    n, e, v = 12, 8, 40
    h = jax.random.normal(k[0], (n, e))
    w = jax.random.normal(k[1], (v, e) if tied else (e, v)) * 0.3
    tg = jax.random.randint(k[2], (n,), 0, v)
    g_lp, g_ent = jax.random.normal(k[3], (n,)), jax.random.normal(k[4], (n,))

    def reference(h, w):
        logits = h @ (w.T if tied else w)
        lp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(lp, tg[:, None], axis=-1)[:, 0], -jnp.sum(jnp.exp(lp) * lp, -1)

    def ours(h, w):
        return _head_logp(h, w, tg, tied, jnp.float32)

    def scalar(f):
        return lambda h, w: jnp.sum(f(h, w)[0] * g_lp) + jnp.sum(f(h, w)[1] * g_ent)

    np.testing.assert_allclose(ours(h, w)[0], reference(h, w)[0], rtol=1e-5, atol=1e-6)
    for got, want in zip(
        jax.grad(scalar(ours), (0, 1))(h, w), jax.grad(scalar(reference), (0, 1))(h, w), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("remat", ["layer", "dots"])
def test_remat_keeps_the_gradient_and_cuts_the_saved_activations(tiny_model, remat):
    """`ModelConfig.remat` recomputes layers in the backward pass: same log-probs and gradients
    as keeping everything, with less memory held between the passes (read from XLA's own plan)."""

    graphdef, params = nnx.split(tiny_model)
    rng = np.random.default_rng(5)
    b, t = 4, 64  # long enough that a layer's [B, H, T, T] scores outweigh its inputs
    tokens = jnp.asarray(rng.integers(0, 64, (b, t)), jnp.int32)
    valid = jnp.asarray(np.arange(t)[None] < np.array([t, 50, 33, 9])[:, None])
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))

    def run(graphdef, params):
        def objective(params):
            lp, ent = token_logprobs(nnx.merge(graphdef, params), tokens, positions, valid, chunk=t)
            return jnp.sum(lp * valid) + 0.1 * jnp.sum(ent * valid), lp

        return jax.value_and_grad(objective, has_aux=True)(params)

    model = nnx.merge(graphdef, params)
    model.cfg = dataclasses.replace(model.cfg, remat=remat)
    remat_graphdef, _ = nnx.split(model)
    compiled = {}
    outputs = {}
    for name, gd in (("none", graphdef), (remat, remat_graphdef)):
        compiled[name] = jax.jit(functools.partial(run, gd)).lower(params).compile()
        outputs[name] = compiled[name](params)
    (_, lp_none), g_none = outputs["none"]
    (_, lp_remat), g_remat = outputs[remat]
    np.testing.assert_allclose(lp_remat, lp_none, atol=1e-6)
    for a, c in zip(jax.tree.leaves(g_none), jax.tree.leaves(g_remat), strict=True):
        np.testing.assert_allclose(c, a, atol=1e-5)
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    assert temp[remat] < 0.8 * temp["none"], temp

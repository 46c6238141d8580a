"""Packed trees = paths, exactly: layout contents, mask vs a plain loop, log-probs, loss and every
gradient leaf for each estimator and aggregation (clip branches hit), and the whole jitted step."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.rl.tiny import compile_fast
from treegrpo_jax.model.decoder import causal_mask
from treegrpo_jax.rl import (
    BatchLayout,
    LossConfig,
    OptimConfig,
    batch_from_trees,
    build_batch,
    build_packed_batch,
    create_train_state,
    jit_train_step,
    policy_loss,
    rows_from_trees,
    split_minibatches,
    tree_mask,
    tree_token_logprobs,
)
from treegrpo_jax.rl.packed import key_blocks
from treegrpo_jax.rl.step_inputs import prepare
from treegrpo_jax.testing.forest import random_forest


def _forest(seed=11):
    """(2,2,1) prompts and (4,5,1) prompts together (prompt ids kept apart)."""
    rng = np.random.default_rng(seed)
    small = random_forest(rng, num_prompts=3, trees=2, branches=2, rounds=1)
    large = random_forest(rng, num_prompts=1, trees=4, branches=5, rounds=1)
    for tree in large:
        tree.prompt_id += 5000
    return small + large


def _cap(trees):
    """A largest bucket that holds every path but not every tree: some trees become several units."""
    longest = max(len(r.tokens) for r in rows_from_trees(trees))
    return max(longest, int(np.median([t.unique_tokens() for t in trees])))


def _packed_paths(batch):
    """Each leaf's path as packed coordinates (mini, micro, row, col), by position (plain loops).

    Uses the pair table (leaf → nodes) and the parent table for the root (the prompt).
    """
    where: dict[int, list[tuple[int, ...]]] = {}
    for at in zip(*np.nonzero(batch.segment), strict=True):
        where.setdefault(int(batch.node[at]), []).append(tuple(int(x) for x in at))
    nodes: dict[int, set[int]] = {}
    for leaf, node in zip(batch.pair_leaf, batch.pair_node, strict=True):
        if node > 0:  # (0, 0): padding
            nodes.setdefault(int(leaf), set()).add(int(node))

    def chain(n):  # n and its ancestors, up to the unit's root
        out = []
        while n >= 0:
            out.append(n)
            n = int(batch.node_parent[n])
        return out

    paths = {}
    for leaf, ns in nodes.items():
        chain_ = max((chain(n) for n in ns), key=len)  # from the leaf's own node
        assert set(chain_[:-1]) == ns, "pairs = the nodes on the path, root excluded"
        coords = [c for n in chain_ for c in where.get(n, [])]
        paths[leaf] = sorted(coords, key=lambda c: batch.positions[c])
    return paths


LAYOUTS = {
    "whole trees, 2 mini × 2 micro": dict(
        num_minibatches=2, num_microbatches=2, length_buckets=(16, 32, 64, 128)
    ),
    "split trees, 1 mini": dict(num_minibatches=1, num_microbatches=1),
    "split groups, 3 mini": dict(num_minibatches=3, num_microbatches=2, split_groups=True),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_packed_layout_holds_every_path_once_per_unit(name):
    trees = _forest()
    kw = dict(LAYOUTS[name])
    kw.setdefault("length_buckets", (_cap(trees),))
    layout = BatchLayout(row_multiple=1, **kw)
    batch = build_packed_batch(trees, layout)
    rows = rows_from_trees(trees)
    paths = _packed_paths(batch)
    assert sorted(paths) == list(range(len(rows)))
    minis = split_minibatches([r.prompt_id for r in rows], layout)
    for k, members in enumerate(minis):
        assert all(batch.leaf_mini[g] == k for g in members)
    for g, row in enumerate(rows):
        coords = paths[g]
        idx = tuple(np.array(coords).T)
        np.testing.assert_array_equal(batch.tokens[idx], row.tokens)
        np.testing.assert_array_equal(batch.loss_mask[idx], row.loss_mask)
        np.testing.assert_allclose(batch.sampler_logp[idx], row.sampler_logp)
        np.testing.assert_array_equal(batch.positions[idx], np.arange(len(row.tokens)))
        assert len({c[:3] for c in coords}) == 1 and len({int(batch.segment[c]) for c in coords}) == 1
        assert batch.leaf_mini[g] == [k for k, m in enumerate(minis) if g in m][0]
        # prev follows the path: each token is predicted from the previous token of its own path.
        assert batch.prev[coords[0]] == -1
        assert [int(batch.prev[c]) for c in coords[1:]] == [c[3] for c in coords[:-1]]
        assert (batch.reward[g], batch.prompt_id[g], batch.tree_id[g]) == (
            row.reward,
            row.prompt_id,
            row.tree_id,
        )
        assert batch.leaf_tokens[g] == row.loss_mask.sum()
    assert not batch.leaf_valid[len(rows) :].any()
    packed, unique = int((batch.segment > 0).sum()), sum(t.unique_tokens() for t in trees)
    if name.startswith("whole"):
        assert packed == unique  # every tree is one unit: each token stored once
        assert int((batch.segment.max(-1) > 1).sum()) > 0  # several trees share a row
    else:
        assert unique < packed < sum(len(r.tokens) for r in rows)  # split units repeat a little


@pytest.mark.parametrize("name", ["whole trees, 2 mini × 2 micro", "split trees, 1 mini"])
def test_tree_mask_matches_a_plain_loop_reference(name):
    trees = _forest(seed=3)
    kw = dict(LAYOUTS[name])
    kw.setdefault("length_buckets", (_cap(trees),))
    batch = build_packed_batch(trees, BatchLayout(row_multiple=1, **kw))
    want = np.zeros(batch.tokens.shape + batch.tokens.shape[-1:], bool)
    for coords in _packed_paths(batch).values():  # a token sees its path up to itself, nothing else
        for k, (a, b, r, i) in enumerate(coords):
            for *_, j in coords[: k + 1]:
                want[a, b, r, i, j] = True
    pad = batch.segment == 0
    want[..., 0] |= pad  # padding queries see token 0 (no empty softmax), as in causal_mask
    t = batch.seq_len
    got = tree_mask(batch.segment.reshape(-1, t), batch.span_end.reshape(-1, t))
    np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)
    # A path row is a one-node chain: the same function gives the causal mask on its real tokens.
    paths = build_batch(rows_from_trees(trees), BatchLayout(length_buckets=(64,), row_multiple=1))
    flat = paths.reshape_rows(-1)
    n = flat.valid.sum(-1, keepdims=True)
    chain = tree_mask(flat.valid.astype(np.int32), np.broadcast_to(n, flat.valid.shape))
    real = flat.valid  # padding queries differ (their outputs are never read)
    np.testing.assert_array_equal(np.asarray(chain)[real], np.asarray(causal_mask(jnp.asarray(real)))[real])


def test_key_blocks_list_exactly_the_blocks_a_query_block_sees():
    trees = _forest(seed=4)
    batch = build_packed_batch(trees, BatchLayout(length_buckets=(_cap(trees),), row_multiple=1))
    t = batch.seq_len
    seg, end = batch.segment.reshape(-1, t), batch.span_end.reshape(-1, t)
    dense = np.asarray(tree_mask(seg, end)) & (seg > 0)[:, :, None]  # real queries only
    for block in (4, 8, t):
        if t % block:
            continue
        got = key_blocks(seg, end, block)
        nq = t // block
        need = dense.reshape(-1, nq, block, nq, block).any(axis=(2, 4))  # [R, NQ, NK]
        for r, q in itertools.product(range(len(seg)), range(nq)):
            listed = got[r, q][got[r, q] >= 0]
            assert listed.tolist() == np.nonzero(need[r, q])[0].tolist()
    assert batch.key_blocks.shape[:-2] == batch.tokens.shape[:-1]


def test_block_sparse_attention_equals_the_dense_tree_mask(tiny_model):
    """Log-probs, entropies and their gradients: block-sparse = dense, on rows of several trees."""
    trees = _forest(seed=6)
    batch = build_packed_batch(trees, BatchLayout(length_buckets=(_cap(trees),), row_multiple=1))
    t = batch.seq_len
    rows = [
        x.reshape(-1, t) for x in (batch.tokens, batch.positions, batch.segment, batch.span_end, batch.prev)
    ]
    graphdef, params = nnx.split(tiny_model)
    nq = batch.key_blocks.shape[-2]
    assert nq > 4 and batch.key_blocks.shape[-1] < nq  # several blocks, some skipped
    blocks = batch.key_blocks.reshape(-1, *batch.key_blocks.shape[-2:])
    weight = jnp.asarray(np.random.default_rng(0).normal(size=rows[0].shape), jnp.float32)

    def run(params, key_blocks):
        def f(p):
            lp, ent = tree_token_logprobs(nnx.merge(graphdef, p), *rows, key_blocks=key_blocks, chunk=8)
            return jnp.sum(weight * (lp + 0.5 * ent)), (lp, ent)

        return jax.value_and_grad(f, has_aux=True)(params)

    (_, (lp_d, ent_d)), g_d = compile_fast(jax.jit(run), params, None)(params, None)
    (_, (lp_s, ent_s)), g_s = compile_fast(jax.jit(run), params, blocks)(params, blocks)
    real = batch.prev.reshape(-1, t) >= 0
    np.testing.assert_allclose(np.asarray(lp_s)[real], np.asarray(lp_d)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent_s)[real], np.asarray(ent_d)[real], rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_d), jax.tree.leaves(g_s), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * np.abs(a).max())


# ----------------------------------------------------------------- loss and gradients
def _shift(tokens, positions, scale):
    """A per-token log-ratio that depends only on the token and its depth, so it is the same for
    every path copy of a token: ρ = exp(±scale·sin(·)) spans every clip branch."""
    return scale * jnp.sin(0.37 * tokens + 1.3 * positions + 0.5)


CONFIGS = [
    LossConfig(estimator=est, aggregation=agg, kl_coef=kl, entropy_coef=ent)
    for est, agg, (kl, ent) in itertools.product(
        ["tree", "intra", "inter", "grpo"], ["token-mean", "seq-mean-token-mean"], [(0.0, 0.0), (0.05, 0.01)]
    )
] + [
    LossConfig(dual_clip=None, kl_coef=0.05),
    LossConfig(mode="sft", kl_coef=0.0, entropy_coef=0.0),
    LossConfig(mode="sft", kl_coef=0.0, entropy_coef=0.0, aggregation="seq-mean-token-mean"),
    # Shared-prefix credit (token_weights.Credit): the packed sums scale by the whole tree's leaf
    # counts, also on the trees split into several units.
    LossConfig(credit="mean", kl_coef=0.05, entropy_coef=0.01),
    LossConfig(credit="sqrt", aggregation="seq-mean-token-mean", kl_coef=0.05, entropy_coef=0.01),
    LossConfig(credit="mean", estimator="grpo", aggregation="seq-mean-token-mean"),
    LossConfig(credit="sqrt", estimator="intra"),
]


def _all_losses(graphdef, params, batch):
    """Loss, metrics and parameter gradients of every config, for one mini- and micro-batch.

    One forward with its VJP; each config's loss is differentiated w.r.t. (logp, entropy) and
    the cotangents go back through the model one after the other (`lax.map`): the chain rule
    of `value_and_grad(loss ∘ forward)` for all configs, with a single compiled backward pass.
    (Not `vmap`: on XLA:CPU here, a vmapped VJP of the decoder returns wrong gradients for
    every batch element but the first once the batch is large enough; `lax.map` matches a
    plain `jax.grad` per config.)
    """

    def forward(p, rows):
        model = nnx.merge(graphdef, p)
        layout = (rows.positions, rows.segment, rows.span_end, rows.prev)
        return tree_token_logprobs(model, rows.tokens, *layout, key_blocks=rows.key_blocks, chunk=8)

    rows0 = jax.tree.map(lambda x: x[0, 0], prepare(batch, CONFIGS[0]).rows)
    (logp, ent), vjp = jax.vjp(lambda p: forward(p, rows0), params)
    old = jax.lax.stop_gradient(logp) - _shift(rows0.tokens, rows0.positions, 1.6)
    ref = jax.lax.stop_gradient(logp) + _shift(rows0.tokens, rows0.positions + 5, 0.7)
    out, cts = [], []
    for cfg in CONFIGS:
        inputs = prepare(batch, cfg)
        w = jax.tree.map(lambda x: x[0, 0], inputs.rows.weights)

        def loss(lp, en, w=w, inputs=inputs, cfg=cfg):
            return policy_loss(
                lp, old, ref, en, w, cfg=cfg, num_tokens=inputs.num_tokens[0], num_rows=inputs.num_rows[0]
            )

        (value, aux), ct = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(logp, ent)
        out.append((value, {**aux.sums, **aux.mins, **aux.maxs}))
        cts.append(ct)
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *cts)
    grads = jax.lax.map(lambda ct: vjp(ct)[0], stacked)
    return out, grads, (logp, ent)


@pytest.fixture(scope="module")
def both_layouts(tiny_model):
    """Both layouts of one forest (one mini-batch, several trees per packed row, some trees split)."""
    trees = _forest(seed=5)
    graphdef, params = nnx.split(tiny_model)
    # A sharper policy than the init (logits ×6): log-probs and entropies differ visibly per token.
    params = jax.tree.map(lambda x: x * 6.0 if x.ndim == 2 else x, params)
    layout = BatchLayout(length_buckets=(_cap(trees),), row_multiple=1)
    results = {}
    for kind in ("paths", "packed"):
        batch = batch_from_trees(trees, dataclasses.replace(layout, kind=kind))
        fn = jax.jit(lambda p, b: _all_losses(graphdef, p, b))
        results[kind] = (batch, jax.device_get(compile_fast(fn, params, batch)(params, batch)))
    return trees, results


def test_log_probs_of_every_token_equal_between_layouts(both_layouts):
    trees, results = both_layouts
    (paths, (_, _, (lp_a, ent_a))), (packed, (_, _, (lp_b, ent_b))) = results["paths"], results["packed"]
    rows = rows_from_trees(trees)
    coords = _packed_paths(packed)
    assert paths.tokens.shape[:2] == (1, 1) and packed.tokens.shape[:2] == (1, 1)
    (members,) = split_minibatches([r.prompt_id for r in rows], BatchLayout())  # row j of paths: leaf
    for j, g in enumerate(members):
        idx = tuple(np.array(coords[g])[:, 2:].T)  # (row, col) in the packed micro-batch
        n = len(rows[g].tokens)
        np.testing.assert_array_equal(packed.tokens[0, 0][idx], paths.tokens[0, 0, j, :n])
        np.testing.assert_allclose(lp_b[idx], lp_a[j, :n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ent_b[idx], ent_a[j, :n], rtol=1e-5, atol=1e-5)
    assert np.ptp(lp_a[0, 1 : len(rows[members[0]].tokens)]) > 0.5  # a policy that tells tokens apart


def _id(c: LossConfig) -> str:
    return (
        f"{c.mode}-{c.estimator}-{c.aggregation}-kl{c.kl_coef}-ent{c.entropy_coef}-dual{c.dual_clip}"
        f"-{c.credit}"
    )


@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=[_id(c) for c in CONFIGS])
def test_loss_and_every_gradient_leaf_equal_between_layouts(both_layouts, i):
    _, results = both_layouts
    (_, (out_a, grads_a, _)), (_, (out_b, grads_b, _)) = results["paths"], results["packed"]
    (loss_a, sums_a), (loss_b, sums_b) = out_a[i], out_b[i]
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-5, atol=1e-7)
    assert set(sums_a) == set(sums_b)
    for key in sums_a:
        np.testing.assert_allclose(sums_b[key], sums_a[key], rtol=1e-5, atol=1e-7, err_msg=key)
    leaves_a, leaves_b = jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)
    for a, b in zip(leaves_a, leaves_b, strict=True):
        a, b = a[i], b[i]
        assert np.abs(a).max() > 0
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * np.abs(a).max())
    cfg = CONFIGS[i]
    if cfg.mode == "rl":  # every branch of the clipped surrogate is exercised
        assert sums_a["clip_frac_high"] > 0.02 and sums_a["clip_frac_low"] > 0.02
        assert sums_a["ratio_min"] < 0.3 and sums_a["ratio_max"] > 4.0
        if cfg.dual_clip is not None:
            assert sums_a["clip_frac_dual"] > 0.02
        if cfg.kl_coef > 0:
            assert sums_a["kl"] > 1e-3


# ------------------------------------------------------------------- the jitted step
@pytest.mark.parametrize("credit", ["sum", "mean"])
def test_train_step_packed_equals_paths(tiny_model, credit):
    """Two mini-batches (the second one's logp_old from the pre-update params), micro-batch
    accumulation, KL and entropy on: the packed step updates the parameters like the paths step."""
    trees = _forest(seed=7)
    optim = OptimConfig(learning_rate=1e-3, warmup_ratio=0.0, total_steps=10, eps=1e-3)
    loss_cfg = LossConfig(aggregation="seq-mean-token-mean", kl_coef=0.05, entropy_coef=0.01, credit=credit)
    layout = BatchLayout(num_minibatches=2, num_microbatches=2, length_buckets=(32, 64, 128), row_multiple=2)
    ref = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.2, p))(nnx.state(tiny_model))
    step = jit_train_step(None, loss_cfg=loss_cfg, optim_cfg=optim, logprob_chunk=8)
    out = {}
    for kind in ("paths", "packed"):
        params = jax.tree.map(jnp.copy, nnx.state(tiny_model))  # the step donates its state
        state = create_train_state(nnx.merge(nnx.graphdef(tiny_model), params), optim)[0]
        batch = batch_from_trees(trees, dataclasses.replace(layout, kind=kind))
        out[kind] = compile_fast(step, state, batch, ref)(state, batch, ref)
    (s_a, m_a), (s_b, m_b) = out["paths"], out["packed"]
    for a, b in zip(jax.tree.leaves(s_a.params), jax.tree.leaves(s_b.params), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6)
    assert set(m_a) == set(m_b)
    for key in m_a:
        np.testing.assert_allclose(m_b[key], m_a[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert int(m_a["num_rows"]) == len(rows_from_trees(trees)) and int(m_a["skipped_updates"]) == 0
    assert m_a["ratio_max"] > 1.0 + 1e-5 or m_a["ratio_min"] < 1.0 - 1e-5  # mini-batch 1 moved


@pytest.mark.parametrize("kind", ["paths", "packed"])
def test_attention_in_query_chunks_trains_like_all_queries_at_once(tiny_model, kind):
    """`attention_chunk` (queries 64 at a time, each chunk recomputed in the backward): the dense
    path (path rows on CPU) and the block-sparse path (packed trees) update the parameters, and
    log the metrics, of the unchunked step."""
    trees = _forest(seed=7)
    optim = OptimConfig(learning_rate=1e-3, warmup_ratio=0.0, total_steps=10, eps=1e-3)
    loss_cfg = LossConfig(kl_coef=0.0, entropy_coef=0.01)
    layout = BatchLayout(num_minibatches=2, length_buckets=(128,), row_multiple=2, kind=kind)
    step = jit_train_step(None, loss_cfg=loss_cfg, optim_cfg=optim, logprob_chunk=8)
    batch = batch_from_trees(trees, layout)
    assert batch.tokens.shape[-1] == 128  # two chunks of 64 queries (packed: of one 64-token block)
    out = {}
    for chunk in (0, 64):
        graphdef, params = nnx.split(tiny_model)
        model = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))  # the step donates its state
        model.cfg = model.cfg.replace(attention_chunk=chunk)
        state = create_train_state(model, optim)[0]
        out[chunk] = compile_fast(step, state, batch, None)(state, batch, None)
    (s_a, m_a), (s_b, m_b) = out[0], out[64]
    for a, b in zip(jax.tree.leaves(s_a.params), jax.tree.leaves(s_b.params), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6)
    moved = max(
        float(np.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(s_a.params), jax.tree.leaves(nnx.state(tiny_model)), strict=True)
    )
    assert moved > 1e-4  # the step did update the parameters
    for key in m_a:
        np.testing.assert_allclose(m_b[key], m_a[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_layout_errors():
    with pytest.raises(ValueError, match="BatchLayout.kind"):
        BatchLayout(kind="tree")
    trees = _forest()
    with pytest.raises(ValueError, match="largest length bucket"):
        build_packed_batch(trees, BatchLayout(length_buckets=(8,)))
    trees[0].leaves()[0].reward = None
    with pytest.raises(ValueError, match="has no reward"):
        build_packed_batch(trees, BatchLayout(length_buckets=(128,)))


@pytest.mark.parametrize("row_multiple", [1, 2, 8])
def test_packing_takes_the_row_length_with_the_fewest_slots(row_multiple):
    """The chosen T needs no more slots than any single length bucket forced alone (the reference:
    a layout whose only bucket is that T), and as few as the best of them."""
    trees = _forest(seed=5)
    buckets = (32, 48, 64, 96, 128, 256)
    layout = BatchLayout(
        num_minibatches=2, num_microbatches=1, length_buckets=buckets, row_multiple=row_multiple
    )
    longest = max(len(r.tokens) for r in rows_from_trees(trees))
    slots = {}
    for t in (b for b in buckets if b >= longest):
        forced = build_packed_batch(trees, dataclasses.replace(layout, length_buckets=(t,)))
        slots[t] = forced.tokens.size
    got = build_packed_batch(trees, layout)
    assert got.tokens.size == min(slots.values())
    assert got.seq_len == max(t for t, n in slots.items() if n == min(slots.values()))  # ties: longer rows

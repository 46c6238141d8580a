"""Batch shapes: a batch padded up to a compiled shape trains exactly like the batch itself."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.rl.tiny import compile_fast
from treegrpo_jax.rl import (
    BatchLayout,
    LossConfig,
    OptimConfig,
    batch_from_trees,
    create_train_state,
    jit_train_step,
)
from treegrpo_jax.rl.packed import key_blocks
from treegrpo_jax.rl.shapes import BatchShape, ShapeSet, abstract_batch, pad_to, shape_of
from treegrpo_jax.testing.forest import random_forest

LAYOUT = BatchLayout(num_minibatches=2, num_microbatches=2, length_buckets=(32, 64, 128), row_multiple=2)


def _trees(seed=7):
    return random_forest(np.random.default_rng(seed), num_prompts=4, trees=2, branches=2, rounds=1)


@pytest.mark.parametrize("kind", ["paths", "packed"])
def test_padded_batch_trains_like_the_batch(tiny_model, kind):
    """Rows, length, tables and key-block slots all grown: same parameters after the step, same
    metrics (two mini-batches, micro-batch accumulation, KL and entropy on)."""
    batch = batch_from_trees(_trees(), dataclasses.replace(LAYOUT, kind=kind))
    have = shape_of(batch)
    bigger = BatchShape(b=have.b * 2, t=128)
    if kind == "packed":
        bigger = dataclasses.replace(
            bigger,
            leaves=have.leaves * 2,
            pairs=have.pairs * 2,
            nodes=have.nodes * 2,
            key_slots=have.key_slots + 1,
        )
    padded = pad_to(batch, bigger)
    assert shape_of(padded) == bigger and shape_of(padded) != have
    optim = OptimConfig(learning_rate=1e-3, warmup_ratio=0.0, total_steps=10, eps=1e-3)
    loss_cfg = LossConfig(aggregation="seq-mean-token-mean", kl_coef=0.05, entropy_coef=0.01)
    ref = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.2, p))(nnx.state(tiny_model))
    step = jit_train_step(None, loss_cfg=loss_cfg, optim_cfg=optim, logprob_chunk=8)
    out = []
    for b in (batch, padded):
        params = jax.tree.map(jnp.copy, nnx.state(tiny_model))  # the step donates its state
        state = create_train_state(nnx.merge(nnx.graphdef(tiny_model), params), optim)[0]
        out.append(compile_fast(step, state, b, ref)(state, b, ref))
    (s_a, m_a), (s_b, m_b) = out
    for a, b in zip(jax.tree.leaves(s_a.params), jax.tree.leaves(s_b.params), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6)
    assert set(m_a) == set(m_b)
    for key in m_a:
        np.testing.assert_allclose(m_b[key], m_a[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert int(m_b["skipped_updates"]) == 0


def test_shape_set_reuses_a_larger_shape_within_the_waste_factor():
    a = batch_from_trees(_trees(1), dataclasses.replace(LAYOUT, kind="packed"))
    have = shape_of(a)
    big = dataclasses.replace(have, b=have.b * 2, t=have.t * 2, leaves=have.leaves * 2)  # 4x the slots
    large = pad_to(a, big)
    generous = ShapeSet(max_waste=4.0)
    assert generous.fit(large) is large and generous.shapes == [big]
    assert shape_of(generous.fit(a)) == big and generous.shapes == [big]  # padded, nothing new
    strict = ShapeSet(max_waste=2.0)
    strict.fit(large)
    assert strict.fit(a) is a and strict.shapes == [big, have]  # 4x > 2x: its own shape
    assert shape_of(strict.fit(a)) == have  # the cheapest shape that holds it comes first
    more_leaves = dataclasses.replace(have, leaves=have.leaves * 4)  # no shape holds it: a new one
    assert shape_of(strict.fit(pad_to(a, more_leaves))) == more_leaves and len(strict.shapes) == 3
    mid = dataclasses.replace(have, leaves=have.leaves * 2)  # tables are free: padded to more_leaves
    assert shape_of(strict.fit(pad_to(a, mid))) == more_leaves and len(strict.shapes) == 3


def test_shape_set_never_shrinks_and_keeps_new_shapes():
    shapes = ShapeSet(max_waste=2.0)
    layout = dataclasses.replace(LAYOUT, kind="paths")
    a = batch_from_trees(_trees(3), layout)
    b = pad_to(a, BatchShape(b=shape_of(a).b * 4, t=shape_of(a).t))  # 4x the slots: over the factor
    assert shapes.fit(a) is a
    assert shapes.fit(b) is b
    assert shapes.shapes == [shape_of(a), shape_of(b)]
    c = pad_to(a, BatchShape(b=shape_of(a).b * 2, t=shape_of(a).t))  # 2x: fits in b? no, b is 2x c
    assert shape_of(shapes.fit(c)) == shape_of(b)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_to(b, shape_of(a))
    with pytest.raises(ValueError, match="max_waste"):
        ShapeSet(max_waste=0.5)
    again = ShapeSet(max_waste=2.0)  # a resumed run: the checkpoint's shape list
    again.set_state(shapes.get_state())
    assert again.shapes == shapes.shapes and shape_of(again.fit(c)) == shape_of(b)


def test_key_block_slots_too_few_is_an_error():
    segment = np.ones((1, 128), np.int32)
    span_end = np.full((1, 128), 128, np.int32)  # one unit: block 1 sees blocks 0 and 1
    assert key_blocks(segment, span_end, 64).shape == (1, 2, 2)
    assert key_blocks(segment, span_end, 64, slots=2).tolist() == [[[0, -1], [0, 1]]]
    with pytest.raises(ValueError, match="slots"):
        key_blocks(segment, span_end, 64, slots=1)


def test_layout_shape_waste_is_checked():
    with pytest.raises(ValueError, match="shape_waste"):
        BatchLayout(shape_waste=0.5)


@pytest.mark.parametrize("kind", ["paths", "packed"])
def test_abstract_batch_has_the_shapes_and_dtypes_of_a_padded_real_batch(kind):
    trees = random_forest(np.random.default_rng(0), num_prompts=2, trees=2, branches=2, rounds=1)
    batch = batch_from_trees(trees, BatchLayout(kind=kind, length_buckets=(64, 128, 256), row_multiple=2))
    have = shape_of(batch)
    big = dataclasses.replace(
        have,
        b=2 * have.b,
        t=2 * have.t,
        leaves=have.leaves + 3,
        pairs=have.pairs + 5,
        nodes=have.nodes + 7,
        key_slots=have.key_slots and 2 * have.key_slots,
    )
    real = pad_to(batch, big)
    abstract = abstract_batch(type(batch), batch.tokens.shape[:2], big)
    for f in dataclasses.fields(real):
        want = np.asarray(getattr(real, f.name))
        got = getattr(abstract, f.name)
        assert (got.shape, got.dtype) == (want.shape, want.dtype), f.name

"""Shared-prefix credit (`token_weights.Credit`): the leaf counts both layouts carry, against a
brute-force count over root-to-leaf paths, and what each rule makes of a shared token's weight.
(Loss and gradients per rule: `test_loss.py` against the direct formula, `test_packed.py`
packed against paths on every gradient leaf.)"""

import jax
import numpy as np
import pytest

from treegrpo_jax.rl import BatchLayout, LossConfig, batch_from_trees, rows_from_trees
from treegrpo_jax.rl.step_inputs import prepare
from treegrpo_jax.testing.forest import random_forest


def _forest():
    return random_forest(np.random.default_rng(3), num_prompts=3, trees=2, branches=3, rounds=2)


def _brute_count(tree, node_id: int) -> int:
    """Leaves whose root-to-leaf path passes through `node_id` (the root: every leaf)."""
    return sum(
        node_id == 0 or node_id in [n.node_id for n in tree.path(leaf.node_id)] for leaf in tree.leaves()
    )


def test_path_rows_carry_the_leaves_through_each_token():
    trees = _forest()
    rows = iter(rows_from_trees(trees))
    for tree in trees:
        for leaf in tree.leaves():
            want = [_brute_count(tree, 0)] * len(tree.prompt_tokens)
            for node in tree.path(leaf.node_id):
                want += [_brute_count(tree, node.node_id)] * (len(node.tokens) + len(node.obs_tokens))
            np.testing.assert_array_equal(next(rows).shared, want)
    assert max(_brute_count(t, 1) for t in trees) > 1  # some prefix is shared


@pytest.mark.parametrize("credit", ["mean", "sqrt"])
def test_packed_trees_split_into_units_weigh_like_their_paths(credit):
    """A tree split over several units: its nodes still scale by the whole tree's leaf count, so
    per leaf-advantage term the packed weights sum to the paths' (a unit's count would not)."""
    trees = _forest()
    cap = max(len(r.tokens) for r in rows_from_trees(trees))  # small: trees split into units
    sums = {}
    for kind in ("paths", "packed"):
        batch = batch_from_trees(trees, BatchLayout(length_buckets=(cap,), row_multiple=1, kind=kind))
        w = jax.device_get(prepare(batch, LossConfig(credit=credit)).rows.weights)
        sums[kind] = [float(np.sum(x)) for x in (w.pos, w.neg, w.weight, w.count)]
        if kind == "packed":
            units = int(sum(len(set(row[row > 0])) for row in np.asarray(batch.segment).reshape(-1, cap)))
            assert units > len(trees)  # some tree is split
    np.testing.assert_allclose(sums["packed"], sums["paths"], rtol=1e-5)


@pytest.mark.parametrize("kind", ["paths", "packed"])
@pytest.mark.parametrize(("credit", "power"), [("sum", 1.0), ("mean", 0.0), ("sqrt", 0.5)])
def test_a_shared_token_weighs_n_to_the_power_of_its_rule(kind, credit, power):
    """Token-mean: each path copy has weight c(n); summed over the n copies of a token, n·c(n)."""
    trees = _forest()
    cap = max(len(r.tokens) for r in rows_from_trees(trees)) * 4
    layout = BatchLayout(length_buckets=(cap,), row_multiple=1, kind=kind)
    batch = batch_from_trees(trees, layout)
    inputs = jax.device_get(prepare(batch, LossConfig(credit=credit)))
    w, count = np.asarray(inputs.rows.weights.weight), np.asarray(inputs.rows.weights.count)
    model = np.asarray(batch.loss_mask) > 0
    if kind == "paths":  # every copy is a row: c(n) each
        shared = np.asarray(batch.shared)[model]
        np.testing.assert_allclose(w[model], shared ** (power - 1.0), rtol=1e-6)
        assert shared.max() > 1
    else:  # one token for n copies: n·c(n) = n^power, and `count` stays n
        np.testing.assert_allclose(w[model], count[model] ** power, rtol=1e-6)
        assert count[model].max() > 1

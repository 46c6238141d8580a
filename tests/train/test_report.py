"""Training-tree pictures: per-prompt advantages equal the step's, over all prompts."""

import numpy as np

from treegrpo_jax.rl import advantages
from treegrpo_jax.testing.forest import random_forest
from treegrpo_jax.train.report import leaf_advantages, render_training_trees


def test_a_prompts_leaf_advantages_equal_those_of_the_whole_step():
    trees = random_forest(np.random.default_rng(3), num_prompts=4, trees=2, branches=2, rounds=1)
    leaves = [(t, leaf) for t in trees for leaf in t.leaves()]
    args = (
        np.asarray([leaf.reward for _, leaf in leaves], np.float32),
        np.asarray([t.tree_id for t, _ in leaves], np.int32),
        np.asarray([t.prompt_id for t, _ in leaves], np.int32),
        np.ones(len(leaves), bool),
    )
    for estimator in ("tree", "intra", "inter", "grpo"):
        whole = advantages.compute(*args, estimator)
        want = {(t.prompt_id, t.tree_id, leaf.node_id): a for (t, leaf), a in zip(leaves, whole, strict=True)}
        for prompt in sorted({t.prompt_id for t in trees}):
            mine = [t for t in trees if t.prompt_id == prompt]
            for t, per_node in zip(mine, leaf_advantages(mine, estimator), strict=True):
                assert set(per_node) == {leaf.node_id for leaf in t.leaves()}
                for node_id, a in per_node.items():
                    np.testing.assert_allclose(a, want[(prompt, t.tree_id, node_id)], atol=1e-6)


def test_training_trees_render_with_advantages(tmp_path):
    trees = random_forest(np.random.default_rng(4), num_prompts=2, trees=2, branches=2, rounds=1)
    path = tmp_path / "train_trees.png"
    render_training_trees(trees, "tree", str(path), step=7)
    assert path.stat().st_size > 10_000  # a real picture of two trees

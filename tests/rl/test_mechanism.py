"""Mechanism metrics: hand-computed cases, and a plain-loop reference on random forests."""

import numpy as np
import pytest

from treegrpo_jax.rl import advantages
from treegrpo_jax.rl.mechanism import DEPTHS, ZERO, mechanism_metrics
from treegrpo_jax.rollout.tree import Node, StepKind, Tree
from treegrpo_jax.testing.forest import random_forest


def _tree(prompt_id, tree_id, spec):
    """spec: (parent, n_tokens, reward or None) per node after the root, in node-id order."""
    nodes = [Node(node_id=0, parent=-1, depth=0, kind=StepKind.ROOT)]
    leaves = {p for p, _, _ in spec}
    for i, (parent, n, reward) in enumerate(spec, start=1):
        leaf = i not in leaves
        nodes.append(
            Node(
                node_id=i,
                parent=parent,
                depth=nodes[parent].depth + 1,
                kind=StepKind.ANSWER if leaf else StepKind.SEARCH,
                tokens=[5] * n,
                logprobs=[-1.0] * n,
                is_leaf=leaf,
                reward=reward,
            )
        )
        nodes[parent].children.append(i)
    return Tree(prompt_id=prompt_id, tree_id=tree_id, prompt_tokens=[1, 2], nodes=nodes)


def _chains(prompt_id, rewards, n_tokens=4):
    return [_tree(prompt_id, k, [(0, n_tokens, r)]) for k, r in enumerate(rewards)]


def test_chain_grpo_all_wrong_prompt_is_silent():
    # Prompt 0: four chains all rewarded 0.2 → an all-equal prompt group: A = 0 everywhere.
    # Prompt 1: chains [1, 0, 0, 0]: mean 0.25, std 0.5 → A = ±(0.75 | 0.25)/0.5 ≠ 0.
    # Leaves: 4 of 8 non-zero; tokens (4 each): 16 of 32; prompt groups: 1 of 2 all equal;
    # tree groups: every tree is one leaf → no group of ≥ 2 → 0. Depth 1 only:
    # mean |A| = (0·4 + 1.5 + 3 · 0.5) / 8 = 3 / 8 (up to the 1e-6 in the std).
    trees = _chains(0, [0.2] * 4) + _chains(1, [1.0, 0.0, 0.0, 0.0])
    m = mechanism_metrics(trees, "grpo")
    assert m["mechanism/leaves_nonzero"] == 0.5
    assert m["mechanism/tokens_nonzero"] == 0.5
    assert m["mechanism/equal_prompt_groups"] == 0.5
    assert m["mechanism/equal_tree_groups"] == 0.0
    assert m["mechanism/abs_adv_depth1"] == pytest.approx(3 / 8, rel=1e-5)
    assert all(m[f"mechanism/abs_adv_depth{d}"] == 0.0 for d in range(2, DEPTHS + 1))


def test_tree_estimator_shared_prefix_sums_its_leaves():
    # One prompt, one tree: node 1 (3 tokens) is shared by leaves 2 (reward 1) and 3 (reward 0);
    # node 4 (2 tokens) is a leaf straight off the root, reward 0.
    #   intra = inter (one tree = the prompt): rewards [1, 0, 0], mean 1/3, std √(1/3):
    #   A = [1.1546985, −0.5773493, −0.5773493] each term, so tree = 2 × that.
    #   node 1: A_2 + A_3 = 2 · 0.5773493 = 1.1546985 (sum credit) → non-zero;
    #   with `mean` credit it is half that.
    # Leaves 3 of 3 non-zero; tokens: node 1 (3) + 2 (1) + 3 (1) + 4 (2), all non-zero → 1.
    # Depth 1: nodes 1 and 4: (1.1546985 + 1.1546985) / 2; depth 2: nodes 2, 3: (2.309397 + 1.1546985) / 2.
    tree = _tree(0, 0, [(0, 3, None), (1, 1, 1.0), (1, 1, 0.0), (0, 2, 0.0)])
    m = mechanism_metrics([tree], "tree")
    assert m["mechanism/leaves_nonzero"] == 1.0
    assert m["mechanism/tokens_nonzero"] == 1.0
    assert m["mechanism/equal_tree_groups"] == 0.0
    assert m["mechanism/equal_prompt_groups"] == 0.0
    assert m["mechanism/abs_adv_depth1"] == pytest.approx(1.1546985, rel=1e-5)
    assert m["mechanism/abs_adv_depth2"] == pytest.approx((2.309397 + 1.1546985) / 2, rel=1e-5)
    mean = mechanism_metrics([tree], "tree", credit="mean")
    assert mean["mechanism/abs_adv_depth1"] == pytest.approx((1.1546985 / 2 + 1.1546985) / 2, rel=1e-5)


def test_cancelling_siblings_leave_their_parent_silent():
    # Intra-only, tree 0: node 1 shared by leaves with rewards 1 and 0, plus a leaf 4 off the root
    # with reward 0.5 → intra A = [+1, −1, 0] (mean 0.5, std 0.5): node 1 gets +1 − 1 = 0.
    # Tree 1 (leaves 1, 1): all equal → 0. Tokens: node 1 (4), leaf 4 (2) and tree 1 (3 + 3) silent:
    # 2 of 4+1+1+2+3+3 = 14 non-zero. Tree groups: 1 of 2 all equal; the prompt group (1, 0, .5, 1, 1) is not.
    t0 = _tree(0, 0, [(0, 4, None), (1, 1, 1.0), (1, 1, 0.0), (0, 2, 0.5)])
    t1 = _tree(0, 1, [(0, 3, 1.0), (0, 3, 1.0)])
    m = mechanism_metrics([t0, t1], "intra")
    assert m["mechanism/leaves_nonzero"] == pytest.approx(2 / 5)
    assert m["mechanism/tokens_nonzero"] == pytest.approx(2 / 14)
    assert m["mechanism/equal_tree_groups"] == 0.5
    assert m["mechanism/equal_prompt_groups"] == 0.0


@pytest.mark.parametrize("estimator", ["tree", "intra", "inter", "grpo"])
def test_matches_a_plain_loop_on_random_forests(estimator):
    rng = np.random.default_rng(3)
    trees = random_forest(rng, num_prompts=4, trees=2, branches=2, rounds=1, max_steps=4)
    m = mechanism_metrics(trees, estimator)
    leaves = [(t, leaf) for t in trees for leaf in t.leaves()]
    r = np.array([leaf.reward for _, leaf in leaves], np.float32)
    a = advantages.compute(
        r,
        np.array([t.tree_id for t, _ in leaves]),
        np.array([t.prompt_id for t, _ in leaves]),
        np.ones(len(r), bool),
        estimator,
    )
    adv_of = {(id(t), leaf.node_id): a[i] for i, (t, leaf) in enumerate(leaves)}
    tokens = nonzero = 0
    by_depth = {}
    for t in trees:
        for node in t.nodes[1:]:
            total = sum(
                adv_of[(id(t), leaf.node_id)]
                for leaf in t.leaves()
                if node.node_id in {n.node_id for n in t.path(leaf.node_id)}
            )
            tokens += len(node.tokens)
            nonzero += len(node.tokens) * (abs(total) > ZERO)
            by_depth.setdefault(min(node.depth, DEPTHS), []).append(abs(total))
    assert m["mechanism/leaves_nonzero"] == pytest.approx(np.mean(np.abs(a) > ZERO))
    assert m["mechanism/tokens_nonzero"] == pytest.approx(nonzero / tokens)
    for d, values in by_depth.items():
        assert m[f"mechanism/abs_adv_depth{d}"] == pytest.approx(np.mean(values), rel=1e-5)


def test_no_leaf_is_an_error():
    tree = Tree(
        prompt_id=0,
        tree_id=0,
        prompt_tokens=[1],
        nodes=[Node(node_id=0, parent=-1, depth=0, kind=StepKind.ROOT)],
    )
    with pytest.raises(ValueError, match="at least one leaf"):
        mechanism_metrics([tree], "tree")

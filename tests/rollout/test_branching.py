"""Branching rules (`rollout/branching.py`): each rule's weights against a plain computation on a
hand-built tree, the pick frequencies they give, and the registry's errors. (Both drivers grow
the same trees under every rule: `test_scheduler.py`.)"""

import math

import jax
import numpy as np
import pytest

from treegrpo_jax.rollout import branching
from treegrpo_jax.rollout.search_state import TreeSearchConfig, TreeState, pick_branches
from treegrpo_jax.rollout.tree import Node, StepKind, Tree


def _tree() -> Tree:
    """root → 1 (search) → 2 (search) → 3 (answer); 1 → 4 (answer); root → 5 (answer).

    Entropies after each node: root's children 1 and 5 start with [2.0, 1.0, …] and [0.5];
    node 1's children 2 and 4 with [3.0, 3.0] and [1.0]; node 2's child 3 with [0.1, 0.2].
    """

    def node(i, parent, depth, kind, entropies, leaf=False):
        return Node(
            node_id=i,
            parent=parent,
            depth=depth,
            kind=kind,
            tokens=[7] * len(entropies),
            logprobs=[-1.0] * len(entropies),
            entropies=entropies,
            is_leaf=leaf,
        )

    nodes = [
        node(0, -1, 0, StepKind.ROOT, []),
        node(1, 0, 1, StepKind.SEARCH, [2.0, 1.0, 9.0]),
        node(2, 1, 2, StepKind.SEARCH, [3.0, 3.0]),
        node(3, 2, 3, StepKind.ANSWER, [0.1, 0.2], leaf=True),
        node(4, 1, 2, StepKind.ANSWER, [1.0], leaf=True),
        node(5, 0, 1, StepKind.ANSWER, [0.5], leaf=True),
    ]
    for n in nodes[1:]:
        nodes[n.parent].children.append(n.node_id)
    return Tree(prompt_id=0, tree_id=0, prompt_tokens=[1, 2], nodes=nodes)


def test_entropy_weights_are_a_softmax_of_the_mean_next_token_entropy():
    tree = _tree()
    cfg = TreeSearchConfig(rule="entropy", rule_tokens=2, rule_temperature=0.5)
    candidates = tree.expandable()
    assert [n.node_id for n in candidates] == [0, 1, 2]
    # First two tokens of every child: root (2, 1, 0.5), node 1 (3, 3, 1), node 2 (0.1, 0.2).
    means = [(2.0 + 1.0 + 0.5) / 3, (3.0 + 3.0 + 1.0) / 3, (0.1 + 0.2) / 2]
    assert [branching.next_token_entropy(tree, n, 2) for n in candidates] == pytest.approx(means)
    e = [math.exp(m / 0.5) for m in means]
    want = [x / sum(e) for x in e]
    np.testing.assert_allclose(branching.pick_weights(tree, candidates, cfg), want, rtol=1e-12)
    hot = TreeSearchConfig(rule="entropy", rule_tokens=2, rule_temperature=1e6)  # τ → ∞: uniform
    np.testing.assert_allclose(branching.pick_weights(tree, candidates, hot), [1 / 3] * 3, rtol=1e-5)


def test_last_weighs_only_the_parents_of_leaves_and_uniform_is_none():
    tree = _tree()
    candidates = tree.expandable()
    w = branching.pick_weights(tree, candidates, TreeSearchConfig(rule="last"))
    np.testing.assert_allclose(w, [1 / 3, 1 / 3, 1 / 3])  # 0 → 5, 1 → 4, 2 → 3 all answer
    tree.nodes[0].children.remove(5)  # now the root's only child searches: the root drops out
    w = branching.pick_weights(tree, candidates, TreeSearchConfig(rule="last"))
    np.testing.assert_allclose(w, [0.0, 0.5, 0.5])
    assert branching.pick_weights(tree, candidates, TreeSearchConfig()) is None


@pytest.mark.parametrize("rule", ["uniform", "entropy", "last"])
def test_picks_follow_the_weights_and_repeat_per_key(rule):
    """Over many prompt uids the seeded picks land with the rule's frequencies; the same
    (key, uid, tree, round) picks the same nodes again."""
    search = TreeSearchConfig(num_trees=1, num_picks=4, num_rounds=1, rule=rule, rule_tokens=2)
    words = [int(w) for w in np.asarray(jax.random.key_data(jax.random.key(0))).ravel()]
    counts = np.zeros(3)
    for uid in range(3000):
        state = TreeState(tree=_tree(), uid=uid, golds=("x",), holder={})
        picks = pick_branches(search, words, state, 0)
        assert [n.node_id for n, _ in picks] == [n.node_id for n, _ in pick_branches(search, words, state, 0)]
        assert [b for _, b in picks] == [1, 2, 3, 4]  # branch numbers of round 0
        for n, _ in picks:
            counts[n.node_id] += 1
    tree = _tree()
    want = branching.pick_weights(tree, tree.expandable(), search)
    want = np.full(3, 1 / 3) if want is None else want
    np.testing.assert_allclose(counts / counts.sum(), want, atol=0.015)


def test_a_registered_rule_is_used_and_bad_weights_or_names_are_clear_errors():
    name = "test_only_deepest"

    def deepest(tree, candidates, cfg):
        depth = max(n.depth for n in candidates)
        return [float(n.depth == depth) for n in candidates]

    if name not in branching.rule_names():
        branching.register_rule(name, deepest)
    tree = _tree()
    np.testing.assert_allclose(
        branching.pick_weights(tree, tree.expandable(), TreeSearchConfig(rule=name)), [0, 0, 1]
    )
    with pytest.raises(ValueError, match="is taken"):
        branching.register_rule(name, deepest)
    if "test_only_negative" not in branching.rule_names():
        branching.register_rule("test_only_negative", lambda t, c, cfg: [-1.0] * len(c))
    with pytest.raises(ValueError, match="non-negative weight"):
        branching.pick_weights(tree, tree.expandable(), TreeSearchConfig(rule="test_only_negative"))
    with pytest.raises(ValueError, match="known rules"):
        TreeSearchConfig(rule="best_first")
    with pytest.raises(ValueError, match="rule_temperature"):
        TreeSearchConfig(rule="entropy", rule_temperature=0.0)
    with pytest.raises(ValueError, match="rule_tokens"):
        TreeSearchConfig(rule="entropy", rule_tokens=0)

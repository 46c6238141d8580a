"""Random forests of rollout trees for the RL tests (initialize-then-expand, docs/DESIGN.md §1)."""

from __future__ import annotations

import numpy as np

from treegrpo_jax.rl.batch import PathRow
from treegrpo_jax.rollout.tree import Node, StepKind, Tree

# The training reward takes these values (docs/DESIGN.md §1), so ties are frequent and exact.
REWARD_VALUES = (0.0, 0.1, 0.2, 0.8, 1.0)


def _add(nodes: list[Node], rng, parent: int, *, leaf: bool, vocab: int, reward_pool) -> int:
    k = int(rng.integers(1, 4))
    node = Node(
        node_id=len(nodes),
        parent=parent,
        depth=nodes[parent].depth + 1,
        kind=StepKind.ANSWER if leaf else StepKind.SEARCH,
        tokens=rng.integers(1, vocab, k).tolist(),
        logprobs=(-rng.random(k) * 3).tolist(),
        obs_tokens=[] if leaf else rng.integers(1, vocab, int(rng.integers(1, 3))).tolist(),
        is_leaf=leaf,
        reward=float(rng.choice(reward_pool)) if leaf else None,
    )
    nodes.append(node)
    nodes[parent].children.append(node.node_id)
    return node.node_id


def _continue(nodes, rng, start: int, *, max_steps: int, vocab: int, reward_pool) -> None:
    """A trajectory from `start`: 0..max_steps-1 search steps, then an answer leaf."""
    at = start
    for _ in range(int(rng.integers(0, max_steps))):
        at = _add(nodes, rng, at, leaf=False, vocab=vocab, reward_pool=reward_pool)
    _add(nodes, rng, at, leaf=True, vocab=vocab, reward_pool=reward_pool)


def random_tree(
    rng,
    *,
    prompt_id: int,
    tree_id: int,
    branches: int,
    rounds: int,
    vocab: int = 64,
    max_steps: int = 3,
    reward_pool=None,
) -> Tree:
    """One tree: a chain, then `rounds` (L) rounds of `branches` (N) branches from random non-leaf nodes."""
    pool = REWARD_VALUES if reward_pool is None else reward_pool
    nodes = [Node(node_id=0, parent=-1, depth=0, kind=StepKind.ROOT)]
    _continue(nodes, rng, 0, max_steps=max_steps, vocab=vocab, reward_pool=pool)
    for _ in range(rounds):
        expandable = [nd.node_id for nd in nodes if not nd.is_leaf]
        for pick in rng.choice(expandable, size=branches, replace=True):
            _continue(nodes, rng, int(pick), max_steps=max_steps, vocab=vocab, reward_pool=pool)
    prompt = rng.integers(1, vocab, int(rng.integers(2, 5))).tolist()
    return Tree(prompt_id=prompt_id, tree_id=tree_id, prompt_tokens=prompt, nodes=nodes)


def random_forest(rng, *, num_prompts: int, trees: int, branches: int, rounds: int, **kw) -> list[Tree]:
    """`num_prompts` prompts (sparse ids) × `trees` (M) trees (tree ids restart at 0 per prompt)."""
    return [
        random_tree(rng, prompt_id=1000 + 37 * p, tree_id=t, branches=branches, rounds=rounds, **kw)
        for p in range(num_prompts)
        for t in range(trees)
    ]


def random_path_rows(n: int, seq: int, vocab: int, *, prompt_len: int, seed: int = 0) -> list[PathRow]:
    """`n` path rows of exactly `seq` random tokens: a `prompt_len`-token prompt (loss mask 0), then
    model tokens; one prompt, two trees, rewards 0 / 1 alternating (benchmarks' train-step input)."""
    rng = np.random.default_rng(seed)
    mask = np.arange(seq) >= prompt_len
    return [
        PathRow(
            tokens=rng.integers(0, vocab, seq).astype(np.int32),
            loss_mask=mask,
            sampler_logp=np.where(mask, -rng.random(seq), 0.0).astype(np.float32),
            reward=float(i % 2),
            prompt_id=0,
            tree_id=i % 2,
        )
        for i in range(n)
    ]

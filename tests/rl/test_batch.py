"""Trees → padded path rows: contents, buckets, mini/micro split, padding."""

import numpy as np
import pytest

from treegrpo_jax.rl.batch import (
    BatchLayout,
    PathRow,
    bucket_length,
    bucket_rows,
    build_batch,
    rows_from_trees,
)
from treegrpo_jax.rl.sft import demonstration_row
from treegrpo_jax.rollout.tree import Node, StepKind, Tree
from treegrpo_jax.testing.forest import random_forest


def _small_tree():
    # root(prompt 1 2) → a [3 4 | obs 5] → {b [6] leaf r=1, c [7 8] leaf r=0}
    nodes = [
        Node(node_id=0, parent=-1, depth=0, kind=StepKind.ROOT, children=[1]),
        Node(node_id=1, parent=0, depth=1, kind=StepKind.SEARCH, tokens=[3, 4], logprobs=[-0.1, -0.2],
             obs_tokens=[5], children=[2, 3]),
        Node(node_id=2, parent=1, depth=2, kind=StepKind.ANSWER, tokens=[6], logprobs=[-0.3], is_leaf=True,
             reward=1.0),
        Node(node_id=3, parent=1, depth=2, kind=StepKind.ANSWER, tokens=[7, 8], logprobs=[-0.4, -0.5],
             is_leaf=True, reward=0.0),
    ]  # fmt: skip
    return Tree(prompt_id=4, tree_id=1, prompt_tokens=[1, 2], nodes=nodes)


def test_rows_from_a_hand_built_tree():
    rows = rows_from_trees([_small_tree()])
    assert [r.tokens.tolist() for r in rows] == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7, 8]]
    assert [r.loss_mask.astype(int).tolist() for r in rows] == [[0, 0, 1, 1, 0, 1], [0, 0, 1, 1, 0, 1, 1]]
    np.testing.assert_allclose(rows[1].sampler_logp, [0, 0, -0.1, -0.2, 0, -0.4, -0.5])
    assert [(r.reward, r.prompt_id, r.tree_id) for r in rows] == [(1.0, 4, 1), (0.0, 4, 1)]

    batch = build_batch(rows, BatchLayout(length_buckets=(4, 8, 16), row_multiple=4))
    assert batch.tokens.shape == (1, 1, 4, 8) and batch.reward.shape == (1, 1, 4)
    flat = batch.reshape_rows(-1)
    assert flat.row_valid.tolist() == [True, True, False, False]
    assert flat.valid.sum(-1).tolist() == [6, 7, 0, 0]
    assert flat.loss_mask[2:].sum() == 0 and flat.prompt_id[2:].tolist() == [-1, -1]
    assert flat.positions[0].tolist() == list(range(8))


def test_groups_stay_in_one_minibatch_and_micro_batches_are_balanced():
    rng = np.random.default_rng(0)
    trees = random_forest(rng, num_prompts=5, trees=2, branches=2, rounds=1)
    rows = rows_from_trees(trees)
    layout = BatchLayout(num_minibatches=2, num_microbatches=2, length_buckets=(16, 32, 64), row_multiple=2)
    batch = build_batch(rows, layout)
    n_mini, n_micro, b, t = batch.tokens.shape
    assert (n_mini, n_micro) == (2, 2) and t == bucket_length(max(len(r.tokens) for r in rows), (16, 32, 64))
    prompts = [set(batch.prompt_id[k][batch.row_valid[k]].tolist()) for k in range(2)]
    assert not prompts[0] & prompts[1] and len(prompts[0] | prompts[1]) == 5
    assert batch.row_valid.sum() == len(rows)
    per_micro = batch.row_valid.sum(-1)
    assert np.all(np.abs(per_micro[:, 0] - per_micro[:, 1]) <= 1)
    # Every row's tokens survive the layout.
    got = sorted(tuple(batch.tokens[k, j, i][batch.valid[k, j, i]].tolist())
                 for k, j, i in zip(*np.nonzero(batch.row_valid), strict=True))  # fmt: skip
    assert got == sorted(tuple(r.tokens.tolist()) for r in rows)

    split = build_batch(rows, BatchLayout(num_minibatches=3, split_groups=True, length_buckets=(64,)))
    assert split.row_valid.sum() == len(rows)
    with pytest.raises(ValueError, match="split_groups"):
        build_batch(rows, BatchLayout(num_minibatches=6, length_buckets=(64,)))


def test_buckets_and_errors():
    assert [bucket_rows(n, 8) for n in (1, 8, 9, 17, 33)] == [8, 8, 16, 32, 64]
    assert bucket_rows(5, 3) == 6
    with pytest.raises(ValueError, match="largest length bucket"):
        bucket_length(300, (128, 256))
    with pytest.raises(ValueError, match="length_buckets"):
        BatchLayout(length_buckets=(256, 128))
    with pytest.raises(ValueError, match="num_microbatches"):
        BatchLayout(num_microbatches=0)
    with pytest.raises(ValueError, match="loss_mask\\[0\\]"):
        PathRow(
            tokens=np.arange(3),
            loss_mask=np.ones(3, bool),
            sampler_logp=np.zeros(3),
            reward=0,
            prompt_id=0,
            tree_id=0,
        )


def test_demonstration_row():
    row = demonstration_row([([1, 2], False), ([3, 4], True), ([5], False), ([6], True)], prompt_id=3)
    assert row.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert row.loss_mask.astype(int).tolist() == [0, 0, 1, 1, 0, 1] and row.reward == 1.0

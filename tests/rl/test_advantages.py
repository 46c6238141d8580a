"""Tree advantages: hand-computed golden values and a plain-loop NumPy reference."""

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.rl import advantages
from treegrpo_jax.rl.advantages import Estimator
from treegrpo_jax.rl.batch import rows_from_trees
from treegrpo_jax.testing.forest import random_forest


def _loop_zscore(rewards, keys, mask):
    """verl's GRPO outcome advantage, written as a loop over rows (float64)."""
    groups = defaultdict(list)
    for i, key in enumerate(keys):
        if mask[i]:
            groups[key].append(i)
    out = np.zeros(len(rewards))
    for idx in groups.values():
        r = np.asarray([float(rewards[i]) for i in idx])
        mean, std = (0.0, 1.0) if len(idx) == 1 else (r.mean(), r.std(ddof=1))
        out[idx] = (r - mean) / (std + 1e-6)
    return out


def loop_reference(rewards, tree_ids, prompt_ids, mask, estimator):
    tree = _loop_zscore(rewards, list(zip(prompt_ids, tree_ids, strict=True)), mask)
    prompt = _loop_zscore(rewards, list(prompt_ids), mask)
    return {"tree": tree + prompt, "intra": tree, "inter": prompt, "grpo": prompt}[estimator]


def test_golden_small_forest():
    # Prompt 7: tree 0 has leaves with rewards [1, 0, 0], tree 1 has [1, 1]; prompt 9 has one
    # tree with one leaf (0.8). Row order is shuffled and one padding row (reward 5) is added.
    #   intra, tree (7,0): mean 1/3, unbiased std sqrt(1/3) = 0.57735027
    #       1 → (2/3)/(0.57735027+1e-6) = 1.1546985,   0 → (−1/3)/(0.57735127) = −0.5773493
    #   intra, tree (7,1): equal rewards → 0, 0
    #   inter, prompt 7: rewards [1,0,0,1,1], mean 0.6, unbiased std sqrt(0.3) = 0.54772256
    #       1 → 0.4/0.54772356 = 0.7302954,   0 → −0.6/0.54772356 = −1.0954431
    #   prompt 9, singleton (both groups): mean 0, std 1 → 0.8/(1+1e-6) = 0.7999992
    #   tree = intra + inter: 1.8849939 | −1.6727924 | 0.7302954 | 1.5999984
    rewards = np.array([0, 1, 1, 0.8, 5.0, 0, 1], np.float32)
    tree_ids = np.array([0, 1, 0, 0, 0, 0, 1], np.int32)
    prompt_ids = np.array([7, 7, 7, 9, 7, 7, 7], np.int32)
    mask = np.array([1, 1, 1, 1, 0, 1, 1], bool)
    golden = {
        "intra": [-0.5773493, 0.0, 1.1546985, 0.7999992, 0.0, -0.5773493, 0.0],
        "inter": [-1.0954431, 0.7302954, 0.7302954, 0.7999992, 0.0, -1.0954431, 0.7302954],
        "grpo": [-1.0954431, 0.7302954, 0.7302954, 0.7999992, 0.0, -1.0954431, 0.7302954],
        "tree": [-1.6727924, 0.7302954, 1.8849939, 1.5999984, 0.0, -1.6727924, 0.7302954],
    }
    for est, want in golden.items():
        got = advantages.compute(rewards, tree_ids, prompt_ids, mask, est)
        assert isinstance(got, np.ndarray)
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=est)


@pytest.mark.parametrize("seed", range(4))
def test_random_forests_match_loop_reference(seed):
    rng = np.random.default_rng(seed)
    # Varied (M, N, L): chains only (N=0: every tree is a singleton), branching, several rounds.
    m, n, rounds = [(1, 2, 1), (2, 2, 1), (3, 0, 0), (2, 3, 2)][seed]
    trees = random_forest(rng, num_prompts=int(rng.integers(1, 6)), trees=m, branches=n, rounds=rounds)
    rows = rows_from_trees(trees)
    k = int(rng.integers(0, 6))  # padding rows with garbage that collides with real groups
    rewards = np.array([r.reward for r in rows] + list(rng.normal(size=k) * 100), np.float32)
    tree_ids = np.array([r.tree_id for r in rows] + [0] * k, np.int32)
    prompt_ids = np.array([r.prompt_id for r in rows] + [trees[0].prompt_id] * k, np.int32)
    mask = np.array([True] * len(rows) + [False] * k)
    perm = rng.permutation(len(rewards))
    args = rewards[perm], tree_ids[perm], prompt_ids[perm], mask[perm]
    for est in Estimator:
        got = advantages.compute(*args, est)
        want = loop_reference(*args, est.value)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{est} {(m, n, rounds)}")
        assert np.all(got[~args[3]] == 0)


def test_ties_give_exact_zero_in_float32():
    # A plain f32 mean of three 0.1s is off by an ulp, which /1e-6 would turn into ~0.01.
    r = np.full(3, 0.1, np.float32)
    got = advantages.compute(r, np.zeros(3, np.int32), np.zeros(3, np.int32), np.ones(3, bool), "grpo")
    assert np.all(got == 0.0)


def test_padding_never_touches_statistics_and_nan_reward_poisons_only_its_groups():
    rewards = np.array([1.0, 0.0, np.nan, 0.2, 0.8], np.float32)
    tree_ids = np.array([0, 0, 0, 0, 1], np.int32)
    prompt_ids = np.array([1, 1, 1, 2, 2], np.int32)
    base = advantages.compute(rewards, tree_ids, prompt_ids, np.array([1, 1, 0, 1, 1], bool), "tree")
    assert np.all(np.isfinite(base)) and base[2] == 0.0
    two = advantages.compute(rewards[:2], tree_ids[:2], prompt_ids[:2], np.ones(2, bool), "tree")
    np.testing.assert_allclose(base[:2], two, atol=1e-6)
    poisoned = advantages.compute(rewards, tree_ids, prompt_ids, np.ones(5, bool), "tree")
    assert np.all(np.isnan(poisoned[:3])) and np.all(np.isfinite(poisoned[3:]))


def test_jax_inputs_inside_jit_and_unknown_estimator():
    r = jnp.array([1.0, 0.0, 1.0])
    ids = jnp.array([0, 0, 1])
    out = jax.jit(lambda r: advantages.compute(r, ids, ids * 0, r == r, "intra"))(r)
    assert isinstance(out, jax.Array)
    np.testing.assert_allclose(out, [0.7071058, -0.7071058, 0.9999990], atol=1e-6)
    with pytest.raises(ValueError, match="allowed"):
        advantages.compute(np.ones(2), np.zeros(2, int), np.zeros(2, int), np.ones(2, bool), "trees")

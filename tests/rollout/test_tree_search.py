"""Tree search on the synthetic world: shapes, limits, determinism and exact log-probs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.env.actions import STOP_SEQUENCES
from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.rollout import stops
from treegrpo_jax.rollout.agent import AgentConfig
from treegrpo_jax.rollout.engine import Engine, OutOfSlotsError
from treegrpo_jax.rollout.tree import StepKind
from treegrpo_jax.rollout.tree_search import TreeSearchConfig, rollout

from .reference import full_logits

AGENT = AgentConfig(max_tool_calls=2, max_turns=3, max_step_tokens=12, temperature=1.0, top_p=1.0)


@pytest.fixture(scope="module")
def env(world_env):
    return world_env


@pytest.fixture(scope="module")
def model(env):
    dims = dict(embed_dim=32, mlp_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    cfg = ModelConfig(vocab_size=env.tokenizer.vocab_size, **dims)
    return init_model(cfg, seed=0)


def _engine(model, env, slots):
    table = stops.make_stop_table(stops.token_bytes(env.tokenizer), STOP_SEQUENCES, model.cfg.vocab_size)
    return Engine(
        model, num_slots=slots, max_len=1024, eos_ids=env.tokenizer.eos_ids, stop_table=table, min_rows=4
    )


@pytest.mark.parametrize("shape", [(2, 2, 1), (1, 2, 2), (3, 0, 0)])
def test_leaf_counts_and_limits(model, env, world, shape):
    m, n, rounds = shape
    search = TreeSearchConfig(num_trees=m, num_picks=n, num_rounds=rounds)
    rows = world.train[:3]
    eng = _engine(model, env, slots=search.leaves_per_prompt * 2)  # two waves for three prompts
    trees, stats = rollout(eng, env, rows, search, AGENT, key=jax.random.key(0))
    assert len(trees) == 3 * m
    for p in range(3):
        assert sum(len(t.leaves()) for t in trees if t.prompt_id == p) == m * (1 + n * rounds)
    for tree in trees:
        for leaf in tree.leaves():
            path = tree.path(leaf.node_id)
            assert (
                sum(node.kind == StepKind.SEARCH for node in path) == leaf.tool_calls <= AGENT.max_tool_calls
            )
            assert len(path) <= AGENT.max_turns + 1
            assert leaf.reward is not None and 0.0 <= leaf.reward <= 1.0
        for node in tree.nodes[1:]:
            assert (
                node.is_leaf == (not node.children) or node.children
            )  # inner nodes have children or were not picked
    assert eng.num_free == eng.num_slots  # every slot returned
    assert stats.leaves == 3 * search.leaves_per_prompt


def test_prefix_sharing_prefills_each_token_once(model, env, world):
    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
    eng = _engine(model, env, slots=12)
    trees, stats = rollout(eng, env, world.train[:2], search, AGENT, key=jax.random.key(1))
    prompts = sum(len(t.prompt_tokens) for t in trees if t.tree_id == 0)
    observations = sum(len(node.obs_tokens) for t in trees for node in t.nodes)
    assert stats.prefilled_tokens == prompts + observations
    assert stats.decoded_tokens == sum(len(node.tokens) for t in trees for node in t.nodes)
    assert stats.reprefill_tokens > stats.prefilled_tokens


def test_same_key_same_trees_and_different_key_differs(model, env, world):
    search = TreeSearchConfig(num_trees=2, num_picks=1, num_rounds=1)

    def run(seed):
        trees, _ = rollout(
            _engine(model, env, 8), env, world.train[:2], search, AGENT, key=jax.random.key(seed)
        )
        return [[(n.parent, tuple(n.tokens), tuple(n.obs_tokens)) for n in t.nodes] for t in trees]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_a_prompts_trees_do_not_depend_on_its_batch(model, env, world):
    """Alone or beside another prompt (another host's share, another wave): the same trees."""
    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)

    def run(rows, uids, slots):
        trees, _ = rollout(
            _engine(model, env, slots), env, rows, search, AGENT, key=jax.random.key(3), prompt_uids=uids
        )
        return {(uids[t.prompt_id], t.tree_id): [(n.parent, tuple(n.tokens)) for n in t.nodes] for t in trees}

    both = run(list(world.train[:2]), [10, 11], 24)
    alone = run([world.train[1]], [11], 12)
    assert alone == {k: v for k, v in both.items() if k[0] == 11}


def test_sampler_logprobs_equal_teacher_forced_recompute(model, env, world):
    """Every token of every leaf path, forked caches included, has the log-prob (and the sampler
    entropy, which the `entropy` branching rule reads) that a full forward gives."""
    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
    agent = dataclasses.replace(AGENT, temperature=0.8)
    trees, _ = rollout(_engine(model, env, 6), env, world.train[:1], search, agent, key=jax.random.key(5))
    checked = 0
    for tree in trees:
        for leaf, tokens, mask, logp in tree.leaf_paths():
            logits = full_logits(model, tokens, pad_to=512)
            full = jax.nn.log_softmax(logits[:-1] / 0.8, axis=-1)
            ref = full[jnp.arange(len(tokens) - 1), np.asarray(tokens[1:])]
            ent = -jnp.sum(jnp.exp(full) * full, axis=-1)
            m = np.asarray(mask[1:], bool)
            np.testing.assert_allclose(np.asarray(logp[1:])[m], np.asarray(ref)[m], atol=2e-4)
            recorded = [h for n in tree.path(leaf.node_id) for h in n.entropies]
            assert len(recorded) == int(m.sum())
            np.testing.assert_allclose(recorded, np.asarray(ent)[m], atol=2e-4)
            checked += int(m.sum())
    assert checked > 50


def test_engine_too_small_for_one_prompt_is_a_clear_error(model, env, world):
    with pytest.raises(OutOfSlotsError, match="one prompt needs 6 slots"):
        rollout(
            _engine(model, env, 4), env, world.train[:1], TreeSearchConfig(), AGENT, key=jax.random.key(0)
        )


def test_trees_render_to_png_and_svg(model, env, world, tmp_path):
    from treegrpo_jax.rollout.render import render_trees

    search = TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1)
    trees, _ = rollout(_engine(model, env, 6), env, world.train[:1], search, AGENT, key=jax.random.key(2))
    render_trees(trees, str(tmp_path / "t.png"))
    render_trees(trees[:1], str(tmp_path / "t.svg"))
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = (tmp_path / "t.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "prompt" in svg

"""The agent loop with a real pretrained policy (offline SmolLM2) and the real BM25 retriever."""

import jax
import numpy as np
import pytest

from treegrpo_jax.data.synthetic_world import WorldConfig, build_world
from treegrpo_jax.env.actions import STOP_SEQUENCES
from treegrpo_jax.env.bm25 import BM25Retriever
from treegrpo_jax.env.observation import ObservationConfig
from treegrpo_jax.rollout import stops
from treegrpo_jax.rollout.agent import AgentConfig, AgentEnv
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.tree import StepKind
from treegrpo_jax.rollout.tree_search import TreeSearchConfig, rollout

from .reference import full_logits


@pytest.mark.slow
def test_smollm2_tree_rollout_on_the_synthetic_world(smollm2):
    model, cfg, tok = smollm2
    world = build_world(
        WorldConfig(
            num_people=20,
            num_cities=8,
            num_countries=3,
            num_organisations=6,
            num_works=10,
            questions_per_hop=(2, 2, 0, 0),
        )
    )
    env = AgentEnv(
        tokenizer=tok,
        retriever=BM25Retriever.from_texts([r["contents"] for r in world.corpus_rows()]),
        observation=ObservationConfig(passage_tokens=32, max_tokens=80),
    )
    agent = AgentConfig(
        max_tool_calls=1, max_turns=2, max_step_tokens=32, top_k=2, temperature=0.7, top_p=1.0
    )
    table = stops.make_stop_table(stops.token_bytes(tok), STOP_SEQUENCES, cfg.vocab_size)
    engine = Engine(model, num_slots=4, max_len=1024, eos_ids=tok.eos_ids, stop_table=table, min_rows=4)
    search = TreeSearchConfig(num_trees=1, num_picks=1, num_rounds=1)
    trees, stats = rollout(engine, env, world.train[:2], search, agent, key=jax.random.key(0))
    assert [len(t.leaves()) for t in trees] == [2, 2]
    for tree in trees:
        assert (
            tree.prompt_tokens[:3] == tok.encode_chat([{"role": "user", "content": "x"}])[:3]
        )  # chat template
        for leaf, tokens, mask, logp in tree.leaf_paths():
            assert leaf.tool_calls <= 1
            for node in tree.path(leaf.node_id):
                if node.kind == StepKind.SEARCH and node.obs_tokens:
                    assert "<information>" in tok.decode(node.obs_tokens)
            # Every sampled token's log-prob equals a teacher-forced recompute of the whole path.
            ref = jax.nn.log_softmax(full_logits(model, tokens, pad_to=512)[:-1] / 0.7, axis=-1)
            ref = np.asarray(ref)[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]
            m = np.asarray(mask[1:], bool)
            np.testing.assert_allclose(np.asarray(logp[1:])[m], ref[m], atol=2e-3)
    assert stats.decoded_tokens > 0 and stats.prefilled_tokens > 0

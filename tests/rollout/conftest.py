"""Shared rollout fixtures: a small synthetic world, its BPE tokenizer and BM25 over its corpus."""

import pytest

from treegrpo_jax.data.synthetic_world import WorldConfig, build_world
from treegrpo_jax.env.bm25 import BM25Retriever
from treegrpo_jax.env.observation import ObservationConfig
from treegrpo_jax.model.bpe_train import train_bpe_tokenizer
from treegrpo_jax.rollout.agent import AgentEnv


@pytest.fixture(scope="module")
def world():
    sizes = dict(num_people=20, num_cities=8, num_countries=3, num_organisations=6, num_works=10)
    return build_world(WorldConfig(**sizes, questions_per_hop=(4, 4, 4, 4)))


@pytest.fixture(scope="module")
def world_env(world):
    tok = train_bpe_tokenizer([p for p in world.passages] + [r.question for r in world.train], vocab_size=512)
    retriever = BM25Retriever.from_texts([r["contents"] for r in world.corpus_rows()])
    return AgentEnv(
        tokenizer=tok, retriever=retriever, observation=ObservationConfig(passage_tokens=16, max_tokens=60)
    )

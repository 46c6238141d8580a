"""The policy every rollout part of `rollout.py` runs, set up once per part.

Without `--policy_workdir`: the benchmark's model re-sized to a BPE vocabulary trained on the
synthetic world (random weights, so tool calls are noise). With it: checkpoint
`--policy_step` of a run (e.g. `make demo`'s `workdir/tiny`, or a `:smollm2,cpu` workdir) with
that run's own config (`WORKDIR/config.json`: world, template, observation, agent settings), so
trees look like training's.
"""

from __future__ import annotations

import dataclasses

from treegrpo_jax.env.actions import STOP_SEQUENCES
from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.rollout.tree_search import TreeSearchConfig

# The two shapes every tree-vs-chain comparison runs: 6 leaves per prompt each.
SHAPES = {
    "tree": TreeSearchConfig(num_trees=2, num_picks=2, num_rounds=1),
    "chain": TreeSearchConfig(num_trees=6, num_picks=0, num_rounds=0),
}
LEAVES_PER_PROMPT = 6
# Positions per slot for `:tiny`-sized runs (context 1,024: no `:tiny` tree reaches 768, and the
# figures in BENCHMARKS.md were taken at it); a longer run context (SmolLM2's 2,048) is used as is.
_TINY_MAX_LEN = 768


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """A policy with everything a rollout needs, and the world's corpus (for an HTTP server)."""

    model: Decoder
    tokenizer: object
    env: object  # rollout.agent.AgentEnv
    agent: object  # rollout.agent.AgentConfig
    rows: tuple  # the first `prompts` train questions
    stop_table: object
    corpus: tuple[str, ...]
    name: str
    max_len: int  # positions per engine slot


def load_policy(bc, prompts: int) -> Policy:
    """The policy of `bc` (see the module docstring) with its first `prompts` train questions."""
    from treegrpo_jax.rollout.stops import make_stop_table, token_bytes

    if bc.policy_workdir:
        model, tok, env, agent, train, world, context = _trained(bc)
        name = f"{bc.policy_workdir} step {bc.policy_step}"
    else:
        model, tok, env, agent, train, world, context = _random(bc)
        name = "random weights"
    table = make_stop_table(token_bytes(tok), STOP_SEQUENCES, vocab_size=model.cfg.vocab_size)
    corpus = tuple(r["contents"] for r in world.corpus_rows())
    return Policy(
        model=model, tokenizer=tok, env=env, agent=agent, rows=tuple(train[:prompts]), stop_table=table,
        corpus=corpus, name=name, max_len=_TINY_MAX_LEN if context <= 1024 else context,
    )  # fmt: skip


def _trained(bc):
    from treegrpo_jax.configs import multihop
    from treegrpo_jax.train import setup
    from treegrpo_jax.train.config import from_config_dict
    from treegrpo_jax.train.config_dict import load_run_config
    from treegrpo_jax.train.export import load_model_config, load_tokenizer, restore_model

    # The run's own config (WORKDIR/config.json); a workdir from before runs wrote one is `:tiny`.
    tcfg = from_config_dict(load_run_config(bc.policy_workdir) or multihop.get_config("tiny"))
    tok = load_tokenizer(bc.policy_workdir)
    model, _ = restore_model(bc.policy_workdir, load_model_config(bc.policy_workdir), step=bc.policy_step)
    data = setup.load_data(tcfg, bc.policy_workdir)
    env = setup.make_env(tcfg, tok, setup.make_retriever(tcfg, data))
    return model, tok, env, tcfg.agent, list(data.train), data.world, tcfg.run.context_len


def _random(bc):
    from treegrpo_jax.data.synthetic_world import WorldConfig, build_world
    from treegrpo_jax.env.bm25 import BM25Retriever
    from treegrpo_jax.env.observation import ObservationConfig
    from treegrpo_jax.env.prompt import PromptConfig
    from treegrpo_jax.model.bpe_train import train_bpe_tokenizer
    from treegrpo_jax.rollout.agent import AgentConfig, AgentEnv

    world = build_world(WorldConfig(seed=bc.seed))
    retriever = BM25Retriever.from_texts([r["contents"] for r in world.corpus_rows()])
    tok = train_bpe_tokenizer(list(world.passages) + [r.question for r in world.train], vocab_size=1024)
    model = init_model(dataclasses.replace(bc.model_config(), vocab_size=tok.vocab_size), seed=bc.seed)
    env = AgentEnv(
        tokenizer=tok,
        retriever=retriever,
        prompt=PromptConfig.from_template("search_agent_terse"),
        observation=ObservationConfig(passage_tokens=56, max_tokens=72),
    )
    agent = AgentConfig(max_tool_calls=4, max_turns=5, max_step_tokens=48, top_k=1)
    return model, tok, env, agent, list(world.train), world, _TINY_MAX_LEN


def engine_for(policy: Policy, prompts: int, **kw):
    """The engine every tree-vs-chain part uses: 6 slots per prompt, `policy.max_len` positions
    each, rows bucketed to the live slots (powers of two from 8) so a phase pays only for its rows."""
    from treegrpo_jax.rollout.engine import Engine

    return Engine(
        policy.model, num_slots=prompts * LEAVES_PER_PROMPT, max_len=policy.max_len,
        eos_ids=policy.tokenizer.eos_ids, stop_table=policy.stop_table, min_rows=8, **kw,
    )  # fmt: skip

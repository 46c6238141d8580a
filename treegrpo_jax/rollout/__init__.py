"""Rollouts: sampling, the slot-pool engine, stop strings, the agent loop, tree search, pictures."""

from treegrpo_jax.rollout.agent import AgentConfig, AgentEnv, PhaseTimes, Trajectory, advance, forced_next
from treegrpo_jax.rollout.engine import DecodeResult, Engine, EngineStats, OutOfSlotsError
from treegrpo_jax.rollout.generate import generate_ids, generate_text
from treegrpo_jax.rollout.sampling import SamplingParams, sample
from treegrpo_jax.rollout.stops import StopTable, make_stop_table, token_bytes
from treegrpo_jax.rollout.tree import LEAF_KINDS, Node, StepKind, Tree
from treegrpo_jax.rollout.tree_search import RolloutStats, TreeSearchConfig, prompt_tokens, rollout

__all__ = [
    "LEAF_KINDS",
    "AgentConfig",
    "AgentEnv",
    "DecodeResult",
    "Engine",
    "EngineStats",
    "Node",
    "OutOfSlotsError",
    "PhaseTimes",
    "RolloutStats",
    "SamplingParams",
    "StepKind",
    "StopTable",
    "Trajectory",
    "Tree",
    "TreeSearchConfig",
    "advance",
    "forced_next",
    "generate_ids",
    "generate_text",
    "make_stop_table",
    "prompt_tokens",
    "rollout",
    "sample",
    "token_bytes",
]

"""Rollouts: sampling, the engine (slot or paged KV cache), stop strings, the agent step, tree search and its
drivers (continuous-batching scheduler; lock-step reference), pictures."""

from treegrpo_jax.rollout.agent import AgentConfig, AgentEnv, PhaseTimes, Trajectory, forced_next
from treegrpo_jax.rollout.engine import DecodeResult, Engine, EngineStats
from treegrpo_jax.rollout.generate import generate_ids, generate_text
from treegrpo_jax.rollout.page_pool import OutOfPagesError, OutOfSlotsError
from treegrpo_jax.rollout.sampling import SamplingParams, sample
from treegrpo_jax.rollout.stops import StopTable, make_stop_table, token_bytes
from treegrpo_jax.rollout.tree import LEAF_KINDS, Node, StepKind, Tree
from treegrpo_jax.rollout.tree_search import (
    RolloutCancelled,
    RolloutStats,
    SchedulerConfig,
    TreeSearchConfig,
    prompt_tokens,
    rollout,
)

__all__ = [
    "LEAF_KINDS",
    "AgentConfig",
    "AgentEnv",
    "DecodeResult",
    "Engine",
    "EngineStats",
    "Node",
    "OutOfPagesError",
    "OutOfSlotsError",
    "PhaseTimes",
    "RolloutCancelled",
    "RolloutStats",
    "SamplingParams",
    "SchedulerConfig",
    "StepKind",
    "StopTable",
    "Trajectory",
    "Tree",
    "TreeSearchConfig",
    "forced_next",
    "generate_ids",
    "generate_text",
    "make_stop_table",
    "prompt_tokens",
    "rollout",
    "sample",
    "token_bytes",
]

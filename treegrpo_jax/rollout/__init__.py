"""Rollouts: sampling, the engine (slot or paged KV cache), stop strings, the agent step, tree search and its
drivers (continuous-batching scheduler; lock-step reference), pictures."""

from treegrpo_jax._exports import lazy_exports

_EXPORTS = {
    "AgentConfig": "agent",
    "AgentEnv": "agent",
    "PhaseTimes": "agent",
    "Trajectory": "agent",
    "forced_next": "agent",
    "register_rule": "branching",
    "rule_names": "branching",
    "DecodeResult": "engine",
    "Engine": "engine",
    "EngineStats": "engine",
    "generate_ids": "generate",
    "generate_text": "generate",
    "OutOfPagesError": "page_pool",
    "OutOfSlotsError": "page_pool",
    "SamplingParams": "sampling",
    "sample": "sampling",
    "StopTable": "stops",
    "make_stop_table": "stops",
    "token_bytes": "stops",
    "LEAF_KINDS": "tree",
    "Node": "tree",
    "StepKind": "tree",
    "Tree": "tree",
    "RolloutCancelled": "tree_search",
    "RolloutStats": "tree_search",
    "SchedulerConfig": "tree_search",
    "TreeSearchConfig": "tree_search",
    "prompt_tokens": "tree_search",
    "rollout": "tree_search",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

"""The search environment: prompt, action parser, observations, rewards and retrievers.

What the agent loop calls, per step: `parse_action` on the generated text; for a `Search`, a
`Retriever.search` over the batch of queries, then `format_observation`; for an `Invalid`, the
`PromptConfig.invalid_action` text; at a leaf, `AgentEnv.reward` (`reward_fn.py`; the paper's
`training_reward` by default) over the path's step texts.
"""

from treegrpo_jax._exports import lazy_exports

_EXPORTS = {
    "Action": "actions",
    "ActionKind": "actions",
    "Answer": "actions",
    "DEFAULT_PARSER": "actions",
    "Invalid": "actions",
    "InvalidReason": "actions",
    "ParserConfig": "actions",
    "STOP_SEQUENCES": "actions",
    "Search": "actions",
    "parse_action": "actions",
    "BM25Config": "bm25",
    "BM25Retriever": "bm25",
    "read_corpus": "bm25",
    "HttpRetriever": "http_client",
    "HttpRetrieverConfig": "http_client",
    "RetrievalStats": "http_client",
    "ObservationConfig": "observation",
    "TokenizerLike": "observation",
    "format_observation": "observation",
    "format_passages": "observation",
    "FORCED_ANSWER": "prompt",
    "INVALID_ACTION": "prompt",
    "PromptConfig": "prompt",
    "load_template": "prompt",
    "render_prompt": "prompt",
    "Passage": "retrieval",
    "Retriever": "retrieval",
    "RetrieverUnavailableError": "retrieval",
    "SearchResult": "retrieval",
    "split_contents": "retrieval",
    "ServerConfig": "retrieval_server",
    "make_server": "retrieval_server",
    "serve_corpus": "retrieval_server",
    "AnswerMetric": "rewards",
    "RewardBreakdown": "rewards",
    "RewardTable": "rewards",
    "em": "rewards",
    "evaluation_reward": "rewards",
    "f1": "rewards",
    "final_answer": "rewards",
    "is_well_formed": "rewards",
    "normalize_answer": "rewards",
    "score_trajectory": "rewards",
    "split_trajectory": "rewards",
    "step_action_tag": "rewards",
    "training_reward": "rewards",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

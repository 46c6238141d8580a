"""The search environment: prompt, action parser, observations, rewards and retrievers.

What the agent loop calls, per step: `parse_action` on the generated text; for a `Search`, a
`Retriever.search` over the batch of queries, then `format_observation`; for an `Invalid`, the
`PromptConfig.invalid_action` text; at a leaf, `training_reward` over the path's step texts.
"""

from treegrpo_jax.env.actions import (
    DEFAULT_PARSER,
    STOP_SEQUENCES,
    Action,
    ActionKind,
    Answer,
    Invalid,
    InvalidReason,
    ParserConfig,
    Search,
    parse_action,
)
from treegrpo_jax.env.bm25 import BM25Config, BM25Retriever, read_corpus
from treegrpo_jax.env.http_client import HttpRetriever, HttpRetrieverConfig, RetrievalStats
from treegrpo_jax.env.observation import (
    ObservationConfig,
    TokenizerLike,
    format_observation,
    format_passages,
)
from treegrpo_jax.env.prompt import (
    FORCED_ANSWER,
    INVALID_ACTION,
    PromptConfig,
    load_template,
    render_prompt,
)
from treegrpo_jax.env.retrieval import (
    Passage,
    Retriever,
    RetrieverUnavailableError,
    SearchResult,
    split_contents,
)
from treegrpo_jax.env.retrieval_server import ServerConfig, make_server, serve_corpus
from treegrpo_jax.env.rewards import (
    AnswerMetric,
    RewardBreakdown,
    RewardTable,
    em,
    evaluation_reward,
    f1,
    final_answer,
    is_well_formed,
    normalize_answer,
    score_trajectory,
    split_trajectory,
    step_action_tag,
    training_reward,
)

__all__ = [
    "DEFAULT_PARSER",
    "FORCED_ANSWER",
    "INVALID_ACTION",
    "STOP_SEQUENCES",
    "Action",
    "ActionKind",
    "Answer",
    "AnswerMetric",
    "BM25Config",
    "BM25Retriever",
    "HttpRetriever",
    "HttpRetrieverConfig",
    "Invalid",
    "InvalidReason",
    "ObservationConfig",
    "Passage",
    "PromptConfig",
    "ParserConfig",
    "RetrievalStats",
    "Retriever",
    "RetrieverUnavailableError",
    "RewardBreakdown",
    "RewardTable",
    "Search",
    "SearchResult",
    "ServerConfig",
    "TokenizerLike",
    "em",
    "evaluation_reward",
    "f1",
    "final_answer",
    "format_observation",
    "format_passages",
    "is_well_formed",
    "load_template",
    "make_server",
    "normalize_answer",
    "parse_action",
    "read_corpus",
    "render_prompt",
    "score_trajectory",
    "serve_corpus",
    "split_contents",
    "split_trajectory",
    "step_action_tag",
    "training_reward",
]

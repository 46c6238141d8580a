"""Turn retrieved passages into the observation text appended after a search step.

Layout (each passage on its own line, numbered from 1)::

    \\n\\n<information>Doc 1 (Title: Paris) Paris is the capital ...
    Doc 2 (Title: ...) ...</information>\\n\\n

Budgets are in tokens of the policy's tokenizer, because the context cap is in tokens: each passage
line is cut to ``passage_tokens`` and the whole observation (tags and newlines included) to
``max_tokens`` (500 in the paper, docs/DESIGN.md §1). The closing tag survives the cut, so the model always
sees a well-formed block. The guarantee is ``len(tokenizer.encode(observation)) <= max_tokens``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from treegrpo_jax.env.retrieval import Passage, SearchResult

OPEN_TAG = "\n\n<information>"
CLOSE_TAG = "</information>\n\n"
# Cutting token ids and decoding can re-tokenize a little longer (BPE merges across the cut);
# shrink in these steps, a bounded number of times.
_SHRINK_STEPS = (0, 2, 4, 8, 16, 32, 64)


@runtime_checkable
class TokenizerLike(Protocol):
    """The two tokenizer calls we need. ``encode`` must not add special tokens (BOS/EOS)."""

    def encode(self, text: str) -> list[int]:
        """Text to token ids."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids to text."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObservationConfig:
    """Observation budgets and fixed texts.

    Attributes:
      passage_tokens: each "Doc i (Title: ...) text" line is cut to this many tokens.
      max_tokens: the whole observation, tags included, is cut to this many tokens.
      no_results: body shown when the search matched nothing.
      search_error: body shown when the retriever failed (the error detail goes to logs, not to the
        model, so the policy never trains on infrastructure noise).
    """

    passage_tokens: int = 160
    max_tokens: int = 500
    no_results: str = "No passages matched this query."
    search_error: str = "The search engine is unavailable right now. Try again or answer from what you know."

    def __post_init__(self):
        if self.passage_tokens < 1:
            raise ValueError(f"ObservationConfig.passage_tokens must be >= 1, got {self.passage_tokens}")
        if self.max_tokens < 16:
            raise ValueError(f"ObservationConfig.max_tokens must be >= 16, got {self.max_tokens}")


def _cut(text: str, tokenizer: TokenizerLike, budget: int) -> str:
    ids = tokenizer.encode(text)
    return text if len(ids) <= budget else tokenizer.decode(ids[:budget])


def _wrap(body: str, tokenizer: TokenizerLike, max_tokens: int) -> str:
    """Wraps ``body`` in information tags, cutting the body so the total fits ``max_tokens``."""
    full = f"{OPEN_TAG}{body}{CLOSE_TAG}"
    ids = tokenizer.encode(full)
    if len(ids) <= max_tokens:
        return full
    body_ids = tokenizer.encode(body)
    room = max_tokens - (len(ids) - len(body_ids))  # Tokens left for the body next to the tags.
    for shrink in _SHRINK_STEPS:
        n = room - shrink
        if n <= 0:
            break
        out = f"{OPEN_TAG}{tokenizer.decode(body_ids[:n]).rstrip()}{CLOSE_TAG}"
        if len(tokenizer.encode(out)) <= max_tokens:
            return out
    return f"{OPEN_TAG}{CLOSE_TAG}"


def format_passages(passages: Sequence[Passage], *, tokenizer: TokenizerLike, cfg: ObservationConfig) -> str:
    """The observation for a successful search.

    Args:
      passages: retrieved passages, best first.
      tokenizer: the policy's tokenizer (budgets are in its tokens).
      cfg: budgets and fixed texts.

    Returns:
      The observation text, at most ``cfg.max_tokens`` tokens.
    """
    if not passages:
        return _wrap(cfg.no_results, tokenizer, cfg.max_tokens)
    lines = []
    for i, p in enumerate(passages, start=1):
        title = " ".join(p.title.split())  # A newline in a title would break the one-line layout.
        line = f"Doc {i} (Title: {title}) {p.text.strip()}".rstrip()
        lines.append(_cut(line, tokenizer, cfg.passage_tokens).rstrip())
    return _wrap("\n".join(lines), tokenizer, cfg.max_tokens)


def format_observation(result: SearchResult, *, tokenizer: TokenizerLike, cfg: ObservationConfig) -> str:
    """The observation for one search: passages, "no results", or the error text.

    Args:
      result: the retriever's answer for this step's query.
      tokenizer: the policy's tokenizer.
      cfg: budgets and fixed texts.

    Returns:
      The observation text, at most ``cfg.max_tokens`` tokens.
    """
    if not result.ok:
        return _wrap(cfg.search_error, tokenizer, cfg.max_tokens)
    return format_passages(result.passages, tokenizer=tokenizer, cfg=cfg)

"""The retriever interface shared by BM25, the HTTP client and the server.

A retriever answers a *batch* of queries at once (the rollout issues one search per live branch, so
batching is the natural unit) and does not raise for a failed backend: each query gets a
`SearchResult` that either holds passages or carries an ``error`` string, so the agent loop can turn
a failure into an error observation and the run goes on. The one exception is a backend that has
been unreachable for longer than its configured limit: then `RetrieverUnavailableError`, so the
trainer saves a checkpoint and stops instead of training on error observations for hours.

Corpus passages follow Search-R1's wiki-18 layout: ``{"id": ..., "contents": "Title\\ntext"}`` —
the title on the first line (often in double quotes), the text after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable


class RetrieverUnavailableError(RuntimeError):
    """The retrieval backend has been unreachable for longer than its configured limit."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Passage:
    """One retrieved passage.

    Attributes:
      id: corpus id of the passage (a string even when the corpus used numbers).
      title: the title line of ``contents``, surrounding quotes removed.
      text: the rest of ``contents``.
      score: retrieval score (higher is better); only comparable within one retriever.
    """

    id: str
    title: str
    text: str
    score: float

    @property
    def contents(self) -> str:
        """The passage in corpus layout: title line, then text."""
        return f"{self.title}\n{self.text}" if self.text else self.title


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchResult:
    """The answer to one query: passages, best first, or an error.

    Attributes:
      passages: up to k passages, best first; empty on error or when nothing matched.
      error: None on success; otherwise a short description of why retrieval failed.
    """

    passages: tuple[Passage, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when retrieval succeeded (possibly with zero passages)."""
        return self.error is None


@runtime_checkable
class Retriever(Protocol):
    """Anything that answers batched searches."""

    def search(self, queries: Sequence[str], k: int) -> list[SearchResult]:
        """Returns one `SearchResult` per query, in order, each with at most ``k`` passages."""
        ...


def split_contents(contents: str) -> tuple[str, str]:
    """Splits Search-R1 ``contents`` into ``(title, text)``.

    The title is the first line with white space and one pair of surrounding double quotes removed
    (wiki-18 writes ``"Paris"``); the text is everything after the first newline, stripped.

    Args:
      contents: the corpus ``contents`` string.

    Returns:
      ``(title, text)``; ``text`` is empty when there is no newline.
    """
    title, _, text = contents.partition("\n")
    title = title.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1].strip()
    return title, text.strip()


def check_k(k: int) -> None:
    """Raises ValueError unless ``k`` is a positive int (a programming error, not a backend fault)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")

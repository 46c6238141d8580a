"""Classify one model step (its generated text) as a search, an answer, or an invalid action.

Rule: the action is the **first complete** action tag — the first closing ``</search>`` or
``</answer>`` that has an opening tag of the same name before it, paired with the latest such
opening tag. That matches the rollout engine, which stops generating at the first closing tag.
Tags are matched ignoring case and with white space allowed inside the brackets (``< Search >``).

The parser never raises: any input (empty, unicode, nested or unclosed tags, megabytes of text)
gives an `Action`. Work is bounded by scanning at most ``max_scan_chars`` characters with a regex
whose quantifiers are all bounded, and queries/answers are cut to a maximum length.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import ClassVar

# The rollout engine stops a step at either of these (docs/DESIGN.md §2).
STOP_SEQUENCES = ("</search>", "</answer>")

# Bounded \s{0,8}: unbounded \s* on both sides of "/?" backtracks quadratically on "<" + spaces.
_ACTION_TAG = re.compile(r"<\s{0,8}(/?)\s{0,8}(search|answer)\s{0,8}>", re.IGNORECASE)
# Our tags inside a query or answer are markup noise, not words to search for.
_ANY_TAG = re.compile(r"<\s{0,8}/?\s{0,8}(?:search|answer|think|information)\s{0,8}>", re.IGNORECASE)
_SPACES = re.compile(r"\s+")


class ActionKind(enum.Enum):
    """What a step asked for."""

    SEARCH = "search"
    ANSWER = "answer"
    INVALID = "invalid"


class InvalidReason(enum.Enum):
    """Why a step has no usable action."""

    EMPTY = "empty"  # Blank text.
    NO_ACTION = "no_action"  # No action tag at all.
    UNCLOSED_TAG = "unclosed_tag"  # An opening action tag with no matching close.
    EMPTY_QUERY = "empty_query"  # <search></search> with nothing to search for.
    SEARCH_DISABLED = "search_disabled"  # A search in the forced-answer step.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Search:
    """Search for ``query`` (white space collapsed, tags removed, length capped)."""

    query: str
    clipped: bool = dataclasses.field(default=False, compare=False)  # cut to max_query_chars
    kind: ClassVar[ActionKind] = ActionKind.SEARCH


@dataclasses.dataclass(frozen=True, kw_only=True)
class Answer:
    """Final answer ``text`` (white space collapsed, tags removed, length capped; may be empty)."""

    text: str
    clipped: bool = dataclasses.field(default=False, compare=False)  # cut to max_answer_chars
    kind: ClassVar[ActionKind] = ActionKind.ANSWER


@dataclasses.dataclass(frozen=True, kw_only=True)
class Invalid:
    """No usable action, and why."""

    reason: InvalidReason
    kind: ClassVar[ActionKind] = ActionKind.INVALID


Action = Search | Answer | Invalid


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParserConfig:
    """Work bounds for `parse_action`.

    Attributes:
      max_scan_chars: only this prefix of a step is scanned for tags (a step is at most a few
        hundred tokens, so the default leaves ample room).
      max_query_chars: longer queries are cut.
      max_answer_chars: longer answers are cut.
    """

    max_scan_chars: int = 32_768
    max_query_chars: int = 512
    max_answer_chars: int = 1024

    def __post_init__(self):
        for name in ("max_scan_chars", "max_query_chars", "max_answer_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParserConfig.{name} must be >= 1, got {getattr(self, name)}")


DEFAULT_PARSER = ParserConfig()


def _clean(content: str, max_chars: int) -> tuple[str, bool]:
    """(cleaned content cut to `max_chars`, whether it was cut)."""
    content = _SPACES.sub(" ", _ANY_TAG.sub(" ", content)).strip()
    return content[:max_chars].rstrip(), len(content) > max_chars


def _first_action(text: str, max_scan_chars: int) -> tuple[ActionKind | None, str, bool]:
    """Returns ``(kind, content, open_seen)`` for the first complete action tag.

    ``kind`` is None when there is none; ``open_seen`` then tells whether an opening tag was seen.
    """
    pending: dict[str, int] = {}  # tag name -> end of its latest opening tag
    for m in _ACTION_TAG.finditer(text, 0, max_scan_chars):
        name = m.group(2).lower()
        if not m.group(1):
            pending[name] = m.end()
        elif name in pending:
            kind = ActionKind.SEARCH if name == "search" else ActionKind.ANSWER
            return kind, text[pending[name] : m.start()], True
    return None, "", bool(pending)


def parse_action(text: str, *, search_allowed: bool = True, cfg: ParserConfig = DEFAULT_PARSER) -> Action:
    """Classifies one model step. Never raises.

    Args:
      text: the text the model generated in this step (not the observation).
      search_allowed: False in the forced-answer step after the tool-call limit; a search then is
        ``Invalid(SEARCH_DISABLED)``.
      cfg: work bounds.

    Returns:
      `Search`, `Answer` or `Invalid`.
    """
    if not isinstance(text, str):  # Defensive: the contract is str, but a bad caller must not crash us.
        text = "" if text is None else str(text)
    if not text.strip():
        return Invalid(reason=InvalidReason.EMPTY)
    kind, content, open_seen = _first_action(text, cfg.max_scan_chars)
    if kind is None:
        return Invalid(reason=InvalidReason.UNCLOSED_TAG if open_seen else InvalidReason.NO_ACTION)
    if kind is ActionKind.ANSWER:
        text, clipped = _clean(content, cfg.max_answer_chars)
        return Answer(text=text, clipped=clipped)
    if not search_allowed:
        return Invalid(reason=InvalidReason.SEARCH_DISABLED)
    query, clipped = _clean(content, cfg.max_query_chars)
    if not query:
        return Invalid(reason=InvalidReason.EMPTY_QUERY)
    return Search(query=query, clipped=clipped)

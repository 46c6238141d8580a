"""Prompt text: the task instruction, the forced-answer nudge and the invalid-action feedback.

The instruction template is a text file (``env/templates/<name>.txt``, or any path) holding the
placeholder ``{question}`` exactly once. Only that placeholder is substituted (no ``str.format``),
so templates may contain other braces and questions may contain anything.

The rendered prompt is the *user message*; the tokenizer's chat template (if any) wraps it.
`prompt_ids` is the one place a prompt becomes token ids (BOS once), for rollouts and cold-start
demonstrations alike; everything after it (model steps, observations) is encoded as a segment
(`encode`, which adds nothing).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

PLACEHOLDER = "{question}"
DEFAULT_TEMPLATE = "search_agent"

# Appended after the last observation once the tool-call limit is reached (docs/DESIGN.md §1); the step
# that follows is the forced final-answer step, where a search counts as invalid.
FORCED_ANSWER = (
    "\nYou have used all your searches. Do not search again: think briefly, then give your final "
    "answer inside <answer> and </answer>.\n"
)

# The observation for a step with no usable action; the trajectory then goes on (docs/DESIGN.md §1).
INVALID_ACTION = (
    "\nThat step had no usable action. Write a search query inside <search> and </search>, "
    "or the final answer inside <answer> and </answer>.\n"
)

_NAME = re.compile(r"[a-z0-9_]+")


def load_template(name_or_path: str) -> str:
    """Reads a prompt template.

    Args:
      name_or_path: a bundled template name (``search_agent``, ``search_agent_terse``, or
        ``search_agent_bare``: the question alone, for models trained from scratch that learn the
        format from demonstrations) or a path to a text file.

    Returns:
      The template text, trailing white space removed.

    Raises:
      FileNotFoundError: when neither a bundled name nor an existing file.
    """
    if os.path.isfile(name_or_path):
        with open(name_or_path, encoding="utf-8") as f:
            return f.read().rstrip()
    if _NAME.fullmatch(name_or_path):
        res = importlib.resources.files("treegrpo_jax.env").joinpath("templates", f"{name_or_path}.txt")
        if res.is_file():
            return res.read_text(encoding="utf-8").rstrip()
    raise FileNotFoundError(f"no bundled template or file named {name_or_path!r}")


def render_prompt(template: str, question: str) -> str:
    """Substitutes ``question`` (stripped) for the ``{question}`` placeholder.

    Args:
      template: template text with ``{question}`` exactly once.
      question: the question.

    Returns:
      The user message.
    """
    if template.count(PLACEHOLDER) != 1:
        raise ValueError(f"template must contain {PLACEHOLDER} exactly once")
    return template.replace(PLACEHOLDER, question.strip())


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptConfig:
    """The three texts the agent loop shows the model.

    Attributes:
      template: instruction template text with ``{question}`` exactly once.
      forced_answer: appended after the last observation when the tool-call limit is reached.
      invalid_action: the observation for a step with no usable action.
    """

    template: str = dataclasses.field(default_factory=lambda: load_template(DEFAULT_TEMPLATE))
    forced_answer: str = FORCED_ANSWER
    invalid_action: str = INVALID_ACTION

    def __post_init__(self):
        if self.template.count(PLACEHOLDER) != 1:
            raise ValueError(f"PromptConfig.template must contain {PLACEHOLDER} exactly once")
        if not self.forced_answer.strip():
            raise ValueError("PromptConfig.forced_answer must not be blank")
        if not self.invalid_action.strip():
            raise ValueError("PromptConfig.invalid_action must not be blank")

    @classmethod
    def from_template(cls, name_or_path: str) -> PromptConfig:
        """A config whose template is `load_template(name_or_path)`; other texts default."""
        return cls(template=load_template(name_or_path))

    def render(self, question: str) -> str:
        """The user message for ``question``."""
        return render_prompt(self.template, question)


@runtime_checkable
class PromptTokenizer(Protocol):
    """What `prompt_ids` needs: segment and sequence-start encodes (`model.tokenizer.Tokenizer`)."""

    def encode(self, text: str) -> list[int]:
        """A segment: no BOS / EOS added."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """The start of a sequence: BOS once, when the tokenizer uses one."""
        ...


@runtime_checkable
class _ChatTemplating(Protocol):
    has_chat_template: bool

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...


def prompt_text(user_message: str, tokenizer: object, *, chat: bool = True) -> str:
    """The prompt text the model sees: the user message in the tokenizer's chat template, if any.

    Args:
      user_message: the rendered prompt (`PromptConfig.render`).
      tokenizer: the policy's tokenizer.
      chat: False keeps the plain message even when a template exists.

    Returns:
      The text to encode, ending where the assistant's first step begins.
    """
    if chat and isinstance(tokenizer, _ChatTemplating) and tokenizer.has_chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], add_generation_prompt=True
        )
    return user_message


def prompt_ids(user_message: str, tokenizer: PromptTokenizer, *, chat: bool = True) -> list[int]:
    """The prompt's token ids: `prompt_text`, with BOS once (the template's, or the tokenizer's)."""
    return tokenizer.encode_prompt(prompt_text(user_message, tokenizer, chat=chat))

"""Answer matching (EM, F1), the trajectory format check, and the training/evaluation rewards.

Input form. A trajectory is the list of **model-generated step texts**, one per tree node on the
root-to-leaf path, in order — observations, invalid-action feedback and the prompt excluded. The
rollout keeps each node's generated text apart from its observation, so this is exact. A single
string is also accepted: it is split at ``<information>…</information>`` blocks (for scripted
demonstrations and text-only outputs); pass the list when you have it.

Training reward (docs/DESIGN.md §1), from exact match of the normalised final answer against any gold:

    ===========  ===========  ======
    correct      well-formed  reward
    ===========  ===========  ======
    yes          yes          1.0
    yes          no           0.8
    no           yes          0.2
    no           no           0.1  (an answer tag is present)
    no answer                 0.0
    ===========  ===========  ======

The final answer is the `Answer` action of the last step that has one. Evaluation reward is pure EM.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import re
import string
from collections.abc import Sequence

from treegrpo_jax.env.actions import Answer, parse_action

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_INFO_TAG = re.compile(r"<\s{0,8}(/?)\s{0,8}information\s{0,8}>", re.IGNORECASE)
# Well-formedness is judged on the exact lower-case tags the prompt asks for...
_STRICT_TAG = re.compile(r"<(/?)(think|search|answer|information)>")
# ...and any looser spelling of them (case, inner spaces) counts against the format.
_LOOSE_TAG = re.compile(r"<\s{0,8}/?\s{0,8}(?:think|search|answer|information)\s{0,8}>", re.IGNORECASE)
# A step is checked on this prefix only; real steps are a few hundred tokens.
_MAX_STEP_CHARS = 65_536


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower-case, drop punctuation, drop articles, collapse white space."""
    s = s.lower().translate(_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _golds(golds: str | Sequence[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else [g for g in golds if isinstance(g, str)]


def em(pred: str, golds: str | Sequence[str]) -> float:
    """Exact match: 1.0 when ``pred`` equals any gold after `normalize_answer`, else 0.0.

    Unlike SQuAD, a prediction that normalises to nothing never matches (a gold such as "A" or
    "The" normalises to "" too, and an empty answer must not be a reward hack).
    """
    p = normalize_answer(pred)
    return float(bool(p) and any(p == normalize_answer(g) for g in _golds(golds)))


def _f1_one(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(pred: str, golds: str | Sequence[str]) -> float:
    """Token F1 (SQuAD) of ``pred`` against the best-matching gold; 0.0 with no golds."""
    p = normalize_answer(pred).split()
    return max((_f1_one(p, normalize_answer(g).split()) for g in _golds(golds)), default=0.0)


class AnswerMetric(enum.Enum):
    """How an answer is scored at evaluation."""

    EM = "em"
    F1 = "f1"


def split_trajectory(text: str) -> list[str]:
    """Splits a whole response into model steps at ``<information>…</information>`` blocks.

    Args:
      text: the response after the prompt: model steps interleaved with observations.

    Returns:
      The model-generated pieces, stripped of surrounding white space (the observation wrapper's
      newlines), blank pieces dropped; an unclosed information block ends the text.
    """
    steps, pos, depth_start = [], 0, None
    for m in _INFO_TAG.finditer(text):
        if not m.group(1) and depth_start is None:
            steps.append(text[pos : m.start()])
            depth_start = m.start()
        elif m.group(1) and depth_start is not None:
            pos, depth_start = m.end(), None
    if depth_start is None:
        steps.append(text[pos:])
    return [s.strip() for s in steps if s.strip()]


def _as_steps(steps_or_text: str | Sequence[str]) -> list[str]:
    if isinstance(steps_or_text, str):
        return split_trajectory(steps_or_text)
    return [s if isinstance(s, str) else "" for s in steps_or_text]


def step_action_tag(step: str) -> str | None:
    """The action of a well-formed step ("search" or "answer"), or None when the step is malformed.

    Well-formed means, with nothing but white space around the tags::

        <think> non-empty reasoning </think> <search|answer> non-empty content </search|answer>

    using exactly those lower-case tags, no other of our tags (think, search, answer, information)
    anywhere in the step, and no looser spelling of them (``<Search>``, ``< answer >``).
    """
    if len(step) > _MAX_STEP_CHARS:
        return None
    tags = list(_STRICT_TAG.finditer(step))
    if len(tags) != 4 or len(_LOOSE_TAG.findall(step)) != 4:
        return None
    names = [(m.group(1), m.group(2)) for m in tags]
    action = names[2][1]
    if names != [("", "think"), ("/", "think"), ("", action), ("/", action)]:
        return None
    if action not in ("search", "answer"):
        return None
    gaps = (step[: tags[0].start()], step[tags[1].end() : tags[2].start()], step[tags[3].end() :])
    inner = (step[tags[0].end() : tags[1].start()], step[tags[2].end() : tags[3].start()])
    if any(g.strip() for g in gaps) or not all(s.strip() for s in inner):
        return None
    return action


def is_well_formed(steps_or_text: str | Sequence[str]) -> bool:
    """The whole-trajectory format check.

    True when every step is well-formed (see `step_action_tag`: think before its action, tags
    balanced), every step but the last is a search, and the last is the one and only answer.

    Args:
      steps_or_text: model step texts (or a whole response, see the module docstring).
    """
    steps = _as_steps(steps_or_text)
    if not steps:
        return False
    actions = [step_action_tag(s) for s in steps]
    return actions[-1] == "answer" and all(a == "search" for a in actions[:-1])


def final_answer(steps_or_text: str | Sequence[str]) -> str | None:
    """The text of the last step's answer action that parses (first-tag rule), or None."""
    for step in reversed(_as_steps(steps_or_text)):
        action = parse_action(step, search_allowed=True)
        if isinstance(action, Answer):
            return action.text
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardTable:
    """The training reward values (defaults are docs/DESIGN.md §1; change only for ablations)."""

    correct_well_formed: float = 1.0
    correct_malformed: float = 0.8
    wrong_well_formed: float = 0.2
    wrong_malformed: float = 0.1
    no_answer: float = 0.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int | float) or v != v:
                raise ValueError(f"RewardTable.{f.name} must be a number, got {v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardBreakdown:
    """Why a trajectory got its reward (log these as metrics)."""

    answer: str | None
    correct: bool
    well_formed: bool
    reward: float


def score_trajectory(
    steps_or_text: str | Sequence[str], golds: str | Sequence[str], *, table: RewardTable | None = None
) -> RewardBreakdown:
    """Scores a trajectory with the training reward and explains it.

    Args:
      steps_or_text: model step texts (or a whole response).
      golds: gold answers (any match counts).
      table: reward values; default `RewardTable()`.

    Returns:
      The answer found, whether it is correct, whether the trajectory is well-formed, the reward.
    """
    table = table or RewardTable()
    steps = _as_steps(steps_or_text)
    answer = final_answer(steps)
    well_formed = is_well_formed(steps)
    if answer is None:
        return RewardBreakdown(answer=None, correct=False, well_formed=well_formed, reward=table.no_answer)
    correct = em(answer, golds) == 1.0
    if correct:
        reward = table.correct_well_formed if well_formed else table.correct_malformed
    else:
        reward = table.wrong_well_formed if well_formed else table.wrong_malformed
    return RewardBreakdown(answer=answer, correct=correct, well_formed=well_formed, reward=reward)


def training_reward(steps_or_text: str | Sequence[str], golds: str | Sequence[str]) -> float:
    """The training reward of docs/DESIGN.md §1 (1.0 / 0.8 / 0.2 / 0.1 / 0.0).

    Args:
      steps_or_text: model step texts (or a whole response).
      golds: gold answers.

    Returns:
      The reward.
    """
    return score_trajectory(steps_or_text, golds).reward


def evaluation_reward(
    steps_or_text: str | Sequence[str], golds: str | Sequence[str], *, metric: AnswerMetric = AnswerMetric.EM
) -> float:
    """Evaluation score: EM (default) or F1 of the final answer; 0.0 without an answer."""
    answer = final_answer(steps_or_text)
    if answer is None:
        return 0.0
    return em(answer, golds) if metric is AnswerMetric.EM else f1(answer, golds)

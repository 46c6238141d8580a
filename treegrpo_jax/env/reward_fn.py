"""The training reward as a part of the environment: pick one by name, or bring a callable.

A reward maps a trajectory — its model step texts in order (`env.rewards`' input form) — and the
question's gold answers to a float. The rollout scores every leaf with `AgentEnv.reward`, so
training on another reward needs no edit of rollout code: set `config.reward.kind`.

=============  ================================================================================
kind           reward
=============  ================================================================================
``em_format``  the paper's table (`env.rewards.score_trajectory`): 1.0 / 0.8 / 0.2 / 0.1 / 0.0
``f1``         token F1 of the final answer against the best gold (0.0 without an answer)
``callable``   ``fn="package.module:function"``, called as ``function(steps, golds) -> float``
=============  ================================================================================

The evaluation metric stays EM of the final answer whatever the training reward is, so runs
with different rewards are compared on the same scale.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from treegrpo_jax.env.rewards import AnswerMetric, RewardTable, evaluation_reward, score_trajectory
from treegrpo_jax.validation import as_enum


@runtime_checkable
class Reward(Protocol):
    """`reward(steps, golds) -> float`: steps are the model's step texts on a root-to-leaf path."""

    def __call__(self, steps: Sequence[str], golds: Sequence[str]) -> float: ...


class RewardKind(enum.StrEnum):
    EM_FORMAT = "em_format"
    F1 = "f1"
    CALLABLE = "callable"


@dataclasses.dataclass(frozen=True)
class EMFormatReward:
    """The paper's reward: exact match with a format bonus (`RewardTable`)."""

    table: RewardTable = dataclasses.field(default_factory=RewardTable)

    def __call__(self, steps: Sequence[str], golds: Sequence[str]) -> float:
        return score_trajectory(steps, golds, table=self.table).reward


@dataclasses.dataclass(frozen=True)
class F1Reward:
    """Token F1 of the final answer (SQuAD normalisation), 0.0 without an answer."""

    def __call__(self, steps: Sequence[str], golds: Sequence[str]) -> float:
        return evaluation_reward(steps, golds, metric=AnswerMetric.F1)


@dataclasses.dataclass(frozen=True)
class CheckedReward:
    """A user's callable, held to the contract: a finite float for every leaf."""

    fn: Callable[[Sequence[str], Sequence[str]], float]
    name: str

    def __call__(self, steps: Sequence[str], golds: Sequence[str]) -> float:
        value = self.fn(list(steps), list(golds))
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(
                f"reward {self.name} returned {value!r} for a trajectory: it must return a finite float"
            )
        return float(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """`config.reward`: which reward trains the policy.

    Attributes:
      kind: em_format (the paper's), f1, or callable.
      fn: for callable, ``"package.module:function"`` (importable where training runs).
    """

    kind: RewardKind = RewardKind.EM_FORMAT
    fn: str = ""

    def __post_init__(self):
        object.__setattr__(self, "kind", as_enum(RewardKind, self.kind, "RewardConfig.kind"))
        if self.kind is RewardKind.CALLABLE and (not isinstance(self.fn, str) or self.fn.count(":") != 1):
            raise ValueError(
                f"RewardConfig.fn must be 'package.module:function' for kind=callable, got {self.fn!r}"
            )
        if self.kind is not RewardKind.CALLABLE and self.fn:
            raise ValueError(
                f"RewardConfig.fn={self.fn!r} is only used with kind=callable (kind={self.kind.value!r})"
            )
        if self.kind is RewardKind.CALLABLE:
            _load(self.fn)  # a bad path fails here, before any model is loaded


def _load(fn: str) -> Callable:
    module_name, _, attr = fn.partition(":")
    try:
        value = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"RewardConfig.fn={fn!r} cannot be loaded: {e}") from None
    if not callable(value):
        raise ValueError(f"RewardConfig.fn={fn!r} is not callable")
    return value


def make_reward(cfg: RewardConfig | None = None) -> Reward:
    """The reward a config names (default: the paper's)."""
    cfg = cfg or RewardConfig()
    if cfg.kind is RewardKind.EM_FORMAT:
        return EMFormatReward()
    if cfg.kind is RewardKind.F1:
        return F1Reward()
    return CheckedReward(fn=_load(cfg.fn), name=cfg.fn)


__all__ = [
    "CheckedReward",
    "EMFormatReward",
    "F1Reward",
    "Reward",
    "RewardConfig",
    "RewardKind",
    "make_reward",
]

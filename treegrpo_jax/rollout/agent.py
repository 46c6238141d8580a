"""The agent step: think → act → observe, as pieces any rollout driver composes.

A trajectory is a walk down one tree: it owns a cache slot and the id of the node it
continues from. A *step* is one model turn: decode until the row emits an action (stop
strings `</search>` / `</answer>`), EOS, its per-step token cap, or the context cap; then

  1. `end_step` parses it (first complete action tag) into a new tree node and says what
     comes next: a leaf, a search, or the invalid-action feedback;
  2. `observation_text` is what the environment answers (search results or feedback);
  3. `place_observation` checks it fits the slot, else the node becomes a (truncated) leaf.

The drivers — `scheduler.py` (continuous batching, the default) and `lockstep.py` (the
reference: every trajectory's step in one decode call) — differ only in when they call
these, so both grow the same trees.

Leaves: an answer; the forced final-answer step after the tool-call limit (whatever it
contains); a step that hit the context cap; a node whose observation no longer fits.
An invalid action gets the short feedback observation and the trajectory goes on.
Token ids are kept exactly as sampled and as observations were tokenized.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from treegrpo_jax.env.actions import Action, Answer, Invalid, InvalidReason, Search, parse_action
from treegrpo_jax.env.observation import ObservationConfig, format_observation
from treegrpo_jax.env.prompt import PromptConfig
from treegrpo_jax.env.retrieval import Retriever, SearchResult
from treegrpo_jax.env.reward_fn import EMFormatReward, Reward
from treegrpo_jax.env.rewards import evaluation_reward
from treegrpo_jax.rollout.tree import Node, StepKind, Tree
from treegrpo_jax.validation import check_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Limits of one trajectory (defaults near the paper's, docs/DESIGN.md §1; `configs/multihop.py`
    sets max_turns=4).

    Attributes:
      max_tool_calls: searches allowed on a path; then one forced final-answer step.
      max_turns: steps (searches and invalid ones) before the forced answer step, so a
        policy that never emits a valid action still ends.
      max_step_tokens: tokens generated per step at most.
      min_step_room: a node whose observation would leave less room than this in the
        context is a (truncated) leaf.
      top_k: passages per search.
      temperature, top_p, top_k_sampling: sampling knobs of rollouts (greedy for eval).
    """

    max_tool_calls: int = 3
    max_turns: int = 6
    max_step_tokens: int = 500
    min_step_room: int = 16
    top_k: int = 3
    temperature: float = 1.0
    top_p: float = 0.95
    top_k_sampling: int = 0

    def __post_init__(self):
        for name in (
            "max_tool_calls",
            "max_turns",
            "max_step_tokens",
            "top_k",
            "min_step_room",
            "top_k_sampling",
        ):
            least = 0 if name in ("max_tool_calls", "top_k_sampling") else 1
            check_int(f"AgentConfig.{name}", getattr(self, name), least)
        if self.max_turns < self.max_tool_calls:
            raise ValueError(
                f"AgentConfig.max_turns={self.max_turns} must be ≥ max_tool_calls={self.max_tool_calls}"
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"AgentConfig: temperature ≥ 0 and 0 < top_p ≤ 1 (got {self.temperature}, {self.top_p})"
            )


@dataclasses.dataclass
class PhaseTimes:
    """Wall seconds per phase of a rollout (cost accounting).

    `decode`, `append`, `fork` and `host` are spent on the driver's thread and add up to
    (nearly) the wall time. `retrieval` is the retriever's own time: on the lock-step
    driver the loop waits for all of it; on the scheduler it runs beside decoding, and
    only `retrieval_wait` — the driver idle because every live row waits on a search — is
    on the critical path.
    """

    decode: float = 0.0
    retrieval: float = 0.0
    retrieval_wait: float = 0.0
    append: float = 0.0
    fork: float = 0.0
    host: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentEnv:
    """Everything a step needs besides the engine: tokenizer, retriever, texts and the reward."""

    tokenizer: object  # treegrpo_jax.model.tokenizer.Tokenizer (encode/decode)
    retriever: Retriever
    prompt: PromptConfig = dataclasses.field(default_factory=PromptConfig)
    observation: ObservationConfig = dataclasses.field(default_factory=ObservationConfig)
    # Scores every leaf (`env.reward_fn`: the paper's EM-with-format by default, F1, or a callable).
    reward: Reward = dataclasses.field(default_factory=EMFormatReward)

    def encode_obs(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


@dataclasses.dataclass(kw_only=True)
class Trajectory:
    """An active walk: continues `tree` from `node_id` in cache `slot` with its own key."""

    tree: Tree
    node_id: int
    slot: int
    key: np.ndarray  # raw PRNG key words (`jax.random.key_data`): a batch's keys stack on the host
    golds: tuple[str, ...]


def _no_invalid_reasons() -> dict[str, int]:
    # Every reason present from the start: multi-host metric reductions need the same keys everywhere.
    return dict.fromkeys((r.value for r in InvalidReason), 0)


@dataclasses.dataclass
class LoopCounters:
    """What the steps did, and how hostile output was classified (all bounded, none fatal)."""

    tool_calls: int = 0
    invalid_steps: int = 0
    truncated_leaves: int = 0
    retrieval_errors: int = 0
    reprefill_tokens: int = 0  # what an engine that resubmits the whole context per turn prefills
    capped_steps: int = 0  # steps that ran into max_step_tokens without a stop string or EOS
    clipped_actions: int = 0  # queries / answers cut to the parser's length bounds
    undecodable_steps: int = 0  # steps whose tokens are not valid UTF-8 (decoded with U+FFFD)
    invalid_reasons: dict[str, int] = dataclasses.field(default_factory=_no_invalid_reasons)

    def add(self, other: LoopCounters) -> None:
        """Adds `other`'s counts to these (a scheduler keeps one per prompt until it is done)."""
        for f in dataclasses.fields(LoopCounters):  # only these (a `RolloutStats` has more)
            if f.name == "invalid_reasons":
                for reason, n in other.invalid_reasons.items():
                    self.invalid_reasons[reason] = self.invalid_reasons.get(reason, 0) + n
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def forced_next(node: Node, cfg: AgentConfig) -> bool:
    """Whether the step after `node` is the forced final-answer step."""
    return node.tool_calls >= cfg.max_tool_calls or node.depth >= cfg.max_turns


def _classify(counters: LoopCounters, action: Action, text: str, *, capped: bool) -> None:
    """Counts what a step's output was, whatever happens to the trajectory next."""
    counters.capped_steps += int(capped)
    counters.undecodable_steps += int("\ufffd" in text)
    counters.clipped_actions += int(isinstance(action, Search | Answer) and action.clipped)
    if isinstance(action, Invalid):
        counters.invalid_reasons[action.reason.value] += 1


def finish_leaf(tree: Tree, node: Node, golds: Sequence[str], reward: Reward) -> None:
    """Marks `node` a leaf and scores its path: `reward` for training, EM for evaluation."""
    node.is_leaf = True
    texts = [n.text for n in tree.path(node.node_id)]
    node.reward = reward(texts, golds)
    node.em = evaluation_reward(texts, golds)


class StepEnd(enum.StrEnum):
    """What follows a finished step."""

    LEAF = "leaf"  # an answer, the forced step, or a full context: the trajectory is done
    SEARCH = "search"  # `node.query` goes to the retriever; its result is the observation
    FEEDBACK = "feedback"  # no valid action: the invalid-action text is the observation


def step_budget(cfg: AgentConfig, generated: int, room: int) -> int:
    """Tokens a step may still generate: its cap less what it has (`generated`), and one
    position short of the slot's `room` (the last token stays pending); at least 1."""
    return max(1, min(cfg.max_step_tokens - generated, room - 1))


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """A finished step as the policy generated it, and how the generation ended."""

    tokens: list[int]  # generated ids
    logprobs: list[float]  # their sampler log-probs
    entropies: list[float]  # the sampler's entropy at each (the `entropy` branching rule reads them)
    hit_eos: bool = False
    hit_stop: bool = False
    hit_context: bool = False  # the slot is full (none of the three: the step's token cap)


def end_step(
    traj: Trajectory, step: StepOutput, *, room: int, env: AgentEnv, cfg: AgentConfig, counters: LoopCounters
) -> tuple[Node, StepEnd]:
    """Adds a finished step to the trajectory's tree as a new node; says what comes next.

    Args:
      traj: the trajectory (its `node_id` moves to the new node).
      step: what the step generated and how it ended.
      room: `Engine.room` of the trajectory's slot after the step.
      env, cfg, counters: the environment, limits and the counters to update.
    """
    tree, parent = traj.tree, traj.tree.nodes[traj.node_id]
    tokens, hit_context = step.tokens, step.hit_context
    text = env.tokenizer.decode(tokens)
    forced = forced_next(parent, cfg)
    action = parse_action(text, search_allowed=not forced)
    capped = len(tokens) >= cfg.max_step_tokens and not (step.hit_eos or step.hit_stop)
    _classify(counters, action, text, capped=capped)
    node = Node(
        node_id=len(tree.nodes),
        parent=parent.node_id,
        depth=parent.depth + 1,
        kind=StepKind.INVALID,
        tokens=list(tokens),
        logprobs=list(step.logprobs),
        entropies=list(step.entropies),
        text=text,
        tool_calls=parent.tool_calls,
    )
    tree.nodes.append(node)
    parent.children.append(node.node_id)
    traj.node_id = node.node_id
    if isinstance(action, Answer):
        node.kind, node.answer = StepKind.ANSWER, action.text
    elif hit_context or room <= cfg.min_step_room:
        node.kind = StepKind.TRUNCATED
        counters.truncated_leaves += 1
    elif forced:  # the forced final-answer step did not answer: a leaf all the same
        counters.invalid_steps += 1
    elif isinstance(action, Search):
        node.kind, node.query = StepKind.SEARCH, action.query
        node.tool_calls += 1
        counters.tool_calls += 1
        return node, StepEnd.SEARCH
    else:
        counters.invalid_steps += 1
        return node, StepEnd.FEEDBACK
    finish_leaf(tree, node, traj.golds, env.reward)
    return node, StepEnd.LEAF


def observation_text(
    env: AgentEnv, cfg: AgentConfig, node: Node, result: SearchResult | None, counters: LoopCounters
) -> str:
    """What the environment answers after `node`: its search result, or the feedback text."""
    if result is None:
        text = env.prompt.invalid_action
    else:
        counters.retrieval_errors += int(not result.ok)
        text = format_observation(result, tokenizer=env.tokenizer, cfg=env.observation)
    if forced_next(node, cfg):
        text += env.prompt.forced_answer
    return text


def place_observation(
    traj: Trajectory,
    node: Node,
    obs_tokens: list[int],
    room: int,
    env: AgentEnv,
    cfg: AgentConfig,
    counters: LoopCounters,
) -> bool:
    """Records the observation on `node` if it fits the slot (`room`); else `node` is a leaf.

    Returns whether the trajectory goes on (the caller then appends `obs_tokens`).
    """
    if len(obs_tokens) + cfg.min_step_room > room:
        counters.truncated_leaves += 1
        finish_leaf(traj.tree, node, traj.golds, env.reward)  # the observation does not fit
        return False
    node.obs_tokens = obs_tokens
    return True

"""The agent loop: think → act → observe, for many trajectories in one batch.

A trajectory is a walk down one tree: it owns a cache slot and the id of the node it
continues from. One *step* of the loop advances every active trajectory at once:

  1. one batched `Engine.decode` until each row emits an action (stop strings
     `</search>` / `</answer>`), EOS, its per-step token cap, or the context cap;
  2. parse each step (first complete action tag) into a new tree node;
  3. one batched retriever call for all searches of the step;
  4. tokenize each observation once and append all of them in one `Engine.append`.

Leaves: an answer; the forced final-answer step after the tool-call limit (whatever it
contains); a step that hit the context cap; a node whose observation no longer fits.
An invalid action gets the short feedback observation and the trajectory goes on.
Token ids are kept exactly as sampled and as observations were tokenized.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax

from treegrpo_jax.env.actions import Action, Answer, Invalid, InvalidReason, Search, parse_action
from treegrpo_jax.env.observation import ObservationConfig, format_observation
from treegrpo_jax.env.prompt import PromptConfig
from treegrpo_jax.env.retrieval import Retriever
from treegrpo_jax.env.rewards import evaluation_reward, score_trajectory
from treegrpo_jax.rollout.engine import Engine
from treegrpo_jax.rollout.sampling import SamplingParams
from treegrpo_jax.rollout.tree import Node, StepKind, Tree


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Limits of one trajectory (DESIGN.md §1 paper defaults).

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
            value, least = getattr(self, name), 0 if name in ("max_tool_calls", "top_k_sampling") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"AgentConfig.{name} must be an int ≥ {least}, got {value!r}")
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
    """Wall seconds per phase of the loop (cost accounting)."""

    decode: float = 0.0
    retrieval: float = 0.0
    append: float = 0.0
    fork: float = 0.0
    host: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentEnv:
    """Everything a step needs besides the engine: tokenizer, retriever and texts."""

    tokenizer: object  # treegrpo_jax.model.tokenizer.Tokenizer (encode/decode)
    retriever: Retriever
    prompt: PromptConfig = dataclasses.field(default_factory=PromptConfig)
    observation: ObservationConfig = dataclasses.field(default_factory=ObservationConfig)

    def encode_obs(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_bos=False)


@dataclasses.dataclass(kw_only=True)
class Trajectory:
    """An active walk: continues `tree` from `node_id` in cache `slot` with its own key."""

    tree: Tree
    node_id: int
    slot: int
    key: jax.Array
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


def _finish_leaf(tree: Tree, node: Node, golds: Sequence[str]) -> None:
    node.is_leaf = True
    texts = [n.text for n in tree.path(node.node_id)]
    node.reward = score_trajectory(texts, golds).reward
    node.em = evaluation_reward(texts, golds)


def advance(
    engine: Engine,
    env: AgentEnv,
    trajs: list[Trajectory],
    cfg: AgentConfig,
    *,
    greedy: bool = False,
    times: PhaseTimes | None = None,
    counters: LoopCounters | None = None,
) -> None:
    """Runs `trajs` until every one reaches a leaf; grows their trees in place.

    Slots are not freed: a finished trajectory's slot still holds its whole sequence, so
    later expansion rounds can fork from any node on its path.
    """
    times = times if times is not None else PhaseTimes()
    counters = counters if counters is not None else LoopCounters()
    tok = env.tokenizer
    active = list(trajs)
    while active:
        t0 = time.perf_counter()
        slots = [t.slot for t in active]
        budgets = [max(1, min(cfg.max_step_tokens, engine.room(s) - 1)) for s in slots]
        sampling = SamplingParams.make(
            len(active), temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k_sampling, greedy=greedy
        )
        keys = jax.numpy.stack([t.key for t in active])
        counters.reprefill_tokens += int(sum(engine.lengths[s] + 1 for s in slots))
        res = engine.decode(slots, max_new_tokens=budgets, sampling=sampling, keys=keys)
        t1 = time.perf_counter()
        times.decode += t1 - t0

        searches: list[tuple[Trajectory, Node, str]] = []
        feedback: list[tuple[Trajectory, Node]] = []
        still: list[Trajectory] = []
        for i, traj in enumerate(active):
            tokens, logprobs = res.row(i)
            tree, parent = traj.tree, traj.tree.nodes[traj.node_id]
            text = tok.decode(tokens)
            forced = forced_next(parent, cfg)
            action = parse_action(text, search_allowed=not forced)
            _classify(
                counters,
                action,
                text,
                capped=len(tokens) >= cfg.max_step_tokens and not (res.hit_eos[i] or res.hit_stop[i]),
            )
            node = Node(
                node_id=len(tree.nodes),
                parent=parent.node_id,
                depth=parent.depth + 1,
                kind=StepKind.INVALID,
                tokens=tokens,
                logprobs=logprobs,
                text=text,
                tool_calls=parent.tool_calls,
            )
            tree.nodes.append(node)
            parent.children.append(node.node_id)
            traj.node_id = node.node_id
            if isinstance(action, Answer):
                node.kind, node.answer = StepKind.ANSWER, action.text
                _finish_leaf(tree, node, traj.golds)
            elif res.hit_context[i] or engine.room(traj.slot) <= cfg.min_step_room:
                node.kind = StepKind.TRUNCATED
                counters.truncated_leaves += 1
                _finish_leaf(tree, node, traj.golds)
            elif forced:  # the forced final-answer step did not answer: a leaf all the same
                counters.invalid_steps += 1
                _finish_leaf(tree, node, traj.golds)
            elif isinstance(action, Search):
                node.kind, node.query = StepKind.SEARCH, action.query
                node.tool_calls += 1
                counters.tool_calls += 1
                searches.append((traj, node, action.query))
            else:
                counters.invalid_steps += 1
                feedback.append((traj, node))
        t2 = time.perf_counter()
        times.host += t2 - t1

        observations: dict[int, str] = {}
        if searches:
            results = env.retriever.search([q for _, _, q in searches], cfg.top_k)
            for (_, node, _), result in zip(searches, results, strict=True):
                counters.retrieval_errors += int(not result.ok)
                observations[id(node)] = format_observation(result, tokenizer=tok, cfg=env.observation)
        t3 = time.perf_counter()
        times.retrieval += t3 - t2

        writes: dict[int, list[int]] = {}
        for traj, node in [(t, n) for t, n, _ in searches] + feedback:
            text = observations.get(id(node), env.prompt.invalid_action)
            if forced_next(node, cfg):
                text += env.prompt.forced_answer
            obs_tokens = env.encode_obs(text)
            if len(obs_tokens) + cfg.min_step_room > engine.room(traj.slot):
                counters.truncated_leaves += 1
                _finish_leaf(traj.tree, node, traj.golds)  # the observation does not fit
                continue
            node.obs_tokens = obs_tokens
            writes[traj.slot] = obs_tokens
            still.append(traj)
        t4 = time.perf_counter()
        engine.append(writes)
        times.host += t4 - t3
        times.append += time.perf_counter() - t4
        active = still

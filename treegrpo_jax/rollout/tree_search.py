"""Initialize-then-expand tree search (DESIGN.md §1) on the rollout engine.

Legend: P prompts, M trees per prompt, N picks per tree per round, L rounds,
G = M·(1 + N·L) leaves per prompt.

For each prompt: M independent chains each start a tree; then L sequential rounds, each
picking N nodes per tree uniformly with replacement among the root and the non-leaf
nodes and continuing a new branch from the end of each (observation included; the
branch inherits the node's tool-call count). All prompts and branches of a phase run as
one batch. Prefix sharing is physical: the prompt is prefilled once per prompt and
forked to its M trees, and each branch starts by copying the cache rows of a slot whose
sequence passes through the picked node — nothing is re-prefilled.

Chain GRPO is N = 0 (or L = 0): M chains per prompt.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from treegrpo_jax.data.rows import QARow
from treegrpo_jax.rollout.agent import AgentConfig, AgentEnv, LoopCounters, PhaseTimes, Trajectory, advance
from treegrpo_jax.rollout.engine import Engine, OutOfSlotsError
from treegrpo_jax.rollout.tree import Node, StepKind, Tree


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeSearchConfig:
    """Tree shape. Leaves per prompt G = M·(1 + N·L)."""

    num_trees: int = 2  # M
    num_picks: int = 2  # N
    num_rounds: int = 1  # L

    def __post_init__(self):
        for name in ("num_trees", "num_picks", "num_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"TreeSearchConfig.{name} must be an int, got {value!r}")
        if self.num_trees < 1:
            raise ValueError(f"TreeSearchConfig.num_trees (M) must be ≥ 1, got {self.num_trees}")
        if self.num_picks < 0 or self.num_rounds < 0:
            raise ValueError(
                "TreeSearchConfig.num_picks (N) and num_rounds (L) must be ≥ 0, "
                f"got {self.num_picks}, {self.num_rounds}"
            )

    @property
    def leaves_per_prompt(self) -> int:
        return self.num_trees * (1 + self.num_picks * self.num_rounds)


@dataclasses.dataclass
class RolloutStats:
    """Cost accounting of one rollout call."""

    prompts: int = 0
    leaves: int = 0
    decoded_tokens: int = 0
    prefilled_tokens: int = 0  # prompts (once per prompt) + observations (once per node)
    forked_tokens: int = 0  # prefix tokens branches got by cache copy
    reprefill_tokens: int = 0  # an engine resubmitting the whole context every turn
    tool_calls: int = 0
    invalid_steps: int = 0
    truncated_leaves: int = 0
    retrieval_errors: int = 0
    capped_steps: int = 0
    clipped_actions: int = 0
    undecodable_steps: int = 0
    invalid_reasons: dict[str, int] = dataclasses.field(default_factory=dict)  # reason → steps
    times: PhaseTimes = dataclasses.field(default_factory=PhaseTimes)
    wall: float = 0.0

    def as_dict(self) -> dict[str, float]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("times", "invalid_reasons")}
        out.update({f"invalid_{k}": v for k, v in self.invalid_reasons.items()})
        out.update({f"time_{k}": v for k, v in dataclasses.asdict(self.times).items()})
        return out


@dataclasses.dataclass
class _TreeState:
    tree: Tree
    golds: tuple[str, ...]
    holder: dict[int, int]  # node id → a slot whose sequence passes through that node's end


def _branch_key(root: jax.Array, prompt_uid: int, tree_id: int, branch: int) -> jax.Array:
    # Every branch has its own stream (fold in its identity), so siblings from the same node
    # do not sample the same continuation.
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(root, prompt_uid), tree_id), branch)


def prompt_tokens(env: AgentEnv, question: str) -> list[int]:
    """The prompt ids: the rendered instruction, in the chat template when the tokenizer has one."""
    message = env.prompt.render(question)
    tok = env.tokenizer
    if getattr(tok, "has_chat_template", False):
        return tok.encode_chat([{"role": "user", "content": message}], add_generation_prompt=True)
    return tok.encode(message)


def rollout(
    engine: Engine,
    env: AgentEnv,
    rows: Sequence[QARow],
    search: TreeSearchConfig,
    agent: AgentConfig,
    *,
    key: jax.Array,
    prompt_uids: Sequence[int] | None = None,
    greedy: bool = False,
) -> tuple[list[Tree], RolloutStats]:
    """Grows M·(1+N·L)-leaf trees for every row; returns trees (prompt-major) and costs.

    Args:
      engine: the engine (its free slots bound how many prompts run at once).
      env: tokenizer, retriever and prompt texts.
      rows: the questions.
      search: the tree shape.
      agent: per-trajectory limits and sampling.
      key: the rollout key (fold in the step before calling).
      prompt_uids: stable ids for the rows (default 0..P-1); tree.prompt_id is the row index.
      greedy: greedy decoding (evaluation).
    """
    t_start = time.perf_counter()
    g = search.leaves_per_prompt
    if engine.num_free < g:
        raise OutOfSlotsError(
            f"one prompt needs {g} slots (M·(1+N·L)) but the engine has {engine.num_free} free; "
            f"raise rollout slots or shrink the tree"
        )
    uids = list(range(len(rows))) if prompt_uids is None else list(prompt_uids)
    stats = RolloutStats(prompts=len(rows))
    counters = LoopCounters()
    before = engine.reset_stats()
    trees: list[Tree] = []
    wave = max(1, engine.num_free // g)
    for start in range(0, len(rows), wave):
        idx = range(start, min(start + wave, len(rows)))
        wave_rows, wave_uids = [rows[i] for i in idx], [uids[i] for i in idx]
        trees += _rollout_wave(
            engine, env, wave_rows, list(idx), wave_uids, search, agent, key, greedy, stats.times, counters
        )
    es = engine.reset_stats()
    engine.stats = before
    stats.leaves = sum(len(t.leaves()) for t in trees)
    stats.decoded_tokens, stats.prefilled_tokens, stats.forked_tokens = (
        es.decoded_tokens,
        es.prefilled_tokens,
        es.forked_tokens,
    )
    stats.reprefill_tokens = counters.reprefill_tokens
    stats.tool_calls, stats.invalid_steps = counters.tool_calls, counters.invalid_steps
    stats.truncated_leaves, stats.retrieval_errors = counters.truncated_leaves, counters.retrieval_errors
    stats.capped_steps, stats.clipped_actions = counters.capped_steps, counters.clipped_actions
    stats.undecodable_steps, stats.invalid_reasons = counters.undecodable_steps, counters.invalid_reasons
    stats.wall = time.perf_counter() - t_start
    return trees, stats


def _rollout_wave(
    engine, env, rows, row_ids, uids, search, agent, key, greedy, times, counters
) -> list[Tree]:
    m = search.num_trees
    used: list[int] = []
    states: list[_TreeState] = []
    trajs: list[Trajectory] = []
    t0 = time.perf_counter()
    first_slots = engine.allocate(len(rows))
    used += first_slots
    prompts = {}
    for slot, row in zip(first_slots, rows, strict=True):
        prompts[slot] = prompt_tokens(env, row.question)
        if len(prompts[slot]) + agent.min_step_room > engine.max_len:
            raise ValueError(
                f"question {row.id!r}: prompt of {len(prompts[slot])} tokens does not fit the context"
            )
    engine.append(prompts)  # each prompt prefilled once …
    times.append += time.perf_counter() - t0
    t0 = time.perf_counter()
    others = engine.allocate(len(rows) * (m - 1))
    used += others
    src = [s for s in first_slots for _ in range(m - 1)]
    engine.fork(src, others)  # … and copied to its other trees
    times.fork += time.perf_counter() - t0
    for r, (row, row_id, uid) in enumerate(zip(rows, row_ids, uids, strict=True)):
        for tree_id in range(m):
            slot = first_slots[r] if tree_id == 0 else others[r * (m - 1) + tree_id - 1]
            tree = Tree(
                prompt_id=row_id,
                tree_id=tree_id,
                prompt_tokens=prompts[first_slots[r]],
                nodes=[Node(node_id=0, parent=-1, depth=0, kind=StepKind.ROOT)],
            )
            state = _TreeState(tree=tree, golds=tuple(row.golden_answers), holder={0: slot})
            states.append(state)
            trajs.append(
                Trajectory(
                    tree=tree, node_id=0, slot=slot, key=_branch_key(key, uid, tree_id, 0), golds=state.golds
                )
            )
    _advance_and_record(engine, env, trajs, agent, greedy, times, counters, states)

    for round_idx in range(search.num_rounds):
        if search.num_picks == 0:
            break
        picks: list[tuple[int, Node, int]] = []  # (tree state index, picked node, branch number)
        for s_idx, state in enumerate(states):
            candidates = state.tree.expandable()
            rng = np.random.default_rng([uids[s_idx // m], state.tree.tree_id, round_idx, 7])
            chosen = rng.integers(0, len(candidates), search.num_picks)
            # A branch's number depends only on its own tree (not on the batch it shares), so a
            # prompt samples the same tree alone, in any batch, or on any host.
            picks += [
                (s_idx, candidates[j], 1 + round_idx * search.num_picks + i) for i, j in enumerate(chosen)
            ]
        t0 = time.perf_counter()
        slots = engine.allocate(len(picks))
        used += slots
        engine.fork(
            [states[s_idx].holder[node.node_id] for s_idx, node, _ in picks],
            slots,
            prefix=[states[s_idx].tree.path_tokens(node.node_id)[0] for s_idx, node, _ in picks],
        )
        times.fork += time.perf_counter() - t0
        branch_trajs = []
        for (s_idx, node, branch), slot in zip(picks, slots, strict=True):
            tree = states[s_idx].tree
            key_n = _branch_key(key, uids[s_idx // m], tree.tree_id, branch)
            branch_trajs.append(
                Trajectory(tree=tree, node_id=node.node_id, slot=slot, key=key_n, golds=states[s_idx].golds)
            )
        _advance_and_record(engine, env, branch_trajs, agent, greedy, times, counters, states)
    engine.free(used)
    return [s.tree for s in states]


def _advance_and_record(engine, env, trajs, agent, greedy, times, counters, states) -> None:
    """Runs the trajectories to their leaves and records which slot holds each new node."""
    by_tree = {id(s.tree): s for s in states}
    advance(engine, env, trajs, agent, greedy=greedy, times=times, counters=counters)
    for traj in trajs:
        state = by_tree[id(traj.tree)]
        # Every node on the path from the start node down to the leaf lives in this slot.
        node_id = traj.node_id
        while node_id > 0 and node_id not in state.holder:
            state.holder[node_id] = traj.slot
            node_id = state.tree.nodes[node_id].parent

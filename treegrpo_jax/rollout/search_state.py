"""What both rollout drivers share: the tree shape, per-tree state, keys, picks and costs.

Legend: P prompts, M trees per prompt, N picks per tree per round, L rounds,
G = M·(1 + N·L) leaves per prompt.

Initialize-then-expand (the paper): for each prompt, M independent chains each start a
tree; then L rounds, each picking N nodes per tree with replacement among the root and the
non-leaf nodes (uniformly, or as `TreeSearchConfig.rule` weighs them: `branching.py`), and
continuing a new branch from the end of each
(observation included; the branch inherits the node's tool-call count). Prefix sharing
is physical: a prompt is prefilled once and forked to its M trees, and a branch starts
by copying the cache rows of a slot whose sequence passes through the picked node.
Chain GRPO is N = 0 (or L = 0): M chains per prompt.

Determinism: a tree depends only on the rollout key, its prompt's uid, its tree id and
the weights — not on the batch it shares or the order the driver runs things in. Branch
b's sampling stream is `fold_in(key, uid, tree, b)`; round r's picks draw from a
generator seeded by (key, uid, tree, r); node ids follow the lock-step order (step k of
every branch of a round before step k+1, branches in order), which `renumber_round`
restores for a driver that finishes the steps in another order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from treegrpo_jax.data.rows import QARow
from treegrpo_jax.env.prompt import prompt_ids
from treegrpo_jax.rollout import branching
from treegrpo_jax.rollout.agent import AgentConfig, AgentEnv, LoopCounters, PhaseTimes, Trajectory
from treegrpo_jax.rollout.engine import Engine, EngineStats, OutOfSlotsError
from treegrpo_jax.rollout.tree import Node, StepKind, Tree
from treegrpo_jax.validation import checks_itself


class RolloutCancelled(RuntimeError):
    """`should_stop` asked the rollout to stop (SIGTERM): nothing of it is kept."""


@checks_itself
@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeSearchConfig:
    """Tree shape (leaves per prompt G = M·(1+N·L)) and where branches start (`branching.py`)."""

    num_trees: int = 2  # M
    num_picks: int = 2  # N
    num_rounds: int = 1  # L
    rule: str = branching.UNIFORM  # uniform (the paper) | entropy | last | a registered rule
    rule_tokens: int = 8  # entropy: tokens after a node that its weight averages over
    rule_temperature: float = 0.5  # entropy: weights exp(H̄ / τ), in nats

    def __post_init__(self):
        branching.check_rule(self.rule)
        if (
            isinstance(self.rule_tokens, bool)
            or not isinstance(self.rule_tokens, int)
            or self.rule_tokens < 1
        ):
            raise ValueError(f"TreeSearchConfig.rule_tokens must be an int ≥ 1, got {self.rule_tokens!r}")
        t = self.rule_temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not t > 0 or not np.isfinite(t):
            raise ValueError(f"TreeSearchConfig.rule_temperature must be a number > 0, got {t!r}")
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

    @property
    def expansion_rounds(self) -> int:
        """Rounds that add branches (0 for chains)."""
        return self.num_rounds if self.num_picks else 0


@dataclasses.dataclass
class RolloutStats(LoopCounters):
    """Cost accounting of one rollout call: the loop's counters (`LoopCounters`: tool calls,
    invalid steps, truncated leaves, ... — defined there once), then the engine's and the trees'."""

    prompts: int = 0
    leaves: int = 0
    decoded_tokens: int = 0
    prefilled_tokens: int = 0  # prompts (once per prompt) + observations (once per node)
    forked_tokens: int = 0  # prefix tokens branches got by cache copy
    # Engine use: how full the decode batches were, and how much of what they computed was kept.
    slots: int = 0  # the pool
    decode_calls: int = 0
    decode_steps: int = 0
    append_calls: int = 0  # prefill calls (prompts, observations)
    fork_calls: int = 0
    row_steps: int = 0  # Σ rows computed per step (bucket padding and stopped rows included)
    occupancy: float = 0.0  # generated tokens per decode step / slots in the pool
    rows_in_flight: float = 0.0  # rows asked for per decode step (mean over steps)
    waste_fraction: float = 0.0  # 1 - generated tokens / row_steps
    # K/V memory: what the pool held at its peak against the tokens the trees actually hold.
    unique_tokens: int = 0  # Σ prompts once + every node's tokens and observation
    kv_peak_tokens: int = 0  # positions held at the peak (slots × max_len, or pages × page size)
    kv_peak_bytes: int = 0
    kv_peak_over_unique: float = 0.0  # 1.0: no position held that no tree needs
    cow_pages: int = 0  # partial pages copied at forks (paged)
    # Where branches started (a node's picks are its children beyond the first).
    picks: int = 0
    root_picks: int = 0  # branches from the prompt: a new chain, nothing shared
    pick_depth: float = 0.0  # mean depth of the picked nodes (root 0)
    preempted_prompts: int = 0  # prompts rerun for want of pages (same trees; time lost)
    page_truncated: int = 0  # walks ended because their prompt alone outgrew the pool
    times: PhaseTimes = dataclasses.field(default_factory=PhaseTimes)
    wall: float = 0.0

    def as_dict(self) -> dict[str, float]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("times", "invalid_reasons")}
        out.update({f"invalid_{k}": v for k, v in self.invalid_reasons.items()})
        out.update({f"time_{k}": v for k, v in dataclasses.asdict(self.times).items()})
        return out

    def fill(
        self,
        trees: Sequence[Tree],
        es: EngineStats,
        counters: LoopCounters,
        slots: int,
        kv_bytes_per_token: int = 0,
    ) -> None:
        """Totals from the trees, the engine's counters and the loop's counters."""
        self.leaves = sum(len(t.leaves()) for t in trees)
        self.decoded_tokens, self.prefilled_tokens = es.decoded_tokens, es.prefilled_tokens
        self.forked_tokens = es.forked_tokens
        self.slots, self.decode_calls, self.decode_steps = slots, es.decode_calls, es.decode_steps
        self.row_steps, self.append_calls, self.fork_calls = es.row_steps, es.append_calls, es.fork_calls
        self.occupancy = es.decoded_tokens / max(1, es.decode_steps * slots)
        self.waste_fraction = 1.0 - es.decoded_tokens / max(1, es.row_steps)
        self.rows_in_flight = es.live_row_steps / max(1, es.decode_steps)
        self.unique_tokens = unique_tokens(trees)
        depths = [n.depth for t in trees for n in t.nodes for _ in n.children[1:]]
        self.picks, self.root_picks = len(depths), depths.count(0)
        self.pick_depth = float(np.mean(depths)) if depths else 0.0
        self.kv_peak_tokens, self.cow_pages = es.kv_peak_tokens, es.cow_pages
        self.kv_peak_bytes = es.kv_peak_tokens * kv_bytes_per_token
        self.kv_peak_over_unique = es.kv_peak_tokens / max(1, self.unique_tokens)
        self.add(counters)  # the loop's counts (this object starts from zero)


def unique_tokens(trees: Sequence[Tree]) -> int:
    """Tokens a rollout's trees hold without repeats: each prompt once (its M trees share it),
    then every node's own tokens and observation (a node is unique to its tree)."""
    prompts = {t.prompt_id: len(t.prompt_tokens) for t in trees}
    nodes = sum(len(n.tokens) + len(n.obs_tokens) for t in trees for n in t.nodes[1:])
    return sum(prompts.values()) + nodes


@dataclasses.dataclass(kw_only=True)
class TreeState:
    """One tree in the making."""

    tree: Tree
    uid: int  # the prompt's stable id (keys and picks fold it in)
    golds: tuple[str, ...]
    holder: dict[int, int]  # node id → a slot whose sequence passes through that node's end


@dataclasses.dataclass(kw_only=True)
class RolloutContext:
    """Everything a driver needs besides the prompts: one object instead of ten arguments."""

    engine: Engine
    env: AgentEnv
    search: TreeSearchConfig
    agent: AgentConfig
    key: jax.Array
    greedy: bool = False
    times: PhaseTimes = dataclasses.field(default_factory=PhaseTimes)
    counters: LoopCounters = dataclasses.field(default_factory=LoopCounters)
    # Called between engine calls with the leaves finished so far, scored (a progress bar with
    # EM so far; a preempted prompt's leaves are dropped with it, so reruns count once).
    progress: Callable[[list[Node]], None] | None = None

    def report(self, trees: Iterable[Tree]) -> None:
        if self.progress is not None:
            self.progress([leaf for t in trees for leaf in t.leaves()])

    def __post_init__(self):
        typed = jax.dtypes.issubdtype(self.key.dtype, jax.dtypes.prng_key)
        self._root = np.asarray(jax.random.key_data(self.key) if typed else self.key, np.uint32)
        self._impl = str(jax.random.key_impl(self.key)) if typed else "threefry2x32"
        self._key_words = [int(w) for w in self._root.ravel()]

    def branch_keys(self, ids: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
        """Raw key words of branches (prompt uid, tree id, branch number), in one device call.

        Every branch has its own stream (fold in its identity), so siblings from the same
        node do not sample the same continuation.
        """
        n = len(ids)
        if not n:
            return []
        b = max(8, 1 << (n - 1).bit_length())  # a few shapes: a few compiles
        cols = np.zeros((3, b), np.int32)
        cols[:, :n] = np.asarray(ids, np.int32).reshape(n, 3).T
        return list(np.asarray(_fold_in3(self._root, *cols, impl=self._impl))[:n])

    def pick(self, state: TreeState, round_idx: int) -> list[tuple[Node, int]]:
        """Round `round_idx`'s picks of `state`'s tree (`pick_branches` under this rollout's key)."""
        return pick_branches(self.search, self._key_words, state, round_idx)


def pick_branches(
    search: TreeSearchConfig, key_words: Sequence[int], state: TreeState, round_idx: int
) -> list[tuple[Node, int]]:
    """Round `round_idx`'s N picks of `state`'s tree: (node to branch from, branch number).

    With replacement over the root and the non-leaf nodes, weighed by the branching rule
    (`branching.py`; uniform by default), from a generator seeded by the rollout key's words,
    the prompt, the tree and the round: a different run seed expands different nodes, and a
    tree picks the same alone, in any batch, on any host.
    """
    candidates = state.tree.expandable()
    rng = np.random.default_rng([*key_words, state.uid, state.tree.tree_id, round_idx])
    weights = branching.pick_weights(state.tree, candidates, search)
    if weights is None:  # the paper's rule, drawn as it always was
        chosen = rng.integers(0, len(candidates), search.num_picks)
    else:
        chosen = rng.choice(len(candidates), size=search.num_picks, replace=True, p=weights)
    first = 1 + round_idx * search.num_picks
    return [(candidates[j], first + i) for i, j in enumerate(chosen)]


@functools.partial(jax.jit, static_argnames="impl")
def _fold_in3(root, a, b, c, *, impl):
    key = jax.random.wrap_key_data(root, impl=impl)

    def one(x, y, z):
        return jax.random.key_data(jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, x), y), z))

    return jax.vmap(one)(a, b, c)


def prompt_tokens(env: AgentEnv, question: str) -> list[int]:
    """The prompt ids: the rendered instruction, in the chat template when the tokenizer has one,
    BOS once (`env.prompt.prompt_ids`, the path the cold-start demonstrations take too)."""
    return prompt_ids(env.prompt.render(question), env.tokenizer)


def check_pool(engine: Engine, search: TreeSearchConfig) -> None:
    """A prompt's whole tree must fit the pool (its slots are held until all its leaves are done)."""
    g = search.leaves_per_prompt
    if engine.num_free < g:
        raise OutOfSlotsError(
            f"one prompt needs {g} slots (M·(1+N·L)) but the engine has {engine.num_free} free; "
            f"raise rollout slots or shrink the tree"
        )


def start_trees(
    ctx: RolloutContext, rows: Sequence[QARow], row_ids: Sequence[int], uids: Sequence[int]
) -> tuple[list[TreeState], list[Trajectory], list[int]]:
    """Prefills each prompt once, forks it to its M trees; returns trees, first walks, slots taken.

    States and walks are prompt-major, then tree id.
    """
    engine, m = ctx.engine, ctx.search.num_trees
    first_slots = engine.allocate(len(rows))
    prompts = {}
    for slot, row in zip(first_slots, rows, strict=True):
        prompts[slot] = prompt_tokens(ctx.env, row.question)
        if len(prompts[slot]) + ctx.agent.min_step_room > engine.max_len:
            engine.free(first_slots)
            raise ValueError(
                f"question {row.id!r}: prompt of {len(prompts[slot])} tokens does not fit the context"
            )
    engine.append(prompts)  # each prompt prefilled once …
    others = engine.allocate(len(rows) * (m - 1))
    engine.fork([s for s in first_slots for _ in range(m - 1)], others)  # … and copied to its other trees
    states, trajs = [], []
    keys = iter(ctx.branch_keys([(uid, t, 0) for uid in uids for t in range(m)]))
    for r, (row, row_id, uid) in enumerate(zip(rows, row_ids, uids, strict=True)):
        for tree_id in range(m):
            slot = first_slots[r] if tree_id == 0 else others[r * (m - 1) + tree_id - 1]
            tree = Tree(
                prompt_id=row_id,
                tree_id=tree_id,
                prompt_tokens=prompts[first_slots[r]],
                nodes=[Node(node_id=0, parent=-1, depth=0, kind=StepKind.ROOT)],
            )
            state = TreeState(tree=tree, uid=uid, golds=tuple(row.golden_answers), holder={0: slot})
            states.append(state)
            trajs.append(Trajectory(tree=tree, node_id=0, slot=slot, key=next(keys), golds=state.golds))
    return states, trajs, first_slots + others


def fork_branches(
    ctx: RolloutContext, picks: Sequence[tuple[TreeState, list[tuple[Node, int]]]], slots: list[int]
) -> list[Trajectory]:
    """Starts one walk per pick (in order) in `slots`, each a cache copy of the node's path.

    Args:
      ctx: the rollout.
      picks: per tree, its (node, branch number) picks (`RolloutContext.pick`).
      slots: one allocated slot per pick, in the same order.
    """
    flat = [(state, node, branch) for state, tree_picks in picks for node, branch in tree_picks]
    ctx.engine.fork(
        [state.holder[node.node_id] for state, node, _ in flat],
        slots,
        prefix=[state.tree.path_tokens(node.node_id)[0] for state, node, _ in flat],
    )
    keys = ctx.branch_keys([(state.uid, state.tree.tree_id, branch) for state, _, branch in flat])
    return [
        Trajectory(tree=state.tree, node_id=node.node_id, slot=slot, key=key, golds=state.golds)
        for (state, node, _), slot, key in zip(flat, slots, keys, strict=True)
    ]


def record_holder(state: TreeState, traj: Trajectory) -> None:
    """After `traj` reached its leaf: its slot holds every node from its start down to the leaf."""
    node_id = traj.node_id
    while node_id > 0 and node_id not in state.holder:
        state.holder[node_id] = traj.slot
        node_id = state.tree.nodes[node_id].parent


def renumber_round(tree: Tree, first_new: int, order: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Gives the nodes made in one round (ids ≥ `first_new`) the lock-step order's ids.

    Args:
      tree: the tree, nodes appended in whatever order the driver finished the steps.
      first_new: the tree's node count when the round started.
      order: node id → (step of its walk in the round, the walk's branch index).

    Returns:
      old id → new id (identity for the older nodes).
    """
    new_ids = sorted(range(first_new, len(tree.nodes)), key=lambda i: order[i])
    remap = {old: first_new + k for k, old in enumerate(new_ids)}
    if all(old == new for old, new in remap.items()):
        return remap
    nodes = tree.nodes[:first_new] + [tree.nodes[i] for i in new_ids]
    for node in nodes:
        node.node_id = remap.get(node.node_id, node.node_id)
        node.parent = remap.get(node.parent, node.parent)
        node.children = sorted(remap.get(c, c) for c in node.children)
    tree.nodes[:] = nodes
    return remap

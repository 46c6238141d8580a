"""Packed trees: each tree's unique tokens once, depth-first, several trees per row.

Legend: n_mini mini-batches, n_micro micro-batches each, b rows per micro-batch, T tokens,
L leaves, N nodes, Q (leaf, node) ancestor pairs (L, N, Q padded).

A *unit* is normally one whole tree: its prompt, then depth-first every node's `tokens +
obs_tokens` followed by its children's subtrees (children in creation order). Per token:
  * `positions`: depth along its path (its index in that path's row of the paths layout);
  * `prev`: row index of the previous token on its path (-1 for the unit's first token);
  * `span_end`: end of the subtree of the token's node, which with `segment` (1, 2, ... per
    unit in its row, 0 on padding) gives the ancestor-only mask (`logprobs.tree_mask`);
  * `node`: the node's index in the step's node table (0 is a dummy for padding).
Per block of ATTENTION_BLOCK tokens, `key_blocks` lists the key blocks its queries may see
(−1: unused slot): the step attends only to those (`logprobs.tree_block_mask`), so a row of
T tokens costs about T × path length, not T², in attention.
A tree longer than T, or one whose leaves the mini-batch split
separates (`split_groups`), becomes several units, each the union of the paths of some of its
leaves; a prefix shared across units then appears once per unit — still exact, because a
token only sums over the leaves of its own unit.

Units are placed first-fit-decreasing into rows of T tokens, per mini-batch, and rows are dealt
round-robin to micro-batches (b = row_multiple · 2^k, as for paths). T is the length bucket
(at least the longest path) whose packing needs the fewest token slots: with few trees per
mini-batch, whole trees in long rows would leave most of the row_multiple rows empty, while
shorter rows split trees into units that fill them (`_fewest_slots`). Mini-batches hold
exactly the leaves the paths layout gives them (`batch.split_minibatches`), so both layouts
make the same updates.

Leaves keep `rows_from_trees` order in the leaf table (reward, ids, n_ℓ = model tokens on the
path, mini-batch); the pair table lists every (leaf, node on its path) — the root holds the
prompt, which is never trained, and is left out. The step turns these into per-token leaf
sums (`token_weights.tree_weights`). L, N and Q are padded to `multiple · 2^k` so a run
compiles its step for a handful of shapes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Bool, Float, Int

from treegrpo_jax._pytree import pytree_dataclass
from treegrpo_jax.parallel.rules import DEFAULT_RULES, Rules, logical_to_spec
from treegrpo_jax.rl.batch import BatchLayout, Rows, bucket_length, bucket_rows, split_minibatches
from treegrpo_jax.rollout.tree import Tree

_TABLE_MULTIPLE = 64  # leaf / node / pair tables are padded to 64 · 2^k entries
ATTENTION_BLOCK = 64  # tokens per query / key block of the block-sparse attention

_PER_TOKEN = ("tokens", "positions", "prev", "segment", "span_end", "node", "loss_mask", "sampler_logp")


@pytree_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedBatch:
    """A step's trees packed into rows `[n_mini, n_micro, b, T]`, with leaf, pair and node tables.

    Attributes:
      tokens / positions / prev / segment / span_end / node: see the module docstring.
      loss_mask: 1.0 on model-generated tokens, else 0.
      sampler_logp: the sampler's log-probs (for the sampler/trainer drift metric).
      reward / prompt_id / tree_id: per leaf, in `rows_from_trees` order.
      leaf_valid: False on padding leaves.
      leaf_tokens: model tokens on the leaf's root-to-leaf path (the seq-mean length n_ℓ).
      leaf_mini: the mini-batch that trains the leaf.
      pair_leaf / pair_node: (leaf, node) for every node on every leaf's path; padding pairs
        are (0, 0), and node 0 is read by no real token.
      node_parent: the node table (parent's index; -1 for roots and padding). Its length N sizes
        the step's segment sums; the parents document the tree for checks and analysis.
      node_leaves: per node, the leaves of its whole tree below it (the shared-prefix credit's
        n_t, `token_weights.Credit`; a unit's node counts the leaves of other units too).
      key_blocks: per row and query block, the key blocks its queries may see (see `key_blocks`).
    """

    tokens: Int[Rows, "... T"]
    positions: Int[Rows, "... T"]
    prev: Int[Rows, "... T"]
    segment: Int[Rows, "... T"]
    span_end: Int[Rows, "... T"]
    node: Int[Rows, "... T"]
    loss_mask: Float[Rows, "... T"]
    sampler_logp: Float[Rows, "... T"]
    reward: Float[Rows, " L"]
    prompt_id: Int[Rows, " L"]
    tree_id: Int[Rows, " L"]
    leaf_valid: Bool[Rows, " L"]
    leaf_tokens: Float[Rows, " L"]
    leaf_mini: Int[Rows, " L"]
    pair_leaf: Int[Rows, " Q"]
    pair_node: Int[Rows, " Q"]
    node_parent: Int[Rows, " N"]
    node_leaves: Float[Rows, " N"]
    key_blocks: Int[Rows, "... NQ J"]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[-1]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.tokens.shape[:-1]

    @property
    def num_nodes(self) -> int:
        return self.node_parent.shape[0]

    def replace(self, **changes) -> PackedBatch:
        return dataclasses.replace(self, **changes)

    @classmethod
    def shardings(cls, mesh: Mesh, rules: Rules = DEFAULT_RULES, *, row_dims: int = 3) -> PackedBatch:
        """Rows over the `batch` rule like `PathBatch`; the (small) tables replicated."""
        lead = (None,) * (row_dims - 1) + ("batch",)
        per_token = NamedSharding(mesh, logical_to_spec((*lead, "length"), rules))
        replicated = NamedSharding(mesh, PartitionSpec())
        fields = {f.name: replicated for f in dataclasses.fields(cls)}
        fields.update({name: per_token for name in _PER_TOKEN})
        fields["key_blocks"] = NamedSharding(mesh, logical_to_spec((*lead, None, None), rules))
        return cls(**fields)


@dataclasses.dataclass
class _Unit:
    """One unit laid out depth-first (unit-local indices)."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[bool] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    positions: list[int] = dataclasses.field(default_factory=list)
    prev: list[int] = dataclasses.field(default_factory=list)
    span_end: list[int] = dataclasses.field(default_factory=list)
    node: list[int] = dataclasses.field(default_factory=list)  # local node index (root 0)
    node_parent: list[int] = dataclasses.field(default_factory=list)  # local parent index (-1)
    node_leaves: list[int] = dataclasses.field(default_factory=list)  # leaves of the whole tree below
    pairs: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (global leaf, local node)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, tokens, logp, n_model: int, *, depth: int, last: int, local: int) -> int:
        """Appends a span (model tokens first) and returns the new last index on the path."""
        for k, tok in enumerate(tokens):
            self.prev.append(last if k == 0 else len(self.tokens) - 1)
            self.tokens.append(int(tok))
            self.loss_mask.append(k < n_model)
            self.logp.append(float(logp[k]) if k < n_model else 0.0)
            self.positions.append(depth + k)
            self.span_end.append(-1)  # set when the node's subtree is closed
            self.node.append(local)
        return len(self.tokens) - 1 if len(tokens) else last


def _path_ids(tree: Tree, node_id: int) -> list[int]:
    return [n.node_id for n in tree.path(node_id)]


def _span(tree: Tree, node_id: int) -> int:
    node = tree.nodes[node_id]
    return len(node.tokens) + len(node.obs_tokens)


def _layout_unit(tree: Tree, leaves: Sequence[tuple[int, int]]) -> _Unit:
    """The union of the paths of `leaves` ((global leaf index, leaf node id)), depth-first."""
    keep = {n for _, lid in leaves for n in _path_ids(tree, lid)}
    below = tree.leaves_below()
    unit = _Unit()
    unit.node_parent.append(-1)
    unit.node_leaves.append(below[0])
    last = unit.add(tree.prompt_tokens, [], 0, depth=0, last=-1, local=0)
    local_of = {0: 0}

    def visit(node_id: int, parent_local: int, depth: int, last: int) -> None:
        node = tree.nodes[node_id]
        if len(node.logprobs) != len(node.tokens):
            raise ValueError(
                f"node {node_id} of (prompt {tree.prompt_id}, tree {tree.tree_id}) has "
                f"{len(node.tokens)} tokens but {len(node.logprobs)} log-probs"
            )
        local_of[node_id] = local = len(unit.node_parent)
        unit.node_parent.append(parent_local)
        unit.node_leaves.append(below[node_id])
        start = len(unit)
        span = list(node.tokens) + list(node.obs_tokens)
        last = unit.add(span, node.logprobs, len(node.tokens), depth=depth, last=last, local=local)
        end_own = len(unit)
        for child in node.children:
            if child in keep:
                visit(child, local, depth + end_own - start, last)
        unit.span_end[start:end_own] = [len(unit)] * (end_own - start)

    for child in tree.root.children:
        if child in keep:
            visit(child, 0, len(tree.prompt_tokens), last)
    unit.span_end[: len(tree.prompt_tokens)] = [len(unit)] * len(tree.prompt_tokens)
    unit.pairs = [(g, local_of[n]) for g, lid in leaves for n in _path_ids(tree, lid)]
    return unit


def _preorder(tree: Tree) -> dict[int, int]:
    order, stack = {}, [0]
    while stack:
        node_id = stack.pop()
        order[node_id] = len(order)
        stack.extend(reversed(tree.nodes[node_id].children))
    return order


def _split_units(tree: Tree, leaves: list[tuple[int, int]], cap: int) -> list[list[tuple[int, int]]]:
    """Leaves of one tree in one mini-batch → groups whose union of paths fits in `cap` tokens.

    Leaves go in depth-first order, so a group holds neighbouring branches (most sharing).
    """
    order = _preorder(tree)
    groups, current, have, size = [], [], set(), len(tree.prompt_tokens)
    for g, lid in sorted(leaves, key=lambda x: order[x[1]]):
        path = _path_ids(tree, lid)
        add = sum(_span(tree, n) for n in path if n not in have)
        if current and size + add > cap:
            groups.append(current)
            current, have, size = [], set(), len(tree.prompt_tokens)
            add = sum(_span(tree, n) for n in path)
        current.append((g, lid))
        have.update(path)
        size += add
    groups.append(current)
    return groups


def _first_fit_decreasing(lengths: Sequence[int], cap: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for k, r in enumerate(room):
            if lengths[i] <= r:
                bins[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(cap - lengths[i])
    return bins


def _unit_length(tree: Tree, leaves: Sequence[tuple[int, int]]) -> int:
    """Tokens of the union of the paths of `leaves` (what `_layout_unit` would lay out)."""
    keep = {n for _, lid in leaves for n in _path_ids(tree, lid)}
    return len(tree.prompt_tokens) + sum(_span(tree, n) for n in keep)


def _fewest_slots(trees, by_tree_per_mini, lengths: Sequence[int], n_micro: int, row_multiple: int):
    """The row length T (of `lengths`) whose packing needs the fewest token slots n_micro · b · T.

    A longer T holds whole trees (no prefix repeated across units) but, with few trees per
    mini-batch, leaves rows empty (b is `row_multiple · 2^k`); a shorter T splits trees into more
    units that fill the rows. Ties go to the longer T (fewer repeated prefixes). Returns T, b,
    and per mini-batch its units (tree index, leaves) and their first-fit-decreasing bins.
    """
    best = None
    for t in sorted(lengths, reverse=True):
        groups_per_mini, bins_per_mini = [], []
        for by_tree in by_tree_per_mini:
            groups = [(i, group) for i, ls in by_tree.items() for group in _split_units(trees[i], ls, t)]
            sizes = [_unit_length(trees[i], group) for i, group in groups]
            groups_per_mini.append(groups)
            bins_per_mini.append(_first_fit_decreasing(sizes, t))
        b = bucket_rows(math.ceil(max(len(bins) for bins in bins_per_mini) / n_micro), row_multiple)
        if best is None or b * t < best[0] * best[1]:
            best = (b, t, groups_per_mini, bins_per_mini)
    b, t, groups_per_mini, bins_per_mini = best
    return t, b, groups_per_mini, bins_per_mini


def key_blocks(
    segment: np.ndarray, span_end: np.ndarray, block: int, *, slots: int | None = None
) -> np.ndarray:
    """Per row `[..., T]`, the key blocks each query block needs: `[..., T/block, J]`, -1 padded.

    Key j is seen by the queries [j, span_end[j]) of its tree, so key block m is needed by the
    query blocks m .. max over its tokens of (span_end − 1) // block: a contiguous range, no
    [T, T] mask. J (slots per query block) is rounded up to a multiple of NQ/8 (≤ 8 shapes),
    or is `slots` when given (a shape already compiled: `shapes.ShapeSet`).

    Raises:
      ValueError: `slots` is fewer than some query block needs, or more than T/block.
    """
    *lead, t = segment.shape
    nq = t // block
    seg = segment.reshape(-1, nq, block)
    last = np.where(seg > 0, (span_end.reshape(-1, nq, block) - 1) // block, -1).max(-1)  # [R, NK]
    q, m = np.arange(nq)[:, None], np.arange(nq)[None, :]
    need = (m <= q) & (q <= last[:, None, :])  # [R, NQ, NK]
    most = int(need.sum(-1).max())
    step = max(1, nq // 8)
    j = min(nq, max(1, -(-most // step) * step))
    if slots is not None:
        if not most <= slots <= nq:
            raise ValueError(f"key_blocks: {slots} slots per query block; the rows need {most} of {nq}")
        j = slots
    order = np.argsort(~need, axis=-1, kind="stable")[..., :j]  # needed blocks first, ascending
    listed = np.take_along_axis(need, order, axis=-1)
    return np.where(listed, order, -1).astype(np.int32).reshape(*lead, nq, j)


def build_packed_batch(trees: Sequence[Tree], layout: BatchLayout) -> PackedBatch:
    """Packs a step's trees into a NumPy `PackedBatch` of shape `[n_mini, n_micro, b, T]`.

    Args:
      trees: every tree of the RL step (leaves need rewards).
      layout: mini/micro split and bucket sizes (as for `batch.build_batch`).

    Returns:
      A PackedBatch of NumPy arrays (place it with `batch.shard_batch`).
    """
    leaves = []  # (tree index, leaf node id), in rows_from_trees order
    for i, tree in enumerate(trees):
        for leaf in tree.leaves():
            if leaf.reward is None:
                where = f"prompt {tree.prompt_id}, tree {tree.tree_id}"
                raise ValueError(f"leaf {leaf.node_id} of ({where}) has no reward")
            leaves.append((i, leaf.node_id))
    if not leaves:
        raise ValueError("build_packed_batch needs at least one leaf")
    n_leaf = len(leaves)
    path_len = np.zeros(n_leaf, np.int64)
    model_tokens = np.zeros(n_leaf, np.float32)
    for g, (i, lid) in enumerate(leaves):
        path = trees[i].path(lid)
        path_len[g] = len(trees[i].prompt_tokens) + sum(_span(trees[i], n.node_id) for n in path)
        model_tokens[g] = sum(len(n.tokens) for n in path)
    shortest = bucket_length(int(path_len.max()), layout.length_buckets)  # every path must fit

    minis = split_minibatches([trees[i].prompt_id for i, _ in leaves], layout)
    by_tree_per_mini: list[dict[int, list[tuple[int, int]]]] = []
    leaf_mini = np.zeros(n_leaf, np.int32)
    for k, members in enumerate(minis):
        by_tree: dict[int, list[tuple[int, int]]] = {}
        for g in members:
            by_tree.setdefault(leaves[g][0], []).append((g, leaves[g][1]))
            leaf_mini[g] = k
        by_tree_per_mini.append(by_tree)
    n_mini, n_micro = layout.num_minibatches, layout.num_microbatches
    t, b, groups_per_mini, bins_per_mini = _fewest_slots(
        trees,
        by_tree_per_mini,
        [c for c in layout.length_buckets if c >= shortest],
        n_micro,
        layout.row_multiple,
    )
    units_per_mini = [[_layout_unit(trees[i], group) for i, group in groups] for groups in groups_per_mini]

    shape = (n_mini, n_micro, b, t)
    out = {name: np.zeros(shape, np.int32) for name in ("tokens", "positions", "segment", "span_end", "node")}
    out["prev"] = np.full(shape, -1, np.int32)
    out["loss_mask"] = np.zeros(shape, np.float32)
    out["sampler_logp"] = np.zeros(shape, np.float32)
    node_parent, node_leaves, pairs = [-1], [1], []  # node 0: the padding dummy
    for k, (units, bins) in enumerate(zip(units_per_mini, bins_per_mini, strict=True)):
        for j, members in enumerate(bins):
            at = (k, j % n_micro, j // n_micro)
            offset = 0
            for seg, u in enumerate(members, start=1):
                unit, n = units[u], len(units[u])
                cols = slice(offset, offset + n)
                base = len(node_parent)  # the unit's local node 0 → global `base`
                out["tokens"][at][cols] = unit.tokens
                out["positions"][at][cols] = unit.positions
                prev = np.asarray(unit.prev)
                out["prev"][at][cols] = np.where(prev >= 0, prev + offset, -1)
                out["segment"][at][cols] = seg
                out["span_end"][at][cols] = np.asarray(unit.span_end) + offset
                out["node"][at][cols] = np.asarray(unit.node) + base
                out["loss_mask"][at][cols] = unit.loss_mask
                out["sampler_logp"][at][cols] = unit.logp
                node_parent += [p + base if p >= 0 else -1 for p in unit.node_parent]
                node_leaves += unit.node_leaves
                pairs += [(g, local + base) for g, local in unit.pairs if local > 0]  # root: never trained
                offset += n

    def table(values, dtype, fill):
        n = bucket_rows(len(values), _TABLE_MULTIPLE)
        arr = np.full(n, fill, dtype)
        arr[: len(values)] = values
        return arr

    pair_arr = np.asarray(pairs, np.int32).reshape(-1, 2)
    return PackedBatch(
        **out,
        key_blocks=key_blocks(out["segment"], out["span_end"], math.gcd(t, ATTENTION_BLOCK)),
        reward=table([trees[i].nodes[lid].reward for i, lid in leaves], np.float32, 0.0),
        prompt_id=table([trees[i].prompt_id for i, _ in leaves], np.int32, -1),
        tree_id=table([trees[i].tree_id for i, _ in leaves], np.int32, -1),
        leaf_valid=table([True] * n_leaf, bool, False),
        leaf_tokens=table(model_tokens, np.float32, 0.0),
        leaf_mini=table(leaf_mini, np.int32, 0),
        pair_leaf=table(pair_arr[:, 0], np.int32, 0),
        pair_node=table(pair_arr[:, 1], np.int32, 0),
        node_parent=table(node_parent, np.int32, -1),
        node_leaves=table(node_leaves, np.float32, 1.0),
    )

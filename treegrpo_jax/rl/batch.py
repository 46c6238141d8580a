"""Training rows: one row per root-to-leaf path, padded into fixed-shape buckets.

Legend: B rows, T tokens, P prompts, M trees, G leaves (= rows of a prompt);
n_mini mini-batches (optimizer updates per RL step), n_micro micro-batches per mini-batch
(gradient accumulation), b rows per micro-batch.

A path is `prompt + Σ_nodes (tokens + obs_tokens)` (see rollout.tree); its loss mask is 1
only on model-generated tokens. Everything is token-aligned: `loss_mask[b, t]` and
`sampler_logp[b, t]` describe `tokens[b, t]`, whose log-prob is predicted at position t-1.

`build_batch` lays a step's rows out as `[n_mini, n_micro, b, T]` (per-row fields
`[n_mini, n_micro, b]`). T is the smallest length bucket that holds the longest row and b
is rounded up to `row_multiple · 2^k`, so a run compiles its step for a handful of shapes.
The rows of one prompt stay in one mini-batch (verl's default ordering), unless
`split_groups` asks otherwise. Advantages are computed inside the jitted step over *all*
rows of the step, before any update (`rl.step_inputs.prepare` → `advantages.compute`), so
the split only decides which rows share an update.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Bool, Float, Int

from treegrpo_jax._pytree import pytree_dataclass
from treegrpo_jax.parallel.rules import DEFAULT_RULES, Rules, logical_to_spec
from treegrpo_jax.rollout.tree import Tree

# A step's arrays are built on the host (NumPy), then placed on the mesh (jax.Array); the
# batch types hold either.
Rows = np.ndarray | Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class PathRow:
    """One root-to-leaf path on the host (NumPy), before padding."""

    tokens: np.ndarray  # [n] int32
    loss_mask: np.ndarray  # [n] bool: model-generated tokens
    sampler_logp: np.ndarray  # [n] float32: the sampler's log-prob of each token (0 elsewhere)
    reward: float
    prompt_id: int
    tree_id: int
    # [n] float32: leaves of the tree whose path holds each token (1 on a chain; `rl.credit`).
    shared: np.ndarray | None = None

    def __post_init__(self):
        n = len(self.tokens)
        if self.shared is not None and len(self.shared) != n:
            raise ValueError(f"PathRow: shared ({len(self.shared)}) must have one entry per token ({n})")
        if len(self.loss_mask) != n or len(self.sampler_logp) != n:
            raise ValueError(
                f"PathRow: tokens ({n}), loss_mask ({len(self.loss_mask)}) and sampler_logp "
                f"({len(self.sampler_logp)}) must have the same length"
            )
        if n < 2:
            raise ValueError(f"PathRow.tokens needs at least 2 tokens (a prompt and a target), got {n}")
        if bool(np.asarray(self.loss_mask)[0]):
            raise ValueError("PathRow.loss_mask[0] must be 0: the first token has no prediction")


@pytree_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PathBatch:
    """Padded rows. Leading dims `...` are `[n_mini, n_micro, b]` or flat `[B]`.

    Attributes:
      tokens: token ids, 0 on padding.
      positions: RoPE positions (0..n-1 for every row: rows are left-aligned).
      valid: the token exists (attention validity; padding keys are hidden).
      loss_mask: 1.0 on model-generated tokens of real rows, else 0.
      sampler_logp: the sampler's log-probs (for the sampler/trainer drift metric).
      reward: the leaf's reward.
      prompt_id / tree_id: rows sharing (prompt_id, tree_id) are the leaves of one tree.
      row_valid: False on padding rows (they touch no statistic and no gradient).
      shared: per token, the leaves of its tree whose paths hold it (the shared-prefix credit's
        n_t, `token_weights.Credit`); 0 on padding.
      advantage: one per row, for analysis (`advantages.with_advantages`); the train step
        computes its own from the rewards and does not read this field.
    """

    tokens: Int[Rows, "... T"]
    positions: Int[Rows, "... T"]
    valid: Bool[Rows, "... T"]
    loss_mask: Float[Rows, "... T"]
    sampler_logp: Float[Rows, "... T"]
    reward: Float[Rows, "..."]
    prompt_id: Int[Rows, "..."]
    tree_id: Int[Rows, "..."]
    row_valid: Bool[Rows, "..."]
    advantage: Float[Rows, "..."]
    shared: Float[Rows, "... T"]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[-1]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.reward.shape

    def replace(self, **changes) -> PathBatch:
        return dataclasses.replace(self, **changes)

    def reshape_rows(self, *shape: int) -> PathBatch:
        """Same rows with leading dims `shape` (e.g. `(-1,)` to flatten `[n_mini, n_micro, b]`)."""
        t = self.seq_len

        def one(x):
            per_token = x.ndim == len(self.row_shape) + 1
            return x.reshape(*shape, t) if per_token else x.reshape(*shape)

        return jax.tree.map(one, self)

    @classmethod
    def shardings(cls, mesh: Mesh, rules: Rules = DEFAULT_RULES, *, row_dims: int = 3) -> PathBatch:
        """See `batch_shardings`."""
        return batch_shardings(mesh, rules, row_dims=row_dims)


class LayoutKind(enum.StrEnum):
    """How trees become training rows (config key `rl.layout`)."""

    PATHS = "paths"  # one row per root-to-leaf path: a shared prefix is computed once per leaf
    PACKED = "packed"  # each tree's unique tokens once (rl.packed): exact, and the default


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """How a step's rows are padded and split.

    Attributes:
      kind: "packed" (each tree's unique tokens once, `rl.packed`) or "paths" (one row per
        root-to-leaf path, `build_batch`). Both give the same loss and gradients.
      num_minibatches: optimizer updates per RL step (rows split by prompt).
      num_microbatches: gradient-accumulation chunks per mini-batch.
      length_buckets: allowed padded lengths T (ascending); a row longer than the last fails.
      row_multiple: rows per micro-batch are `row_multiple · 2^k` (make it a multiple of the
        mesh's data × fsdp size so rows shard evenly).
      split_groups: allow a prompt's rows to straddle mini-batches (off: groups stay whole).
      shape_waste: a step's batch is padded up to a shape the run has already compiled when
        that costs at most this factor in token slots (`shapes.ShapeSet`); 1 pads only the
        tables (free), so a new (rows, length) pair always compiles.
    """

    num_minibatches: int = 1
    num_microbatches: int = 1
    length_buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)
    row_multiple: int = 8
    split_groups: bool = False
    kind: LayoutKind | str = LayoutKind.PACKED  # a name is parsed in __post_init__
    shape_waste: float = 2.0

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", LayoutKind(self.kind))
        except ValueError:
            allowed = [k.value for k in LayoutKind]
            raise ValueError(f"BatchLayout.kind={self.kind!r}; allowed: {allowed}") from None
        for name in ("num_minibatches", "num_microbatches", "row_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BatchLayout.{name} must be a positive int, got {value!r}")
        buckets = tuple(int(b) for b in self.length_buckets)
        if not buckets or any(b < 2 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(
                f"BatchLayout.length_buckets must be strictly ascending ints ≥ 2, got {self.length_buckets}"
            )
        object.__setattr__(self, "length_buckets", buckets)
        if not (isinstance(self.shape_waste, int | float) and self.shape_waste >= 1.0):
            raise ValueError(f"BatchLayout.shape_waste must be a number ≥ 1, got {self.shape_waste!r}")


def rows_from_trees(trees: Iterable[Tree]) -> list[PathRow]:
    """One `PathRow` per leaf of every tree (reward from `leaf.reward`)."""
    rows = []
    for tree in trees:
        below = tree.leaves_below()
        for leaf, tokens, mask, logp in tree.leaf_paths():
            if leaf.reward is None:
                where = f"prompt {tree.prompt_id}, tree {tree.tree_id}"
                raise ValueError(f"leaf {leaf.node_id} of ({where}) has no reward")
            shared = [below[0]] * len(tree.prompt_tokens)
            for node in tree.path(leaf.node_id):
                shared += [below[node.node_id]] * (len(node.tokens) + len(node.obs_tokens))
            rows.append(
                PathRow(
                    tokens=np.asarray(tokens, np.int32),
                    loss_mask=np.asarray(mask, bool),
                    sampler_logp=np.asarray(logp, np.float32),
                    reward=float(leaf.reward),
                    prompt_id=tree.prompt_id,
                    tree_id=tree.tree_id,
                    shared=np.asarray(shared, np.float32),
                )
            )
    return rows


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket ≥ n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"a row of {n} tokens is longer than the largest length bucket {buckets[-1]}")


def bucket_rows(n: int, multiple: int) -> int:
    """Smallest `multiple · 2^k` ≥ n (powers of two keep the number of compiled shapes small)."""
    k = max(0, math.ceil(math.log2(max(1, math.ceil(n / multiple)))))
    return multiple * 2**k


def split_minibatches(prompt_ids: Sequence[int], layout: BatchLayout) -> list[list[int]]:
    """Leaf (= path row) indices of each mini-batch; whole prompt groups unless `split_groups`.

    Both layouts split with this one function, so a mini-batch holds the same leaves in each.
    """
    n_mini = layout.num_minibatches
    if layout.split_groups:
        return [part.tolist() for part in np.array_split(np.arange(len(prompt_ids)), n_mini)]
    groups: dict[int, list[int]] = {}
    for i, prompt_id in enumerate(prompt_ids):
        groups.setdefault(prompt_id, []).append(i)
    if len(groups) < n_mini:
        raise ValueError(
            f"{len(groups)} prompts cannot fill BatchLayout.num_minibatches={n_mini} without "
            f"splitting a prompt's group (set split_groups=True to allow it)"
        )
    parts = np.array_split(np.arange(len(groups)), n_mini)
    ordered = list(groups.values())
    return [[i for g in part for i in ordered[g]] for part in parts]


def build_batch(rows: Sequence[PathRow], layout: BatchLayout) -> PathBatch:
    """Pads and splits a step's rows into a NumPy `PathBatch` of shape `[n_mini, n_micro, b, T]`.

    Rows of a mini-batch are dealt round-robin to its micro-batches (balancing real rows
    and padding); padding rows have `row_valid=False`, zero masks and `prompt_id=-1`.

    Args:
      rows: every path of the RL step (all prompts).
      layout: mini/micro split and bucket sizes.

    Returns:
      A PathBatch of NumPy arrays (use `shard_batch` to place it on a mesh).
    """
    if not rows:
        raise ValueError("build_batch needs at least one row")
    t = bucket_length(max(len(r.tokens) for r in rows), layout.length_buckets)
    minis = split_minibatches([r.prompt_id for r in rows], layout)
    n_mini, n_micro = layout.num_minibatches, layout.num_microbatches
    b = bucket_rows(math.ceil(max(len(m) for m in minis) / n_micro), layout.row_multiple)
    shape = (n_mini, n_micro, b)
    tokens = np.zeros((*shape, t), np.int32)
    valid = np.zeros((*shape, t), bool)
    loss_mask = np.zeros((*shape, t), np.float32)
    sampler_logp = np.zeros((*shape, t), np.float32)
    shared = np.zeros((*shape, t), np.float32)
    reward = np.zeros(shape, np.float32)
    prompt_id = np.full(shape, -1, np.int32)
    tree_id = np.full(shape, -1, np.int32)
    row_valid = np.zeros(shape, bool)
    for k, members in enumerate(minis):
        for j, i in enumerate(members):
            at = (k, j % n_micro, j // n_micro)
            row, n = rows[i], len(rows[i].tokens)
            tokens[at][:n] = row.tokens
            valid[at][:n] = True
            loss_mask[at][:n] = row.loss_mask
            sampler_logp[at][:n] = row.sampler_logp
            shared[at][:n] = 1.0 if row.shared is None else row.shared
            reward[at], prompt_id[at], tree_id[at], row_valid[at] = (
                row.reward,
                row.prompt_id,
                row.tree_id,
                True,
            )
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape).copy()
    return PathBatch(
        tokens=tokens,
        positions=positions,
        valid=valid,
        loss_mask=loss_mask,
        sampler_logp=sampler_logp,
        reward=reward,
        prompt_id=prompt_id,
        tree_id=tree_id,
        row_valid=row_valid,
        advantage=np.zeros(shape, np.float32),
        shared=shared,
    )


def batch_shardings(mesh: Mesh, rules: Rules = DEFAULT_RULES, *, row_dims: int = 3) -> PathBatch:
    """A PathBatch of NamedShardings: rows over the `batch` rule (('data','fsdp')), the rest replicated.

    Args:
      mesh: the device mesh.
      rules: logical-axis rules.
      row_dims: leading row dims (3 for `[n_mini, n_micro, b]`, 1 for flat `[B]`); rows are
        split on the last of them.
    """
    lead = (None,) * (row_dims - 1) + ("batch",)
    per_token = NamedSharding(mesh, logical_to_spec((*lead, "length"), rules))
    per_row = NamedSharding(mesh, logical_to_spec(lead, rules))
    fields = {f.name: per_row for f in dataclasses.fields(PathBatch)}
    for name in ("tokens", "positions", "valid", "loss_mask", "sampler_logp", "shared"):
        fields[name] = per_token
    return PathBatch(**fields)


def shard_batch(batch, mesh: Mesh | None, rules: Rules = DEFAULT_RULES):
    """Places a host batch (a `PathBatch` or a `packed.PackedBatch`) on the mesh (rows split over
    data × fsdp); plain device_put without a mesh."""
    if mesh is None:
        return jax.device_put(batch)
    shardings = type(batch).shardings(mesh, rules, row_dims=len(batch.row_shape))
    spec = shardings.tokens.spec[:-1]  # the row dims of a per-token field
    split = spec[-1] if len(spec) else None
    if split is not None:
        axes = (split,) if isinstance(split, str) else split
        n = math.prod(mesh.shape[a] for a in axes)
        if batch.row_shape[-1] % n:
            raise ValueError(
                f"rows per micro-batch ({batch.row_shape[-1]}) must be a multiple of the mesh's {axes} "
                f"size {n}: set BatchLayout.row_multiple to a multiple of {n}"
            )
    return jax.device_put(batch, shardings)

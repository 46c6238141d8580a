"""A run's batch shapes: pad a step's batch up to a shape already compiled, not compile another.

Every new batch shape recompiles the train step (seconds on a CPU for the tiny model, minutes for
a 3B model on a TPU). Length buckets and `row_multiple · 2^k` rows keep each dimension to a few
values, but the dimensions move independently — rows b, length T, and for packed trees the leaf,
pair and node tables and the key-block slots J — so a run still meets a new combination every few
steps. `ShapeSet` remembers the shapes this run has compiled and pads a batch up to the cheapest
one that holds it, as long as that costs at most `max_waste` × the batch's own token slots (and
at most `max_waste` × its key-block slots); otherwise the batch keeps its shape and that shape
joins the set. Padding is inert: padding rows, columns and table entries are exactly what the
builders already put after real data (`batch.build_batch`, `packed.build_packed_batch`), so the
loss and gradients are those of the unpadded batch up to float summation order (tested).

Legend: b rows per micro-batch, T tokens, L leaves, Q (leaf, node) pairs, N nodes, J key-block
slots per query block.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from treegrpo_jax.rl.batch import PathBatch
from treegrpo_jax.rl.packed import ATTENTION_BLOCK, PackedBatch, key_blocks

# Fill values after real data, per field (0 elsewhere): what the builders write on padding.
_PATH_FILL = {"prompt_id": -1, "tree_id": -1}
_PACKED_FILL = {"prev": -1, "prompt_id": -1, "tree_id": -1, "node_parent": -1, "node_leaves": 1.0}
_PACKED_TABLES = {
    "L": ("reward", "prompt_id", "tree_id", "leaf_valid", "leaf_tokens", "leaf_mini"),
    "Q": ("pair_leaf", "pair_node"),
    "N": ("node_parent", "node_leaves"),
}


@dataclasses.dataclass(frozen=True, order=True)
class BatchShape:
    """The dimensions that decide a compiled train step (tables 0 for path rows)."""

    b: int
    t: int
    leaves: int = 0
    pairs: int = 0
    nodes: int = 0
    key_slots: int = 0

    @property
    def slots(self) -> int:
        """Token slots per micro-batch: what the update's cost scales with."""
        return self.b * self.t

    def holds(self, other: BatchShape) -> bool:
        return all(getattr(self, f.name) >= getattr(other, f.name) for f in dataclasses.fields(self))


def shape_of(batch: PathBatch | PackedBatch) -> BatchShape:
    """The `BatchShape` of a `[n_mini, n_micro, b, T]` batch."""
    b, t = batch.tokens.shape[-2:]
    if isinstance(batch, PathBatch):
        return BatchShape(b=b, t=t)
    return BatchShape(
        b=b,
        t=t,
        leaves=batch.reward.shape[0],
        pairs=batch.pair_leaf.shape[0],
        nodes=batch.node_parent.shape[0],
        key_slots=batch.key_blocks.shape[-1],
    )


def _pad(x: np.ndarray, widths: list[int], fill) -> np.ndarray:
    x = np.asarray(x)
    return np.pad(x, [(0, w) for w in widths], constant_values=fill)


def pad_path_batch(batch: PathBatch, b: int, t: int) -> PathBatch:
    """Pads a host `PathBatch` `[n_mini, n_micro, b0, T0]` to `b` rows and `t` tokens (inert rows)."""
    *lead, b0 = batch.row_shape
    t0 = batch.seq_len
    if b < b0 or t < t0:
        raise ValueError(f"cannot pad a batch of {b0} rows × {t0} tokens down to {b} × {t}")
    if (b, t) == (b0, t0):
        return batch

    def pad(name: str, x):
        widths = [0] * len(lead) + [b - b0] + ([t - t0] if np.ndim(x) == len(lead) + 2 else [])
        return _pad(x, widths, _PATH_FILL.get(name, 0))

    out = {f.name: pad(f.name, getattr(batch, f.name)) for f in dataclasses.fields(PathBatch)}
    out["positions"] = np.broadcast_to(np.arange(t, dtype=np.int32), out["tokens"].shape).copy()
    return PathBatch(**out)


def pad_packed_batch(batch: PackedBatch, shape: BatchShape) -> PackedBatch:
    """Pads a host `PackedBatch` to `shape` (rows, length, tables, key-block slots).

    Raises:
      ValueError: `shape` is smaller than the batch in some dimension, or its key-block slots
        cannot list the blocks the padded rows need.
    """
    have = shape_of(batch)
    if not shape.holds(have):
        raise ValueError(f"cannot pad a packed batch of shape {have} to {shape}")
    *lead, b0, t0 = batch.tokens.shape
    fields = {}
    for f in dataclasses.fields(PackedBatch):
        x = getattr(batch, f.name)
        if np.ndim(x) == len(lead) + 2 and f.name != "key_blocks":  # per token [..., b, T]
            x = _pad(x, [0] * len(lead) + [shape.b - b0, shape.t - t0], _PACKED_FILL.get(f.name, 0))
        fields[f.name] = x
    for dim, names in _PACKED_TABLES.items():
        size = {"L": shape.leaves, "Q": shape.pairs, "N": shape.nodes}[dim]
        for name in names:
            x = np.asarray(fields[name])
            fields[name] = _pad(x, [size - x.shape[0]], _PACKED_FILL.get(name, 0))
    # The query/key blocks change with T: list them again, in exactly `shape.key_slots` slots.
    block = math.gcd(shape.t, ATTENTION_BLOCK)
    fields["key_blocks"] = key_blocks(fields["segment"], fields["span_end"], block, slots=shape.key_slots)
    return PackedBatch(**fields)


def pad_to(batch: PathBatch | PackedBatch, shape: BatchShape) -> PathBatch | PackedBatch:
    """`batch` padded to `shape` (host NumPy arrays in, host arrays out)."""
    if isinstance(batch, PathBatch):
        return pad_path_batch(batch, shape.b, shape.t)
    return pad_packed_batch(batch, shape)


class ShapeSet:
    """The batch shapes a run has compiled its step for; `fit` reuses one when it is cheap enough.

    Every process of a multi-process run sees the same global shapes in the same order, so
    their sets stay equal and they pad alike.
    """

    def __init__(self, max_waste: float = 2.0):
        if not max_waste >= 1.0:
            raise ValueError(f"ShapeSet.max_waste must be ≥ 1 (a factor on token slots), got {max_waste!r}")
        self.max_waste = max_waste
        self.shapes: list[BatchShape] = []

    def get_state(self) -> list[list[int]]:
        """The shapes in the order they joined (JSON for a checkpoint)."""
        return [list(dataclasses.astuple(s)) for s in self.shapes]

    def set_state(self, state: list[list[int]]) -> None:
        self.shapes = [BatchShape(*map(int, s)) for s in state]

    def fit(self, batch: PathBatch | PackedBatch) -> PathBatch | PackedBatch:
        """`batch` padded to the cheapest known shape that holds it within `max_waste`, or as it is
        (its shape then joins the set)."""
        need = shape_of(batch)
        for shape in sorted(self.shapes, key=lambda s: (s.slots, s.key_slots, s)):
            if not shape.holds(need) or shape.slots > self.max_waste * need.slots:
                continue
            if need.key_slots and shape.key_slots > self.max_waste * need.key_slots:
                continue
            try:
                return pad_to(batch, shape)
            except ValueError:  # its key-block slots cannot list the padded rows' blocks
                continue
        self.shapes.append(need)
        return batch


_DTYPES = {"Int": np.int32, "Float": np.float32, "Bool": np.bool_}


def abstract_batch(
    batch_type: type[PathBatch] | type[PackedBatch], lead: tuple[int, ...], shape: BatchShape
) -> PathBatch | PackedBatch:
    """A batch of `jax.ShapeDtypeStruct`s: `lead` (`[n_mini, n_micro]`) rows of `shape`, for a
    compile that allocates nothing. Each field's dtype and dimensions are read from its annotation
    (`Int[Rows, "... T"]`: int32, `[*lead, b, T]`), so the result has exactly the shapes
    `pad_to` gives a real batch (tested against it)."""
    import jax  # noqa: PLC0415  (the host-side padding above needs none of JAX)

    sizes = {
        "T": shape.t,
        "L": shape.leaves,
        "Q": shape.pairs,
        "N": shape.nodes,
        "NQ": shape.t // math.gcd(shape.t, ATTENTION_BLOCK),
        "J": shape.key_slots,
    }
    fields = {}
    for f in dataclasses.fields(batch_type):
        kind, _, dims = str(f.type).partition("[")
        dims = dims.split(",", 1)[1].strip(" \"']").split()
        out = []
        for d in dims:
            out += [*lead, shape.b] if d == "..." else [sizes[d]]
        fields[f.name] = jax.ShapeDtypeStruct(tuple(out), _DTYPES[kind])
    # Set field by field: the class's own __init__ may be checked for arrays (the test suite's
    # shape checker), and these are descriptions of arrays, not arrays.
    batch = object.__new__(batch_type)
    for name, value in fields.items():
        object.__setattr__(batch, name, value)
    return batch

"""The two batch layouts behind one call: trees → the step's batch, as `BatchLayout.kind` says.

  * `paths`: one row per root-to-leaf path (`batch.build_batch`); a node shared by c leaves
    is forwarded and back-propagated c times;
  * `packed`: each tree's unique tokens once (`packed.build_packed_batch`), with per-token
    leaf sums that make the loss and its gradient equal to the paths layout's.

The train step accepts either batch (`step_inputs.prepare` dispatches on its type).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jax.sharding import Mesh

from treegrpo_jax.parallel.rules import DEFAULT_RULES, Rules
from treegrpo_jax.rl.batch import BatchLayout, LayoutKind, PathBatch, build_batch, rows_from_trees
from treegrpo_jax.rl.packed import PackedBatch, build_packed_batch
from treegrpo_jax.rollout.tree import Tree

StepBatch = PathBatch | PackedBatch

BATCH_TYPES: dict[LayoutKind, type] = {LayoutKind.PATHS: PathBatch, LayoutKind.PACKED: PackedBatch}

_BUILDERS: dict[LayoutKind, Callable[[Sequence[Tree], BatchLayout], StepBatch]] = {
    LayoutKind.PATHS: lambda trees, layout: build_batch(rows_from_trees(trees), layout),
    LayoutKind.PACKED: build_packed_batch,
}


def batch_from_trees(trees: Sequence[Tree], layout: BatchLayout) -> StepBatch:
    """The step's host (NumPy) batch in `layout.kind`; place it with `batch.shard_batch`."""
    return _BUILDERS[layout.kind](trees, layout)


def step_batch_shardings(kind: LayoutKind | str, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> StepBatch:
    """The NamedShardings of a `[n_mini, n_micro, b, T]` batch of that kind (for jit in_shardings)."""
    return BATCH_TYPES[LayoutKind(kind)].shardings(mesh, rules)

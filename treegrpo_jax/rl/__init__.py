"""RL core: trees → padded rows (paths or packed trees); tree advantages; clipped loss; the jitted step.

Typical use by the trainer:

    batch = shard_batch(batch_from_trees(trees, layout), mesh)  # [n_mini, n_micro, b, T]
    state, shardings = create_train_state(model, optim_cfg, mesh=mesh)
    step = jit_train_step(shardings, loss_cfg=loss_cfg, optim_cfg=optim_cfg, mesh=mesh,
                          layout_kind=layout.kind)
    state, metrics = step(state, batch, ref_params)  # advantages computed inside, over all leaves

`layout.kind` is "packed" (each tree's unique tokens once; the default) or "paths" (one row per
root-to-leaf path, `build_batch(rows_from_trees(trees), layout)`): same loss, same gradients.

Cold-start SFT is the same step with `sft_loss_config()`.
"""

from treegrpo_jax.rl import advantages
from treegrpo_jax.rl.advantages import Estimator, with_advantages
from treegrpo_jax.rl.batch import (
    BatchLayout,
    LayoutKind,
    PathBatch,
    PathRow,
    batch_shardings,
    bucket_length,
    bucket_rows,
    build_batch,
    rows_from_trees,
    shard_batch,
    split_minibatches,
)
from treegrpo_jax.rl.layouts import batch_from_trees, step_batch_shardings
from treegrpo_jax.rl.logprobs import token_logprobs, tree_mask, tree_token_logprobs
from treegrpo_jax.rl.loss import Aggregation, LossAux, LossConfig, LossMode, policy_loss
from treegrpo_jax.rl.optim import DecaySchedule, OptimConfig, learning_rate, make_optimizer
from treegrpo_jax.rl.packed import PackedBatch, build_packed_batch
from treegrpo_jax.rl.sft import demonstration_row, sft_loss_config
from treegrpo_jax.rl.token_weights import TokenWeights, row_weights, tree_weights
from treegrpo_jax.rl.train_state import TrainState, create_train_state
from treegrpo_jax.rl.train_step import jit_train_step, train_step

__all__ = [
    "Aggregation",
    "BatchLayout",
    "DecaySchedule",
    "Estimator",
    "LossAux",
    "LossConfig",
    "LayoutKind",
    "LossMode",
    "OptimConfig",
    "PackedBatch",
    "PathBatch",
    "PathRow",
    "TokenWeights",
    "TrainState",
    "advantages",
    "batch_from_trees",
    "batch_shardings",
    "bucket_length",
    "bucket_rows",
    "build_batch",
    "build_packed_batch",
    "create_train_state",
    "demonstration_row",
    "jit_train_step",
    "learning_rate",
    "make_optimizer",
    "policy_loss",
    "row_weights",
    "rows_from_trees",
    "shard_batch",
    "sft_loss_config",
    "split_minibatches",
    "step_batch_shardings",
    "token_logprobs",
    "train_step",
    "tree_mask",
    "tree_token_logprobs",
    "tree_weights",
    "with_advantages",
]

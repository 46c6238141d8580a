"""RL core: trees → padded path rows; tree advantages; clipped loss; the jitted sharded step.

Typical use by the trainer:

    rows = rows_from_trees(trees)                         # one row per root-to-leaf path
    batch = shard_batch(build_batch(rows, layout), mesh)  # [n_mini, n_micro, b, T]
    state, shardings = create_train_state(model, optim_cfg, mesh=mesh)
    step = jit_train_step(shardings, loss_cfg=loss_cfg, optim_cfg=optim_cfg, mesh=mesh)
    state, metrics = step(state, batch, ref_params)       # advantages computed inside, over all rows

Cold-start SFT is the same step with `sft_loss_config()`.
"""

from treegrpo_jax.rl import advantages
from treegrpo_jax.rl.advantages import Estimator, with_advantages
from treegrpo_jax.rl.batch import (
    BatchLayout,
    PathBatch,
    PathRow,
    batch_shardings,
    bucket_length,
    bucket_rows,
    build_batch,
    rows_from_trees,
    shard_batch,
)
from treegrpo_jax.rl.logprobs import token_logprobs
from treegrpo_jax.rl.loss import Aggregation, LossAux, LossConfig, LossMode, policy_loss
from treegrpo_jax.rl.optim import DecaySchedule, OptimConfig, learning_rate, make_optimizer
from treegrpo_jax.rl.sft import demonstration_row, sft_loss_config
from treegrpo_jax.rl.train_state import TrainState, create_train_state
from treegrpo_jax.rl.train_step import jit_train_step, train_step

__all__ = [
    "Aggregation",
    "BatchLayout",
    "DecaySchedule",
    "Estimator",
    "LossAux",
    "LossConfig",
    "LossMode",
    "OptimConfig",
    "PathBatch",
    "PathRow",
    "TrainState",
    "advantages",
    "batch_shardings",
    "bucket_length",
    "bucket_rows",
    "build_batch",
    "create_train_state",
    "demonstration_row",
    "jit_train_step",
    "learning_rate",
    "make_optimizer",
    "policy_loss",
    "rows_from_trees",
    "shard_batch",
    "sft_loss_config",
    "token_logprobs",
    "train_step",
    "with_advantages",
]

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

from treegrpo_jax._exports import lazy_exports

_EXPORTS = {
    "Estimator": "advantages",
    "advantages": "",  # the module
    "with_advantages": "advantages",
    "BatchLayout": "batch",
    "LayoutKind": "batch",
    "PathBatch": "batch",
    "PathRow": "batch",
    "batch_shardings": "batch",
    "bucket_length": "batch",
    "bucket_rows": "batch",
    "build_batch": "batch",
    "rows_from_trees": "batch",
    "shard_batch": "batch",
    "split_minibatches": "batch",
    "batch_from_trees": "layouts",
    "step_batch_shardings": "layouts",
    "token_logprobs": "logprobs",
    "tree_mask": "logprobs",
    "tree_token_logprobs": "logprobs",
    "Aggregation": "loss",
    "Credit": "token_weights",
    "LossAux": "loss",
    "LossConfig": "loss",
    "LossMode": "loss",
    "policy_loss": "loss",
    "DecaySchedule": "optim",
    "OptimConfig": "optim",
    "learning_rate": "optim",
    "make_optimizer": "optim",
    "PackedBatch": "packed",
    "build_packed_batch": "packed",
    "demonstration_row": "sft",
    "sft_loss_config": "sft",
    "TokenWeights": "token_weights",
    "row_weights": "token_weights",
    "tree_weights": "token_weights",
    "TrainState": "train_state",
    "create_train_state": "train_state",
    "jit_train_step": "train_step",
    "train_step": "train_step",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

# `train_step` is both a module and its function. Importing the module binds the *module* as this
# package's attribute (the import system does, whatever `__getattr__` says), so bind the function
# now, as the eager `__init__` did (train_step pulls in no tokenizer or weight reader).
from treegrpo_jax.rl.train_step import train_step  # noqa: E402, F401

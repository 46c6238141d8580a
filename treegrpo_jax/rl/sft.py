"""Cold-start SFT on demonstrations, through the RL step's own code path.

SFT is `LossMode.SFT` of the same loss and the same jitted `train_step`: advantage 1
per row, loss −logp on model tokens (token-mean by default), no ratio, no old or
reference forward passes, no KL, no entropy bonus. Demonstrations are rows like any
other: a scripted trajectory is `prompt + Σ (model span + observation)` with the loss
mask on the model spans, so a hand-built `Tree` with one leaf, or `demonstration_row`
straight from token spans, gives the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jaxtyping import Int

from treegrpo_jax.rl.batch import PathRow
from treegrpo_jax.rl.loss import Aggregation, LossConfig, LossMode


def sft_loss_config(aggregation: Aggregation | str = Aggregation.TOKEN_MEAN) -> LossConfig:
    """The LossConfig of cold-start SFT (NLL; the RL-only terms are off)."""
    return LossConfig(mode=LossMode.SFT, kl_coef=0.0, entropy_coef=0.0, aggregation=aggregation)


def demonstration_row(
    spans: Sequence[tuple[Sequence[int] | Int[np.ndarray, " _n"], bool]], *, prompt_id: int, tree_id: int = 0
) -> PathRow:
    """A PathRow from consecutive token spans, each flagged as model-generated (trained) or not.

    Args:
      spans: `(tokens, is_model)` pieces in order: the prompt (False), then model spans (True)
        and observations (False).
      prompt_id: an id unique per demonstration (SFT has no groups; ids only label rows).
      tree_id: optional label.

    Returns:
      A `batch.PathRow` with reward 1 and zero sampler log-probs.
    """
    tokens = np.concatenate([np.asarray(t, np.int32) for t, _ in spans])
    mask = np.concatenate([np.full(len(t), bool(m)) for t, m in spans])
    return PathRow(
        tokens=tokens,
        loss_mask=mask,
        sampler_logp=np.zeros(len(tokens), np.float32),
        reward=1.0,
        prompt_id=prompt_id,
        tree_id=tree_id,
    )

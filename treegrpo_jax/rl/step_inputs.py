"""What the train step consumes, from either layout: token rows with leaf sums, and normalisers.

Legend: n_mini mini-batches, n_micro micro-batches each, b rows per micro-batch, T tokens,
L leaves.

`prepare(batch, cfg)` runs inside the jitted step. It computes every leaf's advantage over
ALL leaves of the step (groups = trees / prompts), turns them into per-token leaf sums
(`token_weights`), and gives every row the attention layout of `logprobs.tree_token_logprobs`.
A path row is a one-node chain in that layout (segment 1, span_end = its length, prev = t−1),
so both layouts go through the same forward, loss and update; only the sums differ in how
many leaves share a token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from treegrpo_jax._pytree import pytree_dataclass
from treegrpo_jax.rl import advantages
from treegrpo_jax.rl.batch import PathBatch
from treegrpo_jax.rl.loss import LossConfig, LossMode
from treegrpo_jax.rl.packed import PackedBatch
from treegrpo_jax.rl.token_weights import TokenWeights, row_weights, tree_weights


@pytree_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepRows:
    """Per-token model inputs and leaf sums, `[..., T]`; `key_blocks` (`[..., NQ, J]`, packed
    trees only) makes the attention block-sparse."""

    tokens: Int[ArrayLike, "... T"]
    positions: Int[ArrayLike, "... T"]
    segment: Int[ArrayLike, "... T"]
    span_end: Int[ArrayLike, "... T"]
    prev: Int[ArrayLike, "... T"]
    sampler_logp: Float[ArrayLike, "... T"]
    weights: TokenWeights
    key_blocks: Int[ArrayLike, "... NQ J"] | None = None

    def reshape_rows(self, *shape: int) -> StepRows:
        """Same rows with leading (row) dims `shape`."""
        n = self.tokens.ndim - 1
        return jax.tree.map(lambda x: x.reshape(*shape, *x.shape[n:]), self)


@pytree_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepInputs:
    """The step's rows `[n_mini, n_micro, b, T]`, per-mini-batch normalisers, and leaf stats.

    Attributes:
      rows: token rows with their leaf sums.
      num_tokens: path tokens of the model per mini-batch (token-mean normaliser, ≥ 1).
      num_rows: paths with ≥ 1 model token per mini-batch (seq-mean normaliser, ≥ 1).
      reward / advantage / leaf_valid: one per leaf (= path), for the step's metrics.
    """

    rows: StepRows
    num_tokens: Float[ArrayLike, " n_mini"]
    num_rows: Float[ArrayLike, " n_mini"]
    reward: Float[ArrayLike, " L"]
    advantage: Float[ArrayLike, " L"]
    leaf_valid: Bool[ArrayLike, " L"]


def _leaf_advantage(reward, tree_id, prompt_id, valid, cfg: LossConfig):
    if cfg.mode == LossMode.SFT:  # SFT: advantage 1, so the leaf sums are plain path weights
        return valid.astype(jnp.float32)
    return advantages.compute(reward, tree_id, prompt_id, valid, cfg.estimator)


def _per_mini(x: ArrayLike) -> Array:
    return jnp.sum(x.reshape(x.shape[0], -1), axis=1)


def _from_paths(batch: PathBatch, cfg: LossConfig) -> StepInputs:
    flat = batch.reshape_rows(-1)
    adv = _leaf_advantage(flat.reward, flat.tree_id, flat.prompt_id, flat.row_valid, cfg)
    mask = batch.loss_mask * batch.row_valid[..., None].astype(batch.loss_mask.dtype)
    weights = row_weights(
        jnp.reshape(adv, batch.row_shape), mask, cfg.aggregation, shared=batch.shared, credit=cfg.credit
    )
    t = jnp.arange(batch.seq_len, dtype=jnp.int32)
    length = jnp.sum(batch.valid, axis=-1, dtype=jnp.int32)
    rows = StepRows(
        tokens=batch.tokens,
        positions=batch.positions,
        segment=batch.valid.astype(jnp.int32),
        span_end=jnp.broadcast_to(length[..., None], batch.tokens.shape),
        prev=jnp.broadcast_to(t - 1, batch.tokens.shape),
        sampler_logp=batch.sampler_logp,
        weights=weights,
    )
    has_model = jnp.any(mask > 0, axis=-1).astype(jnp.float32)
    return StepInputs(
        rows=rows,
        num_tokens=jnp.maximum(_per_mini(weights.count), 1.0),
        num_rows=jnp.maximum(_per_mini(has_model), 1.0),
        reward=flat.reward,
        advantage=adv,
        leaf_valid=flat.row_valid,
    )


def _from_packed(batch: PackedBatch, cfg: LossConfig) -> StepInputs:
    adv = _leaf_advantage(batch.reward, batch.tree_id, batch.prompt_id, batch.leaf_valid, cfg)
    weights = tree_weights(
        adv,
        batch.leaf_tokens,
        batch.leaf_valid,
        batch.pair_leaf,
        batch.pair_node,
        batch.node,
        batch.loss_mask,
        num_nodes=batch.num_nodes,
        aggregation=cfg.aggregation,
        node_leaves=batch.node_leaves,
        credit=cfg.credit,
    )
    rows = StepRows(
        tokens=batch.tokens,
        positions=batch.positions,
        segment=batch.segment,
        span_end=batch.span_end,
        prev=batch.prev,
        sampler_logp=batch.sampler_logp,
        weights=weights,
        key_blocks=batch.key_blocks,
    )
    n_mini = batch.tokens.shape[0]
    has_model = (batch.leaf_valid & (batch.leaf_tokens > 0)).astype(jnp.float32)
    return StepInputs(
        rows=rows,
        num_tokens=jnp.maximum(_per_mini(weights.count), 1.0),
        num_rows=jnp.maximum(jax.ops.segment_sum(has_model, batch.leaf_mini, num_segments=n_mini), 1.0),
        reward=batch.reward,
        advantage=adv,
        leaf_valid=batch.leaf_valid,
    )


_PREPARE = {PathBatch: _from_paths, PackedBatch: _from_packed}


def prepare(batch: PathBatch | PackedBatch, cfg: LossConfig) -> StepInputs:
    """The step's inputs from a batch of either layout (call inside jit).

    Args:
      batch: `[n_mini, n_micro, b, T]` rows from `batch.build_batch` or `packed.build_packed_batch`.
      cfg: the loss configuration (mode, estimator, aggregation).
    """
    try:
        fn = _PREPARE[type(batch)]
    except KeyError:
        name = type(batch).__name__
        raise TypeError(f"train_step takes a PathBatch or a PackedBatch, got {name}") from None
    return fn(batch, cfg)

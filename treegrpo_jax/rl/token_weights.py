"""Per-token leaf sums: why a tree's shared tokens can be trained once, exactly.

Legend: B rows, T tokens, L leaves, Q (leaf, node) ancestor pairs, N nodes; `...` any row dims.

The paths layout trains a token t shared by the leaves ℓ ∈ below(t) once per leaf, each time
with the leaf's advantage A_ℓ and a per-leaf weight v_ℓ: v_ℓ = 1 for token-mean, v_ℓ = 1/n_ℓ
for seq-mean-token-mean (n_ℓ = model tokens on ℓ's path). Each path copy of t has the same
ratio ρ_t, KL and entropy (the same prefix gives the same log-probs), and the clipped surrogate
of `loss.py` is positively homogeneous in A on each sign:

    pg(ρ, A) = A⁺·pg(ρ, +1) + A⁻·pg(ρ, −1)          A⁺ = max(A, 0), A⁻ = max(−A, 0)
    pg(ρ, +1) = max(−ρ, −clip(ρ))                    (= −min(ρ, 1+ε_high))
    pg(ρ, −1) = min(max(ρ, clip(ρ)), c)              (the dual clip c bounds negatives only)

so the sum over t's path copies is a function of ρ_t and of four sums over below(t):

    Σ_ℓ v_ℓ·[pg(ρ_t, A_ℓ) + β·kl_t − α·H_t]
        = pos_t·pg(ρ_t, +1) + neg_t·pg(ρ_t, −1) + weight_t·(β·kl_t − α·H_t),
    pos_t = Σ v_ℓ·A_ℓ⁺,  neg_t = Σ v_ℓ·A_ℓ⁻,  weight_t = Σ v_ℓ.

Divided by the same normaliser (token-mean: path tokens Σ_t count_t; seq-mean: rows with a model
token) this is the paths loss exactly, gradient included: JAX splits a max/min tie evenly, and
that split is unchanged by a positive scale. Token-counted metrics (clip fractions, ratio mean,
log-prob gap) use count_t = |below(t)| and the counts of positive / negative leaves.

A path row is the special case below(t) = {its leaf} (`row_weights`); a packed tree gets the
sums from its (leaf, node) ancestor pairs with one segment sum (`tree_weights`).

Shared-prefix credit (`Credit`, config `rl.credit`): how much a token shared by n_t leaves of its
tree is trained. Every path copy of t is scaled by c(n_t): `sum` c = 1 (the paper: the token gets
Σ_ℓ v_ℓ·A_ℓ), `mean` c = 1/n_t (ARPO: the leaves' mean), `sqrt` c = 1/√n_t (TreeRL). n_t counts
the leaves of the whole tree below t's node — not of a mini-batch or a packed unit — so both
layouts scale the same copies by the same factor, and since c_t is constant over below(t) it
moves outside the sums: pos_t, neg_t and weight_t are multiplied by c_t, the counts are not.
A token on one leaf's path only (n_t = 1) is trained the same under every rule; the normalisers
do not change either, so `sum` is today's loss bit for bit.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
from jaxtyping import ArrayLike, Bool, Float, Int

from treegrpo_jax._pytree import pytree_dataclass


class Aggregation(enum.StrEnum):
    """How token losses become the step loss (`rl.loss`): over all model tokens of a mini-batch, or
    per path first (the paper's equation)."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"


class Credit(enum.StrEnum):
    """How a prefix shared by n leaves is credited (`rl.credit`): the scale of each path copy."""

    SUM = "sum"  # 1: once per leaf below, with that leaf's advantage (Tree-GRPO)
    MEAN = "mean"  # 1/n: the mean of the leaves' advantages (ARPO)
    SQRT = "sqrt"  # 1/√n (TreeRL)


def credit_scale(shared: Float[ArrayLike, "..."], credit: Credit) -> Float[ArrayLike, "..."]:
    """c(n): the factor on each path copy of a token that `shared` = n leaves pass through."""
    n = jnp.maximum(shared.astype(jnp.float32), 1.0)
    if credit == Credit.MEAN:
        return 1.0 / n
    if credit == Credit.SQRT:
        return jax.lax.rsqrt(n)
    return jnp.ones_like(n)


def _credited(terms: Float[ArrayLike, "... 6"], scale: Float[ArrayLike, "..."]) -> Float[ArrayLike, "... 6"]:
    """Scales the loss sums (pos, neg, weight) by the credit factor; the counts stay counts."""
    factor = jnp.concatenate(
        [jnp.broadcast_to(scale[..., None], (*scale.shape, 3)), jnp.ones((*scale.shape, 3))], -1
    )
    return terms * factor


@pytree_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenWeights:
    """Sums over the leaves whose path holds the token; 0 off model tokens and on padding.

    Attributes:
      pos: Σ v_ℓ·max(A_ℓ, 0).
      neg: Σ v_ℓ·max(−A_ℓ, 0).
      weight: Σ v_ℓ (weights the KL and entropy terms).
      count: number of leaves (= path copies of the token).
      count_pos / count_neg: leaves with A_ℓ > 0 / A_ℓ < 0 (clip-fraction metrics).
    """

    pos: Float[ArrayLike, "... T"]
    neg: Float[ArrayLike, "... T"]
    weight: Float[ArrayLike, "... T"]
    count: Float[ArrayLike, "... T"]
    count_pos: Float[ArrayLike, "... T"]
    count_neg: Float[ArrayLike, "... T"]

    @classmethod
    def from_stack(cls, x: Float[ArrayLike, "... T 6"]) -> TokenWeights:
        return cls(**{f.name: x[..., i] for i, f in enumerate(dataclasses.fields(cls))})


def _leaf_terms(
    advantage: Float[ArrayLike, "*L"],
    model_tokens: Float[ArrayLike, "*L"],
    valid: Bool[ArrayLike, "*L"],
    aggregation: Aggregation,
) -> Float[ArrayLike, "*L 6"]:
    """Per leaf, the six TokenWeights terms (stacked last, in field order); 0 on invalid leaves."""
    a = advantage.astype(jnp.float32)
    if aggregation == Aggregation.TOKEN_MEAN:
        v = jnp.ones_like(a)
    else:  # the paper's equation: each path's token sum divided by its own length
        v = 1.0 / jnp.maximum(model_tokens.astype(jnp.float32), 1.0)
    # max(NaN, 0) is NaN: a non-finite advantage poisons the loss (and the update is skipped).
    terms = [
        v * jnp.maximum(a, 0.0),
        v * jnp.maximum(-a, 0.0),
        v,
        jnp.ones_like(a),
        (a > 0).astype(jnp.float32),
        (a < 0).astype(jnp.float32),
    ]
    return jnp.where(valid[..., None], jnp.stack(terms, axis=-1), 0.0)


def row_weights(
    advantage: Float[ArrayLike, "..."],
    model_mask: Float[ArrayLike, "... T"],
    aggregation: Aggregation,
    *,
    shared: Float[ArrayLike, "... T"] | None = None,
    credit: Credit = Credit.SUM,
) -> TokenWeights:
    """Path rows: every model token of a row carries its own leaf's terms.

    Args:
      advantage: one per row.
      model_mask: 1 on model tokens of real rows (0 on padding rows too).
      aggregation: decides the per-leaf weight v.
      shared: per token, the leaves of its tree below its node (n_t; needed unless `sum`).
      credit: the shared-prefix credit rule.
    """
    m = model_mask.astype(jnp.float32)
    n = jnp.sum(m, axis=-1)
    terms = _leaf_terms(advantage, n, jnp.ones(advantage.shape, bool), aggregation)
    per_token = jnp.broadcast_to(terms[..., None, :], (*m.shape, 6))
    if credit != Credit.SUM:
        if shared is None:
            raise ValueError(f"rl.credit={credit.value!r} needs the batch's per-token leaf counts")
        per_token = _credited(per_token, credit_scale(shared, credit))
    return TokenWeights.from_stack(jnp.where(m[..., None] > 0, per_token, 0.0))


def tree_weights(
    advantage: Float[ArrayLike, " L"],
    leaf_tokens: Float[ArrayLike, " L"],
    leaf_valid: Bool[ArrayLike, " L"],
    pair_leaf: Int[ArrayLike, " Q"],
    pair_node: Int[ArrayLike, " Q"],
    token_node: Int[ArrayLike, "... T"],
    model_mask: Float[ArrayLike, "... T"],
    *,
    num_nodes: int,
    aggregation: Aggregation,
    node_leaves: Float[ArrayLike, " N"] | None = None,
    credit: Credit = Credit.SUM,
) -> TokenWeights:
    """Packed trees: a token's sums over the leaves below its node.

    Args:
      advantage: one per leaf.
      leaf_tokens: model tokens on each leaf's root-to-leaf path (n_ℓ).
      leaf_valid: False on padding leaves.
      pair_leaf / pair_node: one pair per (leaf, node on the leaf's path); padding pairs point
        at node 0, which no real token uses.
      token_node: the node of every token.
      model_mask: 1 on model tokens of real trees.
      num_nodes: N, the size of the node table (static).
      aggregation: decides the per-leaf weight v.
      node_leaves: per node, the leaves of its whole tree below it (n_t; needed unless `sum`).
      credit: the shared-prefix credit rule.
    """
    terms = _leaf_terms(advantage, leaf_tokens, leaf_valid, aggregation)
    per_node = jax.ops.segment_sum(terms[pair_leaf], pair_node, num_segments=num_nodes)  # [N, 6]
    if credit != Credit.SUM:
        if node_leaves is None:
            raise ValueError(f"rl.credit={credit.value!r} needs the batch's per-node leaf counts")
        per_node = _credited(per_node, credit_scale(node_leaves, credit))
    per_token = per_node[token_node]  # [..., T, 6]
    return TokenWeights.from_stack(jnp.where(model_mask[..., None] > 0, per_token, 0.0))

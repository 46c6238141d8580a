"""The clipped policy loss (docs/DESIGN.md §1) and the SFT negative log-likelihood, one function.

Legend: B rows, T tokens.

RL mode, per model-generated token with ratio ρ = exp(logp − logp_old) and a leaf's
advantage A (as in verl's `compute_policy_loss`, the reference code of the paper):
  pg1 = −A·ρ,  pg2 = −A·clip(ρ, 1−ε_low, 1+ε_high),  pg = max(pg1, pg2)         (PPO clip)
  for A < 0:   pg = min(pg, −A·c)                                              (dual clip)
  kl = exp(ref − logp) − (ref − logp) − 1                                      (k3 estimator)
  ℓ = pg + β·kl − α·H                                                          (H: entropy)
SFT mode: ℓ = −logp (no ratio, no KL, no entropy): cold-start on demonstrations.

Aggregation over the mini-batch's paths (all terms masked to model tokens):
  token-mean:           Σ_{paths,t} ℓ / num_tokens
  seq-mean-token-mean:  Σ_paths (Σ_t ℓ / n_path) / num_rows       (the paper's equation)
`num_tokens` / `num_rows` are the *mini-batch's* counts, passed in, so that summing the
loss (and its gradient) over micro-batches equals one pass over the whole mini-batch.

The leaves enter only through per-token sums (`token_weights.TokenWeights`): pg is
evaluated at A = ±1 and scaled by the sums of positive and negative leaf advantages, so
one token row serves every path that holds the token (a path row, or a packed tree).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from treegrpo_jax.rl.advantages import Estimator, parse_estimator
from treegrpo_jax.rl.token_weights import Aggregation, Credit, TokenWeights
from treegrpo_jax.validation import as_enum

_MAX_LOG_RATIO = 20.0  # exp() guard on log-ratios, as in verl; inactive for sane policies


class LossMode(enum.StrEnum):
    RL = "rl"  # clipped surrogate + KL + entropy
    SFT = "sft"  # plain NLL on model tokens (advantage 1, no ratio, no KL)


def _enum(cls, value, field: str):
    return as_enum(cls, value, f"LossConfig.{field}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    """Loss hyper-parameters (paper defaults).

    Attributes:
      mode: "rl" or "sft".
      estimator: advantage estimator ("tree", "intra", "inter", "grpo"); RL mode only.
      eps_low / eps_high: clip range of the ratio [1 − eps_low, 1 + eps_high].
      dual_clip: c > 1, bound on the loss of negative-advantage tokens (−A·c); None disables.
      kl_coef: β of the k3 KL to the reference policy; 0 skips the reference forward pass.
      entropy_coef: α of the entropy bonus; 0 allowed.
      aggregation: "token-mean" or "seq-mean-token-mean".
      credit: shared-prefix credit, "sum" (the paper), "mean" or "sqrt" (`token_weights.Credit`).
    """

    mode: LossMode | str = LossMode.RL  # a name is parsed into the enum in __post_init__
    estimator: Estimator | str = Estimator.TREE
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = 3.0
    kl_coef: float = 0.001
    entropy_coef: float = 0.001
    aggregation: Aggregation | str = Aggregation.TOKEN_MEAN
    credit: Credit | str = Credit.SUM

    def __post_init__(self):
        object.__setattr__(self, "mode", _enum(LossMode, self.mode, "mode"))
        object.__setattr__(self, "credit", _enum(Credit, self.credit, "credit"))
        object.__setattr__(self, "aggregation", _enum(Aggregation, self.aggregation, "aggregation"))
        try:
            object.__setattr__(self, "estimator", parse_estimator(self.estimator))
        except ValueError as e:
            raise ValueError(f"LossConfig.estimator: {e}") from None
        for name in ("eps_low", "eps_high"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"LossConfig.{name} must be in [0, 1), got {value}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"LossConfig.dual_clip must be > 1 (or None), got {self.dual_clip}")
        for name in ("kl_coef", "entropy_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"LossConfig.{name} must be ≥ 0, got {getattr(self, name)}")

    @property
    def uses_reference(self) -> bool:
        return self.mode == LossMode.RL and self.kl_coef > 0

    def replace(self, **changes) -> LossConfig:
        return dataclasses.replace(self, **changes)


class LossAux(NamedTuple):
    """Metrics of a (micro-)batch. `sums` are already divided by the mini-batch normaliser,
    so adding them over micro-batches gives the mini-batch value; `mins`/`maxs` reduce by min/max."""

    sums: dict[str, Array]
    mins: dict[str, Array]
    maxs: dict[str, Array]


def policy_loss(
    logp: Float[ArrayLike, "B T"],
    logp_old: Float[ArrayLike, "B T"] | None,
    ref_logp: Float[ArrayLike, "B T"] | None,
    entropy: Float[ArrayLike, "B T"],
    weights: TokenWeights,
    *,
    cfg: LossConfig,
    num_tokens: Float[ArrayLike, ""] | float,
    num_rows: Float[ArrayLike, ""] | float,
) -> tuple[Float[ArrayLike, ""], LossAux]:
    """The loss of a (micro-)batch, normalised by the mini-batch counts.

    Args:
      logp: trainer log-probs (differentiated).
      logp_old: log-probs of the policy before this step's updates (RL mode).
      ref_logp: reference-policy log-probs (RL mode with kl_coef > 0, else ignored).
      entropy: per-token entropy of the trainer policy.
      weights: per-token leaf sums (`token_weights.row_weights` for path rows with one
        advantage each, `token_weights.tree_weights` for packed trees); 0 off model tokens.
      cfg: loss configuration.
      num_tokens: path tokens of the model in the whole mini-batch (token-mean normaliser, ≥ 1).
      num_rows: paths with ≥ 1 model token in the whole mini-batch (seq-mean normaliser, ≥ 1).

    Returns:
      (loss, LossAux).
    """
    w = weights
    denom = num_tokens if cfg.aggregation == Aggregation.TOKEN_MEAN else num_rows
    agg = lambda x, by: jnp.sum(x * by) / denom  # noqa: E731
    tok_mean = lambda x, by: jnp.sum(x * by) / num_tokens  # noqa: E731
    big = jnp.finfo(jnp.float32).max
    if cfg.mode == LossMode.SFT:  # advantage 1: `pos` is the leaf weight v
        nll = agg(-logp, w.pos)
        ent = tok_mean(jax.lax.stop_gradient(entropy), w.count)
        return nll, LossAux(sums={"loss": nll, "nll": nll, "entropy": ent}, mins={}, maxs={})

    log_ratio = jnp.clip(logp - logp_old, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg_pos = jnp.maximum(-ratio, -clipped)  # pg at A = +1
    pg_neg = jnp.maximum(ratio, clipped)  # pg at A = −1
    dual = jnp.zeros_like(pg_neg, bool)
    if cfg.dual_clip is not None:
        dual = pg_neg > cfg.dual_clip
        pg_neg = jnp.minimum(pg_neg, cfg.dual_clip)
    pg_loss = jnp.sum(w.pos * pg_pos + w.neg * pg_neg) / denom
    loss = pg_loss
    sums = {"pg_loss": pg_loss}
    if cfg.kl_coef > 0:
        delta = jnp.clip(ref_logp - logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = agg(jnp.exp(delta) - delta - 1.0, w.weight)  # k3: unbiased, always ≥ 0
        loss = loss + cfg.kl_coef * kl
        sums["kl"] = kl
    # With α = 0 the entropy is a metric only: no gradient flows through it.
    ent = agg(entropy if cfg.entropy_coef > 0 else jax.lax.stop_gradient(entropy), w.weight)
    loss = loss - cfg.entropy_coef * ent
    sums.update(
        loss=loss,
        entropy=ent,
        # PPO clip is active where pg2 > pg1: A > 0 with ρ > 1+ε_high, or A < 0 with ρ < 1−ε_low.
        clip_frac_high=tok_mean((ratio > 1.0 + cfg.eps_high).astype(jnp.float32), w.count_pos),
        clip_frac_low=tok_mean((ratio < 1.0 - cfg.eps_low).astype(jnp.float32), w.count_neg),
        clip_frac_dual=tok_mean(dual.astype(jnp.float32), w.count_neg),
        ratio_mean=tok_mean(jax.lax.stop_gradient(ratio), w.count),
    )
    sg_ratio = jax.lax.stop_gradient(ratio)
    mins = {"ratio_min": jnp.min(jnp.where(w.count > 0, sg_ratio, big))}
    maxs = {"ratio_max": jnp.max(jnp.where(w.count > 0, sg_ratio, -big))}
    return loss, LossAux(sums=sums, mins=mins, maxs=maxs)

"""AdamW with global-norm clipping and a warmup schedule indexed by the RL step.

The learning rate follows the RL step (one per `train_step` call), not the optimizer
update count, as in verl (its LR scheduler steps once per training step while the
optimizer steps once per mini-batch). Schedule: linear warmup from 0 over
`round(warmup_ratio · total_steps)` steps (lr·s/w, HF/verl semantics), then constant or
cosine decay to `min_lr_ratio · learning_rate` at `total_steps`.

Weight decay applies to matrices only: parameters whose logical axes contain `embed`
(embeddings, projections, MLP, LM head) — not norms or biases.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jaxtyping import Array, ArrayLike, Float, Int

from treegrpo_jax.validation import as_enum


class DecaySchedule(enum.StrEnum):
    CONSTANT = "constant"
    COSINE = "cosine"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Optimizer hyper-parameters (paper: lr 1e-6, warmup ratio 0.285, clip 1.0, 180 steps).

    Attributes:
      learning_rate: peak learning rate.
      warmup_ratio: fraction of `total_steps` spent in linear warmup.
      total_steps: RL steps of the run (the schedule's horizon).
      schedule: after warmup, "constant" or "cosine".
      min_lr_ratio: cosine floor as a fraction of the peak.
      b1 / b2 / eps: Adam moments.
      weight_decay: decoupled (AdamW) decay on matrices.
      grad_clip: global-norm clip (None disables).
    """

    learning_rate: float = 1e-6
    warmup_ratio: float = 0.285
    total_steps: int = 180
    schedule: DecaySchedule | str = DecaySchedule.CONSTANT  # a name is parsed in __post_init__
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float | None = 1.0

    def __post_init__(self):
        object.__setattr__(self, "schedule", as_enum(DecaySchedule, self.schedule, "OptimConfig.schedule"))
        if not self.learning_rate >= 0:
            raise ValueError(f"OptimConfig.learning_rate must be ≥ 0, got {self.learning_rate}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"OptimConfig.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not isinstance(self.total_steps, int) or self.total_steps <= 0:
            raise ValueError(f"OptimConfig.total_steps must be a positive int, got {self.total_steps!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"OptimConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError("OptimConfig.eps must be > 0 and OptimConfig.weight_decay ≥ 0")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"OptimConfig.grad_clip must be > 0 or None, got {self.grad_clip}")

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup_ratio * self.total_steps)


def schedule(cfg: OptimConfig) -> optax.Schedule:
    """The learning rate against the RL step, from optax's schedules: `linear_schedule` over
    the warmup (lr·s/w), then `constant_schedule` or `cosine_decay_schedule` down to
    `min_lr_ratio`·lr at `total_steps`, joined at the warmup's end."""
    w = cfg.warmup_steps
    warmup = optax.linear_schedule(0.0, cfg.learning_rate, transition_steps=max(w, 1))
    if cfg.schedule == DecaySchedule.CONSTANT:
        after = optax.constant_schedule(cfg.learning_rate)
    else:
        after = optax.cosine_decay_schedule(
            cfg.learning_rate, decay_steps=max(cfg.total_steps - w, 1), alpha=cfg.min_lr_ratio
        )
    return optax.join_schedules([warmup, after], boundaries=[w])


def learning_rate(cfg: OptimConfig, step: Int[ArrayLike, ""] | int) -> Float[Array, ""]:
    """Learning rate at RL step `step` (0-based)."""
    return jnp.asarray(schedule(cfg)(step), jnp.float32)


def _decay_mask(params: nnx.State):
    def one(var):
        return "embed" in (var.get_metadata().get("axes") or ())

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: OptimConfig, params: nnx.State) -> optax.GradientTransformation:
    """Clip → Adam moments → decoupled weight decay; the caller scales by −lr(step).

    Args:
      cfg: optimizer configuration.
      params: the policy parameters (abstract is fine): their axes choose what decays.
    """
    parts = []
    if cfg.grad_clip is not None:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
    if cfg.weight_decay > 0:
        parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=_decay_mask(params)))
    return optax.chain(*parts)

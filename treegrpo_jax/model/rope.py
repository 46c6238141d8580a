"""Rotary position embeddings with HF's half-split ("rotate_half") layout.

Frequencies are computed once in NumPy from the config (they are static); only
`positions × inv_freq` happens inside jit. Scaling variants follow `transformers`
`_compute_*_parameters` exactly so logits match checkpoints trained with them.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from treegrpo_jax.model.config import ModelConfig, RopeType


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[D/2] inverse frequencies after scaling, float32."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    rs = cfg.rope_scaling
    if rs.rope_type == RopeType.LINEAR:
        inv = inv / rs.factor
    elif rs.rope_type == RopeType.LLAMA3:
        old = rs.original_max_position_embeddings
        low_wavelen = old / rs.low_freq_factor
        high_wavelen = old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rotary_angles(positions: Int[ArrayLike, "B T"], inv_freq) -> tuple[Array, Array]:
    """cos, sin of shape [B, T, D/2] in float32 (`inv_freq`: array or tuple of floats)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: Float[ArrayLike, "B T N D"], cos: ArrayLike, sin: ArrayLike) -> Array:
    """Rotates q or k (any head count N); math in float32, result in x's dtype."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)

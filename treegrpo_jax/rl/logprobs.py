"""Per-token log-probs and entropies without materialising `[B, T, V]` f32 logits.

Legend: B rows, T tokens, C chunk tokens, N chunks, E embed, V vocab.

The decoder's trunk runs once (`Decoder.hidden`); the LM head, log-softmax, the gather
of the target token and the entropy then run chunk by chunk over T inside `lax.map`,
each chunk under `jax.checkpoint`, so neither the forward nor the backward pass holds
more than one `[B, C, V]` f32 logits block (the backward recomputes a chunk's logits
from its `[B, C, E]` hidden states). With `chunk >= T` the head runs in one piece (faster
when `B·T·V` fits in memory).

Outputs are token-aligned like the batch: `logp[b, t] = log p(tokens[b, t] | tokens[b, :t])`
for t ≥ 1 and 0 at t = 0 (the first token is never a target).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from treegrpo_jax.model.decoder import Decoder, causal_mask


def _head(model: Decoder, h_BCE: Array, targets_BC: Array) -> tuple[Array, Array]:
    logits = model.logits(h_BCE)  # f32 [B, C, V]
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets_BC[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)  # H = −Σ p log p
    return logp, entropy


def token_logprobs(
    model: Decoder,
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    valid: Bool[Array, "B T"],
    *,
    chunk: int = 256,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Log-prob of every token given its prefix, and the entropy of the predicting distribution.

    Args:
      model: the policy or reference decoder.
      tokens: left-aligned rows.
      positions: RoPE positions.
      valid: real tokens (padding keys are hidden from attention).
      chunk: sequence positions per LM-head chunk (C); ≥ T disables chunking.

    Returns:
      (logp, entropy), both f32 [B, T], token-aligned (column 0 is 0).
    """
    b, t = tokens.shape
    h = model.hidden(tokens, positions, causal_mask(valid))[:, :-1]  # position t predicts t+1
    targets = tokens[:, 1:]
    if chunk >= t - 1:
        logp, entropy = _head(model, h, targets)
    else:
        n = -(-(t - 1) // chunk)
        pad = n * chunk - (t - 1)
        h_NBCE = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, -1).swapaxes(0, 1)
        tg_NBC = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)
        # Remat: the backward recomputes one chunk's logits instead of storing all of them.
        head = jax.checkpoint(lambda hc, tc: _head(model, hc, tc))
        logp, entropy = jax.lax.map(lambda xs: head(*xs), (h_NBCE, tg_NBC))
        logp = logp.swapaxes(0, 1).reshape(b, n * chunk)[:, : t - 1]
        entropy = entropy.swapaxes(0, 1).reshape(b, n * chunk)[:, : t - 1]
    zero = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, entropy], axis=1)

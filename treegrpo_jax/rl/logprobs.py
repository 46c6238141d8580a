"""Per-token log-probs and entropies without materialising `[B, T, V]` f32 logits.

Legend: B rows, T tokens, C chunk tokens, N chunks, E embed, V vocab.

The decoder's trunk runs once (`Decoder.hidden`); the LM head, log-softmax, the gather
of the target token and the entropy then run chunk by chunk over T inside `lax.map`,
each chunk under `jax.checkpoint`, so neither the forward nor the backward pass holds
more than one `[B, C, V]` f32 logits block (the backward recomputes a chunk's logits
from its `[B, C, E]` hidden states). With `chunk >= T` the head runs in one piece (faster
when `B·T·V` fits in memory).

Outputs are token-aligned like the batch: `logp[b, t] = log p(tokens[b, t] | tokens[b, :t])`
for t ≥ 1 and 0 at t = 0 (the first token is never a target). `tree_token_logprobs` does the
same for depth-first packed trees, where a token's prefix is its path, not the row before it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from treegrpo_jax.model.block_attention import BlockMask
from treegrpo_jax.model.causal_attention import CausalMask
from treegrpo_jax.model.decoder import Decoder

# Logits above this many bytes per call are computed chunk by chunk (`chunk=None`).
_HEAD_BYTES = 256 * 2**20


def auto_chunk(b: int, t: int, vocab: int) -> int:
    """Positions per LM-head chunk so that one `[b, chunk, vocab]` f32 logits block fits `_HEAD_BYTES`
    (the whole sequence when it fits: a small vocabulary never pays for chunking)."""
    return max(1, min(t, _HEAD_BYTES // max(1, b * vocab * 4)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _head_logp(h_NE, w, targets_N, tied: bool, dtype) -> tuple[Array, Array]:
    return _head_fwd(h_NE, w, targets_N, tied, dtype)[0]


def _head_logits(h_NE, w, tied, dtype):
    h, w = h_NE.astype(dtype), w.astype(dtype)
    dims = ((1,), (1,)) if tied else ((1,), (0,))  # tied: w is the [V, E] embedding
    return jax.lax.dot_general(h, w, (dims, ((), ())), preferred_element_type=jnp.float32)


def _head_fwd(h_NE, w, targets_N, tied, dtype):
    logp_all = jax.nn.log_softmax(_head_logits(h_NE, w, tied, dtype), axis=-1)
    logp = jnp.take_along_axis(logp_all, targets_N[:, None], axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)  # H = −Σ p log p
    return (logp, entropy), (h_NE, w, targets_N, logp_all, entropy)


def _head_bwd(tied, dtype, res, g):
    # Written out rather than differentiated: XLA:CPU lowers the automatic backward of
    # log_softmax + the tied head through a transposed copy of the [N, V] gradient that
    # costs more than the head's matmuls. Here the big [N, V] operand is never transposed.
    h_NE, w, targets_N, logp_all, entropy = res
    g_logp, g_entropy = g
    p = jnp.exp(logp_all)
    onehot = jax.nn.one_hot(targets_N, logp_all.shape[-1], dtype=jnp.float32)
    # d logp_t / d z = onehot − p;  d H / d z = −p (log p + H)
    d_logits = g_logp[:, None] * (onehot - p) - g_entropy[:, None] * p * (logp_all + entropy[:, None])
    d_logits = d_logits.astype(dtype)
    wd = w.astype(dtype)
    f32 = jnp.float32
    if tied:  # w [V, E]
        d_h = jnp.matmul(d_logits, wd, preferred_element_type=f32)
        d_w = jnp.matmul(h_NE.astype(dtype).T, d_logits, preferred_element_type=f32).T
    else:  # w [E, V]
        d_h = jax.lax.dot_general(d_logits, wd, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        d_w = jnp.matmul(h_NE.astype(dtype).T, d_logits, preferred_element_type=f32)
    return d_h.astype(h_NE.dtype), d_w.astype(w.dtype), None


_head_logp.defvjp(_head_fwd, _head_bwd)


def _head(model: Decoder, h_BCE: ArrayLike, targets_BC: ArrayLike) -> tuple[Array, Array]:
    b, c, e = h_BCE.shape
    tied = model.cfg.tie_embeddings
    w = model.embed[...] if tied else model.lm_head[...]
    h_NE, targets_N = h_BCE.reshape(b * c, e), targets_BC.reshape(b * c)
    logp, entropy = _head_logp(h_NE, w, targets_N, tied, model.cfg.jnp_dtype)
    return logp.reshape(b, c), entropy.reshape(b, c)


def _chunked_head(
    model: Decoder, h_BTE: ArrayLike, targets_BT: ArrayLike, chunk: int | None
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """(logp of targets, entropy) from the hidden states that predict them, chunk by chunk over T."""
    b, t = targets_BT.shape
    if chunk is None:
        chunk = auto_chunk(b, t, model.cfg.vocab_size)
    if chunk >= t:
        return _head(model, h_BTE, targets_BT)
    n = -(-t // chunk)
    pad = n * chunk - t
    h_NBCE = jnp.pad(h_BTE, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, -1).swapaxes(0, 1)
    tg_NBC = jnp.pad(targets_BT, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)
    # Remat: the backward recomputes one chunk's logits instead of storing all of them.
    head = jax.checkpoint(lambda hc, tc: _head(model, hc, tc))
    logp, entropy = jax.lax.map(lambda xs: head(*xs), (h_NBCE, tg_NBC))
    logp = logp.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
    entropy = entropy.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
    return logp, entropy


def token_logprobs(
    model: Decoder,
    tokens: Int[ArrayLike, "B T"],
    positions: Int[ArrayLike, "B T"],
    valid: Bool[ArrayLike, "B T"],
    *,
    chunk: int | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Log-prob of every token given its prefix, and the entropy of the predicting distribution.

    Args:
      model: the policy or reference decoder.
      tokens: left-aligned rows.
      positions: RoPE positions.
      valid: real tokens, a prefix of each row (padding keys are hidden from attention).
      chunk: sequence positions per LM-head chunk (C); ≥ T disables chunking; None: the whole
        sequence when its logits fit 256 MiB (`auto_chunk`).

    Returns:
      (logp, entropy), both f32 [B, T], token-aligned (column 0 is 0).
    """
    b = tokens.shape[0]
    # Left-aligned rows: causal attention within each row's length (the fused kernel on GPU).
    lengths = jnp.sum(valid, axis=-1, dtype=jnp.int32)
    h = model.hidden(tokens, positions, CausalMask(lengths))[:, :-1]  # position t predicts t+1
    logp, entropy = _chunked_head(model, h, tokens[:, 1:], chunk)
    zero = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, entropy], axis=1)


def tree_mask(segment: Int[ArrayLike, "B T"], span_end: Int[ArrayLike, "B T"]) -> Bool[Array, "B T T"]:
    """Attention of depth-first packed trees: a token sees its ancestors and its node's earlier tokens.

    Tokens are laid out depth-first (a node's own tokens, then its children's subtrees), so the
    subtree of the node holding key j is the row range [start, span_end[j]) and j's node is an
    ancestor (or the node) of query i exactly when j ≤ i < span_end[j]. Built from two [B, T]
    arrays, no per-pair loop. `segment` (1, 2, ... per packed tree, 0 on padding) keeps trees
    apart; padding queries see token 0, as in `decoder.causal_mask`.

    A path row is a one-node chain: segment 1 and span_end = its length on every real token.
    """
    t = segment.shape[-1]
    idx = jnp.arange(t)
    i, j = idx[:, None], idx[None, :]
    sees = (j <= i) & (i < span_end[:, None, :])
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, None, :] > 0)
    pad_query = (segment[:, :, None] == 0) & (j == 0)
    return sees & same | pad_query


def tree_block_mask(
    segment: Int[ArrayLike, "B T"], span_end: Int[ArrayLike, "B T"], key_blocks: Int[ArrayLike, "B NQ J"]
) -> BlockMask:
    """`tree_mask` restricted to the key blocks each query block lists (`packed.key_blocks`).

    Exact when the lists hold every block with a key the block's queries may see, each once;
    padding queries see nothing (a uniform softmax over masked keys: finite, never read).
    """
    b, t = segment.shape
    nq, j = key_blocks.shape[1:]
    c = t // nq
    kpos = (jnp.maximum(key_blocks, 0)[..., None] * c + jnp.arange(c)).reshape(b, nq, j * c)  # [B, NQ, U]
    qpos = (jnp.arange(nq)[:, None] * c + jnp.arange(c))[None, :, :, None]  # [1, NQ, C, 1]
    flat = kpos.reshape(b, nq * j * c)
    k_seg = jnp.take_along_axis(segment, flat, axis=1).reshape(b, nq, 1, j * c)
    k_end = jnp.take_along_axis(span_end, flat, axis=1).reshape(b, nq, 1, j * c)
    listed = jnp.repeat(key_blocks >= 0, c, axis=-1)[:, :, None, :]
    sees = (kpos[:, :, None, :] <= qpos) & (qpos < k_end)
    same = (k_seg == segment.reshape(b, nq, c, 1)) & (k_seg > 0)
    return BlockMask(key_blocks=key_blocks, visible=listed & sees & same)


def tree_token_logprobs(
    model: Decoder,
    tokens: Int[ArrayLike, "B T"],
    positions: Int[ArrayLike, "B T"],
    segment: Int[ArrayLike, "B T"],
    span_end: Int[ArrayLike, "B T"],
    prev: Int[ArrayLike, "B T"],
    *,
    key_blocks: Int[ArrayLike, "B NQ J"] | None = None,
    chunk: int | None = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """`token_logprobs` for depth-first packed trees (`rl.packed`).

    A token's predecessor on its path is not always the row's previous token (a node's first
    token follows its parent's last one), and a node with several children predicts several
    next tokens: so each token gathers the hidden state at `prev` and the head runs per target.

    Args:
      model: the policy or reference decoder.
      tokens: packed rows.
      positions: RoPE positions = depth along the token's path.
      segment / span_end: the attention layout (see `tree_mask`).
      prev: row index of the token's predecessor on its path; -1 for a tree's first token and padding.
      key_blocks: the key blocks each query block needs (`packed.key_blocks`): block-sparse
        attention (`tree_block_mask`); None: the dense `tree_mask`.
      chunk: target positions per LM-head chunk; ≥ T disables chunking; None: `auto_chunk`.

    Returns:
      (logp, entropy), both f32 [B, T]; 0 where prev < 0.
    """
    if key_blocks is None:
        mask = tree_mask(segment, span_end)
    else:
        mask = tree_block_mask(segment, span_end, key_blocks)
    h = model.hidden(tokens, positions, mask)
    h_prev = jnp.take_along_axis(h, jnp.maximum(prev, 0)[..., None], axis=1)
    logp, entropy = _chunked_head(model, h_prev, tokens, chunk)
    has_prev = prev >= 0
    return jnp.where(has_prev, logp, 0.0), jnp.where(has_prev, entropy, 0.0)

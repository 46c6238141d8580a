"""Slow references for rollout tests: full recompute of a sequence, jitted once per padded length."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from treegrpo_jax.model.decoder import causal_mask


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    return model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), causal_mask(jnp.ones((b, t), bool)))


def full_logits(model, seq: list[int], pad_to: int = 128) -> np.ndarray:
    """Logits [len(seq), V] of recomputing `seq` from scratch (causal: right padding is inert)."""
    length = max(pad_to, 1 << (len(seq) - 1).bit_length())
    tokens = np.zeros((1, length), np.int32)
    tokens[0, : len(seq)] = seq
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef, state, jnp.asarray(tokens)))[0, : len(seq)]


def greedy_reference(model, prefix: list[int], n: int) -> list[int]:
    """Greedy continuation by recomputing the whole prefix every step."""
    seq = list(prefix)
    for _ in range(n):
        seq.append(int(np.argmax(full_logits(model, seq)[-1])))
    return seq[len(prefix) :]

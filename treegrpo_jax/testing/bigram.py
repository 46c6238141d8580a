"""A real `Decoder` wired as a bigram machine: greedy decoding follows a successor table.

Legend: V vocab (= E, the embedding is one-hot).

With a one-hot embedding, zero attention output (`wo`) and zero MLP output (`w_down`), the
residual stream of a position is its own token's one-hot vector (√V after the final
RMSNorm), so the next-token logits are one row of the LM head: `lm_head[t]`. A large entry
at `lm_head[t, successor(t)]` makes greedy decoding emit `successor(t)` after `t`, whatever
the prompt or the observations before it. Any token script in which each token has a
single successor can be played through the real engine this way (stop tables, per-step
caps, context caps, detokenisation), without a trained model. Every model built for one
vocabulary has the same shapes, so an engine compiled once replays any script
(`Engine.set_params`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from treegrpo_jax.model.build import init_model
from treegrpo_jax.model.config import ModelConfig
from treegrpo_jax.model.decoder import Decoder

_LOGIT = 8.0  # × √V after the norm: the successor wins any greedy or low-temperature draw


def successor_table(script: Sequence[int], *, loop_last: bool = False) -> dict[int, int]:
    """Successors that make `script` play from its first token.

    Args:
      script: token ids in the order they must be generated.
      loop_last: the last token repeats forever (a step that never stops by itself).

    Raises:
      ValueError: a token would need two different successors.
    """
    table: dict[int, int] = {}
    pairs = list(zip(script[:-1], script[1:], strict=True))
    if loop_last:
        pairs.append((script[-1], script[-1]))
    for a, b in pairs:
        if table.setdefault(a, b) != b:
            raise ValueError(f"token {a} needs two successors ({table[a]} and {b}): not a bigram script")
    return table


def bigram_config(vocab_size: int, *, max_len: int, eos_ids: Sequence[int] = ()) -> ModelConfig:
    """The (fixed) shapes of every bigram model over `vocab_size` tokens."""
    return ModelConfig(
        vocab_size=vocab_size,
        embed_dim=vocab_size,
        mlp_dim=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=max_len,
        eos_token_ids=tuple(eos_ids),
    )


def bigram_model(cfg: ModelConfig, successors: Mapping[int, int], *, default: int) -> Decoder:
    """A model of `cfg`'s shapes whose greedy successor of `t` is `successors.get(t, default)`.

    Args:
      cfg: from `bigram_config`.
      successors: token → next token.
      default: next token after every token not in `successors` (the prompt's and each
        observation's last token, so every step replays the script from its start).
    """
    model = init_model(cfg, seed=0)
    model.embed.set_value(jnp.eye(cfg.vocab_size, dtype=model.embed.get_value().dtype))
    model.wo.set_value(jnp.zeros_like(model.wo.get_value()))
    model.w_down.set_value(jnp.zeros_like(model.w_down.get_value()))
    set_successors(model, successors, default=default)
    return model


def set_successors(model: Decoder, successors: Mapping[int, int], *, default: int) -> None:
    """Rewires a bigram model in place (only the LM head changes: no new shapes, no recompile)."""
    v = model.cfg.vocab_size
    nxt = np.full(v, default, np.int64)
    for a, b in successors.items():
        nxt[a] = b
    head = np.zeros((v, v), np.float32)
    head[np.arange(v), nxt] = _LOGIT
    model.lm_head.set_value(jnp.asarray(head, model.lm_head.get_value().dtype))


def set_transitions(
    model: Decoder, transitions: Mapping[int, Mapping[int, float]], *, default: Mapping[int, float]
) -> None:
    """Rewires a bigram model as a Markov chain: after `t`, sampling draws from `transitions[t]`.

    Each distribution maps next token → probability (normalised here); every other token
    gets ~e⁻³⁰ of the mass. Tokens without an entry continue from `default` (so each step,
    after the prompt or an observation, starts from it). Sampled at temperature 1 this
    writes random but well-formed-or-not agent steps: searches, answers, tag soup.
    """
    v = model.cfg.vocab_size
    floor = -30.0
    logits = np.full((v, v), floor, np.float64)

    def row(dist: Mapping[int, float]) -> np.ndarray:
        out = np.full(v, floor, np.float64)
        total = sum(dist.values())
        for b, p in dist.items():
            out[b] = np.log(p / total)
        return out

    logits[:] = row(default)
    for a, dist in transitions.items():
        logits[a] = row(dist)
    # The final RMSNorm leaves √V on the token's one-hot coordinate: divide it out.
    head = logits / np.sqrt(v)
    model.lm_head.set_value(jnp.asarray(head, model.lm_head.get_value().dtype))

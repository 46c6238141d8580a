"""A sampled agent without training: a Markov chain over real tokens (`bigram.set_transitions`).

`agent_chain` wires a bigram model so that sampling writes agent steps of every kind the
loop must handle — a thought then a search, an answer, the invalid-action path, EOS at
any point, stop strings written as one tag token or split into byte tokens (so a stop
can straddle two decode calls), and, with `hostile > 0`, tag soup and random bytes
anywhere. Each row's stream is random, yet a rollout is exactly reproducible for a key:
the scheduler-vs-lock-step tests and the resilience benchmark's property test use it.
"""

from __future__ import annotations

import numpy as np

from treegrpo_jax.model.tokenizer import Tokenizer
from treegrpo_jax.rollout.stops import token_bytes


def agent_chain(
    tokenizer: Tokenizer, *, hostile: float = 0.0, seed: int = 0
) -> tuple[dict[int, dict[int, float]], dict[int, float]]:
    """(transitions, default) for `bigram.set_transitions`.

    Args:
      tokenizer: a tokenizer whose agent tags are single tokens (`train_bpe_tokenizer`).
      hostile: probability mass, after every token, of a jump to a random tag, byte or EOS.
      seed: which word tokens play query / answer words, and the hostile jump targets.
    """
    rng = np.random.default_rng(seed)

    def one(text: str) -> int:
        ids = tokenizer.encode(text)
        if len(ids) != 1:
            raise ValueError(f"{text!r} is {len(ids)} tokens; agent_chain needs atomic agent tags")
        return ids[0]

    s_open, s_close, a_open, a_close = (one(t) for t in ("<search>", "</search>", "<answer>", "</answer>"))
    eos = tokenizer.eos_ids[0]
    pieces = token_bytes(tokenizer)
    byte_id = {}
    for i, raw in enumerate(pieces):
        if len(raw) == 1:
            byte_id.setdefault(raw[0], i)
    words = [i for i, raw in enumerate(pieces) if raw.strip().isalpha() and len(raw.strip()) >= 3]
    think1, think2, q1, q2, a1, a2 = (int(w) for w in rng.choice(words, 6, replace=False))
    # "</search>" as nine byte tokens: every byte is distinct, so each has one successor.
    split = [byte_id[b] for b in b"</search>"]
    t: dict[int, dict[int, float]] = {
        think1: {think2: 0.5, s_open: 0.25, a_open: 0.15, think1: 0.1},
        think2: {s_open: 0.4, a_open: 0.3, think1: 0.25, eos: 0.05},
        s_open: {q1: 0.9, s_close: 0.1},
        q1: {q2: 0.5, s_close: 0.3, split[0]: 0.2},
        q2: {s_close: 0.5, split[0]: 0.3, q1: 0.2},
        a_open: {a1: 0.9, a_close: 0.1},
        a1: {a_close: 0.7, a2: 0.3},
        a2: {a_close: 0.8, a1: 0.1, eos: 0.1},
    }
    for a, b in zip(split[:-1], split[1:], strict=True):
        t[a] = {b: 1.0}
    default = {think1: 0.6, s_open: 0.2, a_open: 0.15, eos: 0.05}
    if hostile > 0:
        targets = [s_open, s_close, a_open, a_close, eos, *split, *rng.choice(len(pieces), 16)]
        for dist in [*t.values(), default]:
            scale = 1.0 - hostile
            for k in dist:
                dist[k] *= scale
            for target in targets:
                dist[int(target)] = dist.get(int(target), 0.0) + hostile / len(targets)
    return t, default

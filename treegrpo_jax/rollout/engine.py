"""The rollout engine: jitted append / decode / fork over a pool of KV-cache slots.

Legend: S slots, C chunk tokens, N decode steps, V vocab.

Pending-token invariant: a slot's cache holds every token of its sequence except the
last one, which is kept as the slot's *pending* token. Decoding then is uniform — each
step writes the pending token and samples the next — and appending an observation is
"write pending + observation[:-1], pending = observation[-1]". Forking copies the cache
rows and the pending token, so a branch continues exactly where its node ended, with no
logits stored per slot.

Every operation is jitted once per shape bucket (chunk lengths and attention spans are
rounded up to powers of two) with the cache donated, so the pool is updated in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from treegrpo_jax.model.cache import KVCache, fork_slots, init_cache
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.rollout import stops as stops_lib
from treegrpo_jax.rollout.sampling import SamplingParams, sample


def _bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest power of two ≥ n (at least `minimum`, at most `maximum`)."""
    b = minimum
    while b < n:
        b *= 2
    return min(b, maximum)


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """Host-side result of one decode call, for the slots that were active."""

    tokens: np.ndarray  # [S, N] int32, valid up to num_tokens[s]
    logprobs: np.ndarray  # [S, N] float32
    num_tokens: np.ndarray  # [S] int32
    hit_eos: np.ndarray  # [S] bool
    hit_stop: np.ndarray  # [S] bool: generation ended with a stop string
    hit_context: np.ndarray  # [S] bool: the slot is full


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _append(graphdef, state, cache: KVCache, tokens, chunk_lens):
    model = nnx.merge(graphdef, state)
    _, cache = model.append(tokens, chunk_lens, cache)
    return cache


@functools.partial(
    jax.jit, static_argnames=("graphdef", "num_steps", "attend_len"), donate_argnames=("cache",)
)
def _decode(
    graphdef,
    state,
    cache,
    pending,
    active,
    keys,
    sampling,
    budget,
    eos_ids,
    stop_table,
    *,
    num_steps,
    attend_len,
):
    model = nnx.merge(graphdef, state)
    s = pending.shape[0]

    def cond(carry):
        step, _, _, active, *_ = carry
        return (step < num_steps) & jnp.any(active)

    def body(carry):
        step, cache, pending, active, out_tok, out_logp, count, eos_hit, ctx_hit, window, stop_hit = carry
        logits, cache = model.decode(pending, cache, active, attend_len=attend_len)
        # Fold the write position into the row's key: a row's stream depends only on its own
        # history, not on which other rows share the batch.
        step_keys = jax.vmap(jax.random.fold_in)(keys, cache.lengths)
        tok, logp = sample(logits, step_keys, sampling)
        out_tok = out_tok.at[:, step].set(jnp.where(active, tok, 0))
        out_logp = out_logp.at[:, step].set(jnp.where(active, logp, 0.0))
        count = count + active
        pending = jnp.where(active, tok, pending)
        is_eos = active & jnp.isin(tok, eos_ids)
        window, is_stop = stops_lib.push(window, tok, stop_table)
        is_stop = active & is_stop & ~is_eos
        stop_hit |= is_stop
        # The pending token needs one free position to be written later.
        full = active & (cache.lengths + 1 >= cache.max_len)
        eos_hit |= is_eos
        ctx_hit |= full & ~is_eos & ~is_stop
        active = active & ~is_eos & ~is_stop & ~full & (count < budget)
        return step + 1, cache, pending, active, out_tok, out_logp, count, eos_hit, ctx_hit, window, stop_hit

    init = (
        jnp.int32(0),
        cache,
        pending,
        active,
        jnp.zeros((s, num_steps), jnp.int32),
        jnp.zeros((s, num_steps), jnp.float32),
        jnp.zeros((s,), jnp.int32),
        jnp.zeros((s,), bool),
        jnp.zeros((s,), bool),
        stops_lib.empty_window(s, stop_table),
        jnp.zeros((s,), bool),
    )
    out = jax.lax.while_loop(cond, body, init)
    _, cache, pending, _, out_tok, out_logp, count, eos_hit, ctx_hit, _, stop_hit = out
    return cache, pending, out_tok, out_logp, count, eos_hit, ctx_hit, stop_hit


@functools.partial(jax.jit, donate_argnames=("cache",))
def _fork(cache, src, dst):
    return fork_slots(cache, src, dst)


class Engine:
    """A pool of `num_slots` sequences of at most `max_len` tokens on one model.

    Host-side it mirrors each slot's length and pending token (both small), so
    scheduling decisions never wait on the device.
    """

    def __init__(
        self,
        model: Decoder,
        *,
        num_slots: int,
        max_len: int,
        eos_ids=(),
        stop_table: stops_lib.StopTable | None = None,
        min_chunk: int = 16,
    ):
        if num_slots <= 0 or max_len <= 1:
            raise ValueError(f"Engine needs num_slots > 0 and max_len > 1, got {num_slots}, {max_len}")
        self.graphdef, self.state = nnx.split(model)
        self.cfg = model.cfg
        self.num_slots, self.max_len, self.min_chunk = num_slots, max_len, min_chunk
        self.eos_ids = jnp.asarray(tuple(eos_ids) or (-1,), jnp.int32)
        self.stop_table = stop_table or stops_lib.make_stop_table([], (), vocab_size=1)
        self.cache = init_cache(model.cfg, num_slots, max_len)
        self.lengths = np.zeros(num_slots, np.int64)  # tokens in the cache (pending excluded)
        self.pending = np.full(num_slots, -1, np.int64)  # -1: slot holds no sequence

    def set_params(self, model_or_state) -> None:
        """Swaps in new weights (same graph), e.g. after a train step; no copy is made."""
        self.state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)

    def append(self, token_lists: dict[int, list[int]]) -> None:
        """Appends tokens to slots: `{slot: tokens}`; the last token becomes pending.

        A slot without a sequence starts one (prefill); otherwise its pending token is
        written first. Raises if a slot would overflow `max_len`.
        """
        writes: dict[int, list[int]] = {}
        for slot, toks in token_lists.items():
            toks = [int(t) for t in toks]
            if not toks:
                continue
            seq = ([] if self.pending[slot] < 0 else [int(self.pending[slot])]) + toks
            if self.lengths[slot] + len(seq) > self.max_len:
                raise ValueError(
                    f"slot {slot}: {self.lengths[slot]} + {len(seq)} tokens exceed max_len={self.max_len}"
                )
            writes[slot] = seq[:-1]
            self.pending[slot] = seq[-1]
        longest = max((len(w) for w in writes.values()), default=0)
        if longest == 0:
            return
        c = _bucket(longest, self.min_chunk, self.max_len)
        tokens = np.zeros((self.num_slots, c), np.int32)
        chunk_lens = np.zeros(self.num_slots, np.int32)
        for slot, w in writes.items():
            tokens[slot, : len(w)] = w
            chunk_lens[slot] = len(w)
            self.lengths[slot] += len(w)
        self.cache = _append(
            self.graphdef, self.state, self.cache, jnp.asarray(tokens), jnp.asarray(chunk_lens)
        )

    def decode(
        self,
        slots: list[int],
        *,
        max_new_tokens: int | np.ndarray,
        sampling: SamplingParams,
        keys: jax.Array,
        num_steps: int | None = None,
    ) -> DecodeResult:
        """Generates for `slots` until EOS, their per-slot budget, or a full slot.

        Args:
          slots: slots to decode (each must hold a sequence).
          max_new_tokens: per-slot budget (scalar or [S] over all slots).
          sampling: per-slot knobs over all S slots.
          keys: per-slot PRNG keys, [S].
          num_steps: decode steps of this call (default: the largest budget).
        """
        active = np.zeros(self.num_slots, bool)
        active[slots] = True
        if np.any(self.pending[active] < 0):
            raise ValueError(f"decode on empty slots {[s for s in slots if self.pending[s] < 0]}")
        budget = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (self.num_slots,)).copy()
        steps = int(num_steps or budget[active].max())
        steps = _bucket(steps, 1, 1 << 20)
        attend = _bucket(int(self.lengths[active].max()) + steps + 1, 128, self.max_len)
        out = _decode(
            self.graphdef,
            self.state,
            self.cache,
            jnp.asarray(np.maximum(self.pending, 0), jnp.int32),
            jnp.asarray(active),
            keys,
            sampling,
            jnp.asarray(budget),
            self.eos_ids,
            self.stop_table,
            num_steps=steps,
            attend_len=attend,
        )
        self.cache, pending, tok, logp, count, eos_hit, ctx_hit, stop_hit = out
        count = np.asarray(count)
        self.lengths += count  # each generated token wrote the previous pending one
        self.pending = np.where(active, np.asarray(pending), self.pending)
        return DecodeResult(
            tokens=np.asarray(tok),
            logprobs=np.asarray(logp),
            num_tokens=count,
            hit_eos=np.asarray(eos_hit),
            hit_stop=np.asarray(stop_hit),
            hit_context=np.asarray(ctx_hit),
        )

    def fork(self, src: list[int], dst: list[int]) -> None:
        """Copies slot src[i] into slot dst[i] (cache rows, length and pending token)."""
        if len(src) != len(dst):
            raise ValueError("fork: src and dst must have the same length")
        if not src:
            return
        n = _bucket(len(src), 8, 1 << 20)
        pad = self.num_slots  # out of range: dropped
        src_a = np.full(n, 0, np.int32)
        dst_a = np.full(n, pad, np.int32)
        src_a[: len(src)], dst_a[: len(dst)] = src, dst
        self.cache = _fork(self.cache, jnp.asarray(src_a), jnp.asarray(dst_a))
        self.lengths[dst] = self.lengths[src]
        self.pending[dst] = self.pending[src]

    def release(self, slots: list[int]) -> None:
        """Marks slots empty (their rows are simply overwritten by the next use)."""
        self.lengths[slots] = 0
        self.pending[slots] = -1
        lengths = np.asarray(self.cache.lengths).copy()
        lengths[slots] = 0
        self.cache = dataclasses.replace(self.cache, lengths=jnp.asarray(lengths, jnp.int32))

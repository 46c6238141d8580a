"""The rollout engine: jitted append / decode / fork over a pool of KV-cache slots.

Legend: S slots, B rows of one call (a compact batch of slots), C chunk tokens,
N decode steps, V vocab.

Pending-token invariant: a slot's cache holds every token of its sequence except the
last one, which is kept as the slot's *pending* token. Decoding then is uniform — each
step writes the pending token and samples the next — and appending an observation is
"write pending + observation[:-1], pending = observation[-1]". A branch can start from
any prefix of any live slot's sequence: copy the slot, cut its length to the prefix
minus one, and make the prefix's last token pending (`fork`). No logits are stored.

Calls run on a compact batch of B rows (B = the slots involved, rounded up to a power of
two), each row addressing its own slot, so idle slots (finished leaves kept for later
forks) cost nothing. Every operation is jitted once per shape bucket with the cache
donated, so the pool is updated in place.
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
from treegrpo_jax.native import Kernels, resolve
from treegrpo_jax.rollout import stops as stops_lib
from treegrpo_jax.rollout.sampling import SamplingParams, sample


class OutOfSlotsError(RuntimeError):
    """The pool has fewer free slots than requested."""


def _bucket(n: int, minimum: int, maximum: int | None = None) -> int:
    """Smallest power of two ≥ n (at least `minimum`, at most `maximum`)."""
    b = minimum
    while b < n:
        b *= 2
    return b if maximum is None else min(b, maximum)


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """Host-side result of one decode call; row i is `slots[i]` of the call."""

    slots: list[int]
    tokens: np.ndarray  # [B, N] int32, valid up to num_tokens[i]
    logprobs: np.ndarray  # [B, N] float32
    num_tokens: np.ndarray  # [B] int32
    hit_eos: np.ndarray  # [B] bool
    hit_stop: np.ndarray  # [B] bool: generation ended with a stop string
    hit_context: np.ndarray  # [B] bool: the slot is full

    def row(self, i: int) -> tuple[list[int], list[float]]:
        n = int(self.num_tokens[i])
        return self.tokens[i, :n].tolist(), self.logprobs[i, :n].tolist()


@dataclasses.dataclass
class EngineStats:
    """Token counters (cost accounting) since creation or the last `reset_stats`."""

    decoded_tokens: int = 0
    prefilled_tokens: int = 0  # tokens written by append (prompts, observations)
    forked_tokens: int = 0  # prefix tokens a branch got by copy instead of prefill
    decode_calls: int = 0
    append_calls: int = 0
    fork_calls: int = 0


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _append(graphdef, state, cache: KVCache, tokens, chunk_lens, slots):
    model = nnx.merge(graphdef, state)
    _, cache = model.append(tokens, chunk_lens, cache, slots=slots)
    return cache


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "num_steps", "attend_len", "rows_are_slots", "kernels"),
    donate_argnames=("cache",),
)
def _decode(
    graphdef,
    state,
    cache,
    slots,
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
    rows_are_slots=False,
    kernels=Kernels.XLA,
):
    model = nnx.merge(graphdef, state)
    b = pending.shape[0]
    # Row b decoding slot b (the whole pool, in order): attention reads the cache in place
    # instead of gathering every row's keys and values per layer and step.
    model_slots = None if rows_are_slots else slots
    row_slots = jnp.minimum(slots, cache.num_slots - 1)

    def cond(carry):
        step, _, _, active, *_ = carry
        return (step < num_steps) & jnp.any(active)

    def body(carry):
        step, cache, pending, active, out_tok, out_logp, count, eos_hit, ctx_hit, window, stop_hit = carry
        logits, cache = model.decode(
            pending, cache, active, slots=model_slots, attend_len=attend_len, kernels=kernels
        )
        lengths = cache.lengths[row_slots]
        # Fold the write position into the row's key: a row's stream depends only on its own
        # key and history, not on which other rows share the batch.
        step_keys = jax.vmap(jax.random.fold_in)(keys, lengths)
        tok, logp = sample(logits, step_keys, sampling, kernels=kernels)
        out_tok = out_tok.at[:, step].set(jnp.where(active, tok, 0))
        out_logp = out_logp.at[:, step].set(jnp.where(active, logp, 0.0))
        count = count + active
        pending = jnp.where(active, tok, pending)
        is_eos = active & jnp.isin(tok, eos_ids)
        window, is_stop = stops_lib.push(window, tok, stop_table)
        is_stop = active & is_stop & ~is_eos
        # The new pending token needs one free position to be written later.
        full = active & (lengths + 1 >= cache.max_len)
        eos_hit |= is_eos
        stop_hit |= is_stop
        ctx_hit |= full & ~is_eos & ~is_stop
        active = active & ~is_eos & ~is_stop & ~full & (count < budget)
        return step + 1, cache, pending, active, out_tok, out_logp, count, eos_hit, ctx_hit, window, stop_hit

    zeros_b = jnp.zeros((b,), bool)
    init = (
        jnp.int32(0),
        cache,
        pending,
        active,
        jnp.zeros((b, num_steps), jnp.int32),
        jnp.zeros((b, num_steps), jnp.float32),
        jnp.zeros((b,), jnp.int32),
        zeros_b,
        zeros_b,
        stops_lib.empty_window(b, stop_table),
        zeros_b,
    )
    out = jax.lax.while_loop(cond, body, init)
    _, cache, pending, _, out_tok, out_logp, count, eos_hit, ctx_hit, _, stop_hit = out
    return cache, pending, out_tok, out_logp, count, eos_hit, ctx_hit, stop_hit


@functools.partial(jax.jit, donate_argnames=("cache",))
def _fork(cache: KVCache, src, dst, lengths):
    return fork_slots(cache, src, dst, lengths)


class Engine:
    """A pool of `num_slots` sequences of at most `max_len` tokens on one model.

    Host-side it mirrors each slot's length and pending token (both small), so
    scheduling decisions never wait on the device. Slots are handed out by `allocate`
    and returned by `free`; running out is an explicit `OutOfSlotsError`.

    `kernels` picks decode attention and sampling: `auto` (the CPU kernels of
    `treegrpo_jax/native` on a CPU backend where they build, else XLA), `xla` or `native`.
    `kv_dtype` stores K/V as `float32` or `bfloat16` whatever the compute dtype (None: the
    compute dtype); attention reads them into f32.
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
        min_rows: int = 1,
        kernels: Kernels | str = Kernels.AUTO,
        kv_dtype: str | None = None,
    ):
        if num_slots <= 0 or max_len <= 1:
            raise ValueError(f"Engine needs num_slots > 0 and max_len > 1, got {num_slots}, {max_len}")
        # Decode attention and sampling: the CPU kernels where they run, else the XLA references.
        self.kernels = resolve(kernels)
        self.graphdef, self.state = nnx.split(model)
        self.cfg = model.cfg
        self.num_slots, self.max_len = num_slots, max_len
        self.min_chunk, self.min_rows = min_chunk, min_rows
        self.eos_ids = jnp.asarray(tuple(eos_ids) or (-1,), jnp.int32)
        self.stop_table = stop_table or stops_lib.make_stop_table([], (), vocab_size=1)
        # Stored K/V may be narrower than the compute dtype (bf16 halves an f32 model's cache
        # bytes); attention always reads it into f32.
        self.kv_dtype = jnp.dtype(kv_dtype or model.cfg.jnp_dtype)
        if self.kv_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(
                f"Engine: kv_dtype={kv_dtype!r}; allowed: float32, bfloat16 (or None: compute dtype)"
            )
        self.cache = init_cache(model.cfg, num_slots, max_len, dtype=self.kv_dtype)
        self.lengths = np.zeros(num_slots, np.int64)  # tokens in the cache (pending excluded)
        self.pending = np.full(num_slots, -1, np.int64)  # -1: slot holds no sequence
        self._free = list(range(num_slots))
        self._dirty: set[int] = set()  # freed slots whose device-side length is stale
        self.stats = EngineStats()

    # ------------------------------------------------------------------ slots
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Takes `n` free slots (lowest first); raises OutOfSlotsError if there are fewer."""
        if n > len(self._free):
            raise OutOfSlotsError(f"asked for {n} slots, {len(self._free)} of {self.num_slots} free")
        self._free.sort()
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def free(self, slots: list[int]) -> None:
        """Returns slots to the pool (their rows are overwritten by the next user)."""
        for s in slots:
            self.lengths[s], self.pending[s] = 0, -1
        self._free.extend(slots)
        # The device-side length is reset lazily: the next fork or append sets it.
        self._dirty |= set(slots)

    def set_params(self, model_or_state) -> None:
        """Swaps in new weights (same graph), e.g. after a train step; no copy is made."""
        self.state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)

    def reset_stats(self) -> EngineStats:
        old, self.stats = self.stats, EngineStats()
        return old

    def _rows(self, slots: list[int]) -> tuple[int, np.ndarray]:
        b = _bucket(len(slots), self.min_rows)
        rows = np.full(b, self.num_slots, np.int32)  # padding rows address no slot
        rows[: len(slots)] = slots
        return b, rows

    # ------------------------------------------------------------- operations
    def append(self, token_lists: dict[int, list[int]]) -> None:
        """Appends tokens to slots: `{slot: tokens}`; the last token becomes pending.

        A slot without a sequence starts one (prefill); otherwise its pending token is
        written first. Raises ValueError if a slot would overflow `max_len` (check
        `room(slot)` first to handle it).
        """
        writes: dict[int, list[int]] = {}
        for slot, toks in token_lists.items():
            toks = [int(t) for t in toks]
            if not toks:
                continue
            if slot in self._dirty:
                self._reset_device_lengths()
            seq = ([] if self.pending[slot] < 0 else [int(self.pending[slot])]) + toks
            if self.lengths[slot] + len(seq) > self.max_len:
                raise ValueError(
                    f"slot {slot}: {self.lengths[slot]} + {len(seq)} tokens exceed max_len={self.max_len}"
                )
            writes[slot] = seq[:-1]
            self.pending[slot] = seq[-1]
            self.stats.prefilled_tokens += len(toks)
        writes = {s: w for s, w in writes.items() if w}
        if not writes:
            return
        c = _bucket(max(len(w) for w in writes.values()), self.min_chunk, self.max_len)
        slots = list(writes)
        b, rows = self._rows(slots)
        tokens = np.zeros((b, c), np.int32)
        chunk_lens = np.zeros(b, np.int32)
        for i, slot in enumerate(slots):
            tokens[i, : len(writes[slot])] = writes[slot]
            chunk_lens[i] = len(writes[slot])
            self.lengths[slot] += len(writes[slot])
        self.cache = _append(
            self.graphdef,
            self.state,
            self.cache,
            jnp.asarray(tokens),
            jnp.asarray(chunk_lens),
            jnp.asarray(rows),
        )
        self.stats.append_calls += 1

    def room(self, slot: int) -> int:
        """Tokens that can still be appended to `slot` (pending token counted)."""
        used = self.lengths[slot] + (0 if self.pending[slot] < 0 else 1)
        return int(self.max_len - used)

    def decode(
        self,
        slots: list[int],
        *,
        max_new_tokens: int | list[int],
        sampling: SamplingParams,
        keys: jax.Array,
        num_steps: int | None = None,
    ) -> DecodeResult:
        """Generates for `slots` until EOS, a stop string, the budget, or a full slot.

        Args:
          slots: slots to decode (each must hold a sequence).
          max_new_tokens: budget per slot (scalar or one per slot in `slots`).
          sampling: knobs, one row per slot in `slots` (padded internally).
          keys: PRNG keys, one per slot in `slots`.
          num_steps: decode steps of this call (default: the largest budget).
        """
        if not slots:
            raise ValueError("decode needs at least one slot")
        if np.any(self.pending[slots] < 0):
            raise ValueError(f"decode on empty slots {[s for s in slots if self.pending[s] < 0]}")
        n = len(slots)
        b, rows = self._rows(slots)
        budget = np.zeros(b, np.int32)
        budget[:n] = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (n,))
        steps = _bucket(int(num_steps or budget.max()), 1)
        if self.kernels is Kernels.NATIVE:
            attend = self.max_len  # the kernel reads each row's live keys: one compile for all lengths
        else:  # the XLA path attends a static span: the power-of-two bucket of the longest row
            attend = _bucket(int(self.lengths[slots].max()) + steps + 1, 128, self.max_len)
        active = np.zeros(b, bool)
        active[:n] = True
        pending = np.zeros(b, np.int32)
        pending[:n] = self.pending[slots]
        pad = b - n
        sampling = jax.tree.map(
            lambda x: jnp.concatenate([x, jnp.repeat(x[:1], pad)]) if pad else x, sampling
        )
        keys = jnp.concatenate([keys, jnp.repeat(keys[:1], pad)]) if pad else keys
        out = _decode(
            self.graphdef,
            self.state,
            self.cache,
            jnp.asarray(rows),
            jnp.asarray(pending),
            jnp.asarray(active),
            keys,
            sampling,
            jnp.asarray(budget),
            self.eos_ids,
            self.stop_table,
            num_steps=steps,
            attend_len=attend,
            rows_are_slots=b == self.num_slots and bool(np.array_equal(rows, np.arange(b))),
            kernels=self.kernels,
        )
        self.cache, new_pending, tok, logp, count, eos_hit, ctx_hit, stop_hit = out
        count = np.asarray(count)[:n]
        self.lengths[slots] += count  # each generated token wrote the previous pending one
        self.pending[slots] = np.asarray(new_pending)[:n]
        self.stats.decoded_tokens += int(count.sum())
        self.stats.decode_calls += 1
        return DecodeResult(
            slots=list(slots),
            tokens=np.asarray(tok)[:n],
            logprobs=np.asarray(logp)[:n],
            num_tokens=count,
            hit_eos=np.asarray(eos_hit)[:n],
            hit_stop=np.asarray(stop_hit)[:n],
            hit_context=np.asarray(ctx_hit)[:n],
        )

    def fork(self, src: list[int], dst: list[int], prefix: list[list[int]] | None = None) -> None:
        """Starts slot dst[i] as a copy of slot src[i], optionally cut to a prefix.

        Args:
          src: source slots (holding sequences).
          dst: destination slots (allocated by the caller; their content is replaced).
          prefix: for each pair, the token ids of the wanted prefix of src's sequence (only
            its length and last token are used: the cache rows before it are shared).
            Default: the whole sequence of src.
        """
        if len(src) != len(dst) or (prefix is not None and len(prefix) != len(src)):
            raise ValueError("fork: src, dst (and prefix) must have the same length")
        if not src:
            return
        n = len(src)
        lengths = np.asarray([self.lengths[s] for s in src], np.int64)
        pending = np.asarray([self.pending[s] for s in src], np.int64)
        if prefix is not None:
            for i, p in enumerate(prefix):
                if not 0 < len(p) <= lengths[i] + 1:
                    raise ValueError(f"fork: prefix of {len(p)} tokens is not within slot {src[i]}")
                lengths[i], pending[i] = len(p) - 1, p[-1]
        b = _bucket(n, 8)
        src_a = np.zeros(b, np.int32)
        dst_a = np.full(b, self.num_slots, np.int32)
        len_a = np.zeros(b, np.int32)
        src_a[:n], dst_a[:n], len_a[:n] = src, dst, lengths
        self.cache = _fork(self.cache, jnp.asarray(src_a), jnp.asarray(dst_a), jnp.asarray(len_a))
        self.lengths[dst] = lengths
        self.pending[dst] = pending
        self._dirty -= set(dst)
        self.stats.forked_tokens += int(lengths.sum() + n)
        self.stats.fork_calls += 1

    def _reset_device_lengths(self) -> None:
        """Pushes the host lengths of freed slots to the device (before they are reused)."""
        self.cache = dataclasses.replace(self.cache, lengths=jnp.asarray(self.lengths, jnp.int32))
        self._dirty = set()

"""The rollout engine: jitted append / decode / fork over a pool of KV-cache sequences.

Legend: S slots, B rows of one call (a compact batch of slots), C chunk tokens,
N decode steps, V vocab.

Pending-token invariant: a slot's cache holds every token of its sequence except the
last one, which is kept as the slot's *pending* token. Decoding then is uniform — each
step writes the pending token and samples the next — and appending an observation is
"write pending + observation[:-1], pending = observation[-1]". A branch can start from
any prefix of any live slot's sequence: copy the slot, cut its length to the prefix
minus one, and make the prefix's last token pending (`fork`). No logits are stored.

Calls run on a compact batch of B rows (B = the slots involved, rounded up to 2^k or
3·2^(k-1)), each row addressing its own slot, so idle slots (finished leaves kept for later
forks) cost nothing. Every operation is jitted once per shape bucket with the cache
donated, so the pool is updated in place.

Two cache layouts behind one interface (`kv_layout`): `slots`, where every sequence reserves
`max_len` tokens and a fork copies a whole slot, and `paged`, where a sequence holds the pages
its tokens fill, a fork shares the prefix's full pages and copies only the partial last one,
and finished leaves keep only their unique tokens (`page_pool.py`). Slot ids are sequence ids
in both; with pages they are cheap (a page-table row), and memory is counted in pages.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Int

from treegrpo_jax._pytree import pytree_dataclass
from treegrpo_jax.model.cache import KVCache, copy_prefixes, init_cache
from treegrpo_jax.model.decoder import Decoder
from treegrpo_jax.model.paged_cache import PagedKVCache, copy_pages, init_paged_cache
from treegrpo_jax.native import Kernels, resolve
from treegrpo_jax.rollout import stops as stops_lib
from treegrpo_jax.rollout.page_pool import KV_LAYOUTS, OutOfSlotsError, PagePool
from treegrpo_jax.rollout.sampling import SamplingParams, sample

# Token ids as callers hold them: Python ints, NumPy integers, or an int array.
TokenIds = Sequence[int | np.integer] | Int[np.ndarray, " _n"]


def _device(x, dtype=None) -> jax.Array:
    """A host array on the device as a transfer: `jnp.asarray` of a NumPy array compiles a copy
    program per new shape (~17 ms each on this CPU, jax 0.10), which per-call shapes (row counts,
    token counts) paid again and again inside rollouts."""
    return jax.device_put(np.asarray(x, dtype))


def _pad_rows(x: np.ndarray, pad: int) -> jax.Array:
    """`x` with its first row repeated `pad` more times, on the device."""
    return _device(np.concatenate([x, np.repeat(x[:1], pad, axis=0)]) if pad else x)


def _row_bucket(n: int, minimum: int) -> int:
    """Smallest 2^k or 3·2^(k-1) ≥ n (at least `minimum`): at most a third of a call is padding.

    Every row of a decode call costs its matmuls whether it is live or not, so a pure
    power of two (up to half padding) wastes more than the extra compiles cost.
    """
    b = minimum
    while b < n:
        b *= 2
    three_quarters = 3 * b // 4
    return three_quarters if three_quarters >= max(n, minimum) and three_quarters * 4 == 3 * b else b


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
    entropies: np.ndarray  # [B, N] float32: the sampler's entropy at each generated token
    num_tokens: np.ndarray  # [B] int32
    hit_eos: np.ndarray  # [B] bool
    hit_stop: np.ndarray  # [B] bool: generation ended with a stop string
    hit_context: np.ndarray  # [B] bool: the slot is full
    steps: int = 0  # decode steps the call ran (every row of its bucket computed each one)

    def row(self, i: int) -> tuple[list[int], list[float], list[float]]:
        """Row i's (tokens, log-probs, entropies)."""
        n = int(self.num_tokens[i])
        return self.tokens[i, :n].tolist(), self.logprobs[i, :n].tolist(), self.entropies[i, :n].tolist()

    def ending(self, i: int) -> dict[str, bool]:
        """How row i stopped (all False: its budget or the call's steps ran out)."""
        return {
            "hit_eos": bool(self.hit_eos[i]),
            "hit_stop": bool(self.hit_stop[i]),
            "hit_context": bool(self.hit_context[i]),
        }


@dataclasses.dataclass
class EngineStats:
    """Token counters (cost accounting) since creation or the last `reset_stats`."""

    decoded_tokens: int = 0
    prefilled_tokens: int = 0  # tokens written by append (prompts, observations)
    forked_tokens: int = 0  # prefix tokens a branch got by copy instead of prefill
    decode_calls: int = 0
    decode_steps: int = 0  # loop iterations over all calls
    row_steps: int = 0  # rows computed: Σ batch width × steps (padding and stopped rows included)
    live_row_steps: int = 0  # Σ rows the caller asked for × steps (stopped rows included)
    append_calls: int = 0
    fork_calls: int = 0
    # Memory: K/V capacity held at the peak (slots × max_len, or pages × page size), in tokens.
    kv_peak_tokens: int = 0
    cow_pages: int = 0  # pages copied by copy-on-write at forks (paged)


@functools.partial(jax.jit, static_argnames=("graphdef", "attend_len"), donate_argnames=("cache",))
def _append(graphdef, state, cache: KVCache | PagedKVCache, tokens, chunk_lens, slots, *, attend_len):
    model = nnx.merge(graphdef, state)
    _, cache = model.append(tokens, chunk_lens, cache, slots=slots, attend_len=attend_len)
    return cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _prefill(graphdef, state, cache: KVCache | PagedKVCache, tokens, token_rows, row_start, slots):
    model = nnx.merge(graphdef, state)
    return model.prefill(tokens, token_rows, row_start, cache, slots=slots)


@pytree_dataclass
@dataclasses.dataclass(frozen=True)
class _DecodeCarry:
    """The decode loop's state; rows are the call's B rows."""

    step: jax.Array  # [] steps run
    row_steps: jax.Array  # [] rows computed, summed over steps (a shrunk batch counts its width)
    cache: KVCache | PagedKVCache | None  # None in the host copy read back after the call
    pending: jax.Array  # [B] the token each row writes next
    active: jax.Array  # [B] bool: still generating
    tokens: jax.Array  # [B, N] generated ids
    logprobs: jax.Array  # [B, N]
    entropies: jax.Array  # [B, N]
    count: jax.Array  # [B] tokens generated in this call
    eos_hit: jax.Array  # [B] bool
    ctx_hit: jax.Array  # [B] bool: the slot is full
    stop_hit: jax.Array  # [B] bool: a stop string ended the step
    window: jax.Array  # [B, W] uint8: each row's last generated bytes (stop matching)


@pytree_dataclass
@dataclasses.dataclass(frozen=True)
class _DecodeInputs:
    """One decode call's inputs (host arrays, padded to the call's B rows)."""

    slots: np.ndarray  # [B] each row's slot (padding rows: ≥ S)
    pending: np.ndarray  # [B] the token each row writes first
    active: np.ndarray  # [B] bool: a real row
    keys: jax.Array  # [B, 2] raw PRNG key words (`key_impl`), padded on the host
    sampling: SamplingParams  # one row each
    budget: np.ndarray  # [B] tokens each row may generate
    eos_ids: jax.Array  # [E]
    stop_table: stops_lib.StopTable
    window: np.ndarray  # [B, W] uint8: each row's stop-string window carried over
    exit_after: np.int32  # return once this many rows have stopped


@pytree_dataclass
@dataclasses.dataclass(frozen=True)
class _RowInputs:
    """What each row of a decode phase brings: its slot, key, knobs and budget."""

    slots: jax.Array  # [w]
    keys: jax.Array  # [w] typed PRNG keys
    sampling: SamplingParams
    budget: jax.Array  # [w]


_PER_ROW = ("pending", "active", "tokens", "logprobs", "entropies", "count", "eos_hit", "ctx_hit",
            "stop_hit", "window")  # fmt: skip


_FINE_MAX_ROWS = 64  # calls up to this wide step down through every width; wider ones halve


def _phase_widths(b: int, shrink_to: int) -> list[int]:
    """The call's row widths, from b down to at least `shrink_to` (0: never shrink).

    Up to `_FINE_MAX_ROWS` rows, every next smaller 2^k or 3·2^(k-1): a step is at most a third
    narrower, so an ended row rides along for at most a third of a phase (halving let it be half;
    the finer ladder cut a tree rollout's row-steps by 6 %). Wider calls halve: every phase traces
    the decode step once more (~0.8 s of compile each here), and a wide call (an evaluation's
    hundreds of rows) would take twice the phases for the same gain.
    """
    widths = [b]
    while shrink_to and widths[-1] > shrink_to:
        w = widths[-1]
        if b > _FINE_MAX_ROWS:
            smaller = w // 2 if w % 2 == 0 else 0
        else:
            power = 1 << ((w - 1).bit_length() - 1)  # the largest power of two below w
            smaller = 3 * power // 2 if power >= 2 and 3 * power // 2 < w else power
        if smaller < shrink_to or smaller == 0:
            break
        widths.append(smaller)
    return widths


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "num_steps",
        "attend_len",
        "rows_are_slots",
        "kernels",
        "key_impl",
        "shrink_to",
    ),  # fmt: skip
    donate_argnames=("cache",),
)
def _decode(
    graphdef,
    state,
    cache,
    inputs: _DecodeInputs,
    *,
    num_steps,
    attend_len,
    rows_are_slots=False,
    kernels=Kernels.XLA,
    key_impl="threefry2x32",
    shrink_to=0,
):
    """Up to `num_steps` decode steps over the call's rows.

    Rows that end stop emitting but would still be computed to the call's end: with `shrink_to`,
    once a phase's active rows fit the next narrower width (`_phase_widths`) they are gathered
    into a batch of that width (the others' results written back first), down to `shrink_to`
    rows, all in this one call. A row's tokens do not depend on which rows share its batch (its
    stream folds in its own key and position), so shrinking changes only the cost."""
    model = nnx.merge(graphdef, state)
    eos_ids, stop_table, exit_after = inputs.eos_ids, inputs.stop_table, inputs.exit_after
    b = inputs.slots.shape[0]
    live = jnp.sum(inputs.active)
    widths = _phase_widths(b, shrink_to)

    def run_phase(init: _DecodeCarry, rows: _RowInputs, width: int, next_width: int, in_place: bool):
        # next_width 0: the last phase, which runs to the call's end.
        # Row b decoding slot b (the whole pool, in order): attention reads the cache in place
        # instead of gathering every row's keys and values per layer and step.
        model_slots = None if in_place else rows.slots
        row_slots = jnp.minimum(rows.slots, init.cache.num_slots - 1)

        def cond(c: _DecodeCarry):
            # Early exit: once `exit_after` rows have stopped, the caller would rather take them
            # out of the batch (and put others in) than compute rows that emit nothing.
            running = jnp.sum(c.active)
            go = (c.step < num_steps) & (running > 0) & (live - running < exit_after)
            return go & (running > next_width)

        def body(c: _DecodeCarry):
            logits, cache = model.decode(
                c.pending, c.cache, c.active, slots=model_slots, attend_len=attend_len, kernels=kernels
            )
            lengths = cache.lengths[row_slots]
            # Fold the write position into the row's key: a row's stream depends only on its own
            # key and history, not on which other rows share the batch or how a step is split
            # into calls.
            step_keys = jax.vmap(jax.random.fold_in)(rows.keys, lengths)
            tok, logp, ent = sample(logits, step_keys, rows.sampling, kernels=kernels)
            active = c.active
            count = c.count + active
            is_eos = active & jnp.isin(tok, eos_ids)
            window, is_stop = stops_lib.push(c.window, tok, stop_table)
            window = jnp.where(active[:, None], window, c.window)
            is_stop = active & is_stop & ~is_eos
            # The new pending token needs one free position to be written later.
            full = active & (lengths + 1 >= cache.max_len)
            return _DecodeCarry(
                step=c.step + 1,
                row_steps=c.row_steps + width,
                cache=cache,
                pending=jnp.where(active, tok, c.pending),
                active=active & ~is_eos & ~is_stop & ~full & (count < rows.budget),
                tokens=c.tokens.at[:, c.step].set(jnp.where(active, tok, 0)),
                logprobs=c.logprobs.at[:, c.step].set(jnp.where(active, logp, 0.0)),
                entropies=c.entropies.at[:, c.step].set(jnp.where(active, ent, 0.0)),
                count=count,
                eos_hit=c.eos_hit | is_eos,
                ctx_hit=c.ctx_hit | (full & ~is_eos & ~is_stop),
                stop_hit=c.stop_hit | is_stop,
                window=window,
            )

        return jax.lax.while_loop(cond, body, init)

    zeros_b = jnp.zeros((b,), bool)
    carry = _DecodeCarry(
        step=jnp.int32(0),
        row_steps=jnp.int32(0),
        cache=cache,
        pending=inputs.pending,
        active=inputs.active,
        tokens=jnp.zeros((b, num_steps), jnp.int32),
        logprobs=jnp.zeros((b, num_steps), jnp.float32),
        entropies=jnp.zeros((b, num_steps), jnp.float32),
        count=jnp.zeros((b,), jnp.int32),
        eos_hit=zeros_b,
        ctx_hit=zeros_b,
        stop_hit=zeros_b,
        window=inputs.window,
    )
    keys = jax.random.wrap_key_data(inputs.keys, impl=key_impl)  # raw words in: padded on the host
    rows = _RowInputs(slots=inputs.slots, keys=keys, sampling=inputs.sampling, budget=inputs.budget)
    if len(widths) == 1:
        return run_phase(carry, rows, b, 0, rows_are_slots)
    out, where = carry, jnp.arange(b)  # full-width results; which full row each phase row is
    for k, width in enumerate(widths):
        next_width = widths[k + 1] if k + 1 < len(widths) else 0
        carry = run_phase(carry, rows, width, next_width, rows_are_slots and k == 0)
        out = dataclasses.replace(
            out,
            step=carry.step,
            row_steps=carry.row_steps,
            cache=carry.cache,
            **{f: getattr(out, f).at[where].set(getattr(carry, f)) for f in _PER_ROW},
        )
        if k + 1 < len(widths):  # the active rows first (stable), then enough ended ones to fill
            keep = jnp.argsort(~carry.active, stable=True)[: widths[k + 1]]
            carry = dataclasses.replace(carry, **{f: getattr(carry, f)[keep] for f in _PER_ROW})
            rows = jax.tree.map(lambda x, keep=keep: x[keep], rows)
            where = where[keep]
    return out


@functools.partial(jax.jit, donate_argnames=("cache",))
def _fork(cache: KVCache, src, dst, lengths):
    return copy_prefixes(cache, src, dst, lengths)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _fork_paged(cache: PagedKVCache, page_table, src_pages, dst_pages, dst, lengths):
    cache = copy_pages(cache, src_pages, dst_pages)
    return dataclasses.replace(
        cache, page_table=page_table, lengths=cache.lengths.at[dst].set(lengths, mode="drop")
    )


class Engine:
    """A pool of `num_slots` sequences of at most `max_len` tokens on one model.

    Host-side it mirrors each slot's length and pending token (both small), so
    scheduling decisions never wait on the device. Slots are handed out by `allocate`
    and returned by `free`; running out is an explicit `OutOfSlotsError`.

    `kernels` picks decode attention and sampling: `auto` (the CPU kernels of
    `treegrpo_jax/native` on a CPU backend where they build, else XLA), `xla` or `native`.
    `kv_dtype` stores K/V as `float32` or `bfloat16` whatever the compute dtype (None: the
    compute dtype); attention reads them into f32.

    `kv_layout="paged"` stores K/V in `num_pages` pages of `page_size` tokens (default: the
    slot layout's memory) and `num_slots` is then only the number of sequences at once:
    append, decode and fork take the pages they need and raise `OutOfPagesError` (changing
    nothing) when the pool is short — `decode_pages_needed` / `pages_needed` say how many
    beforehand, so a scheduler can wait for pages instead.

    `shrink_to`: inside a decode call, once the rows still generating fit the next narrower
    width (up to 64 rows: the next 2^k or 3·2^(k-1), at most a third narrower; wider calls:
    half), they go on at that width, down to `shrink_to` rows (0: rows stay to the call's end).
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
        kv_layout: str = "slots",
        page_size: int = 16,
        num_pages: int | None = None,
        shrink_to: int = 8,
    ):
        if num_slots <= 0 or max_len <= 1:
            raise ValueError(f"Engine needs num_slots > 0 and max_len > 1, got {num_slots}, {max_len}")
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"Engine: kv_layout={kv_layout!r}; allowed: {list(KV_LAYOUTS)}")
        if kv_layout == "paged" and (page_size < 1 or page_size & (page_size - 1) or page_size > 128):
            raise ValueError(f"Engine: page_size must be a power of two in [1, 128], got {page_size!r}")
        # Decode attention and sampling: the CPU kernels where they run, else the XLA references.
        self.kernels = resolve(kernels)
        self.graphdef, self.state = nnx.split(model)
        self.cfg = model.cfg
        self.num_slots, self.max_len = num_slots, max_len
        self.min_chunk, self.min_rows = min_chunk, min_rows
        if isinstance(shrink_to, bool) or not isinstance(shrink_to, int) or shrink_to < 0:
            raise ValueError(f"Engine: shrink_to must be an int ≥ 0 (0: never shrink), got {shrink_to!r}")
        self.shrink_to = shrink_to
        self.eos_ids = jnp.asarray(tuple(eos_ids) or (-1,), jnp.int32)
        self.stop_table = stop_table or stops_lib.make_stop_table([], (), vocab_size=1)
        # Stored K/V may be narrower than the compute dtype (bf16 halves an f32 model's cache
        # bytes); attention always reads it into f32.
        self.kv_dtype = jnp.dtype(kv_dtype or model.cfg.jnp_dtype)
        if self.kv_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(
                f"Engine: kv_dtype={kv_dtype!r}; allowed: float32, bfloat16 (or None: compute dtype)"
            )
        self.paged = kv_layout == "paged"
        if self.paged:
            max_len = -(-max_len // page_size) * page_size  # whole pages
            self.max_len = max_len
            # Default: the slot layout's memory, which the paged one spends on live tokens only.
            num_pages = num_pages or num_slots * max_len // page_size
            self.pool: PagePool | None = PagePool(
                num_pages=num_pages,
                num_slots=num_slots,
                pages_per_seq=max_len // page_size,
                page_size=page_size,
            )
            self._num_pages, self._page_size = num_pages, page_size
        else:
            self.pool = None
        self._cache = self._new_cache()
        # K/V bytes of one token (all layers, K and V): what a page or slot costs per position.
        self.kv_bytes_per_token = 2 * model.cfg.num_layers * model.cfg.num_kv_heads * model.cfg.head_dim
        self.kv_bytes_per_token *= self.kv_dtype.itemsize
        self._peak_slots = 0
        self.lengths = np.zeros(num_slots, np.int64)  # tokens in the cache (pending excluded)
        self.pending = np.full(num_slots, -1, np.int64)  # -1: slot holds no sequence
        self._free = list(range(num_slots))
        self._stale_lengths: set[int] = set()  # freed slots whose device-side length is stale
        # Each slot's last generated bytes: a step split over several decode calls matches
        # stop strings across the calls. A new step (after `append` or `fork`) starts empty.
        self.windows = np.zeros((num_slots, self.stop_table.width), np.uint8)
        self.stats = EngineStats()

    # ------------------------------------------------------------------ K/V pool
    def _new_cache(self) -> KVCache | PagedKVCache:
        if self.paged:
            return init_paged_cache(
                self.cfg,
                num_slots=self.num_slots,
                max_len=self.max_len,
                num_pages=self._num_pages,
                page_size=self._page_size,
                dtype=self.kv_dtype,
            )
        return init_cache(self.cfg, self.num_slots, self.max_len, dtype=self.kv_dtype)

    @property
    def cache(self) -> KVCache | PagedKVCache:
        """The device K/V pool; made again (empty) on first use after `release_kv`."""
        if self._cache is None:
            self._cache = self._new_cache()
            self._stale_lengths = set()  # every device length is 0 again, as the host's free slots
            if self.pool:
                self.pool.table_changed = True  # the new pool's page table is pushed before use
        return self._cache

    @cache.setter
    def cache(self, value: KVCache | PagedKVCache) -> None:
        self._cache = value

    def release_kv(self) -> None:
        """Frees the K/V pool's device memory until the engine's next call, when every slot is free
        (between rollouts): the train step can then use that memory, which on an accelerator is
        as much as the step's own (docs/tpu.md). Does nothing while a slot holds a sequence."""
        if self._cache is None or self.num_free < self.num_slots:
            return
        for x in jax.tree.leaves(self._cache):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        self._cache = None

    # ------------------------------------------------------------------ slots
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_pages(self) -> int:
        """Pages not held by any sequence (paged); the slot layout has none to count."""
        return self.pool.num_free if self.pool else 0

    def kv_capacity_tokens(self) -> int:
        """K/V positions the pool can hold in all (slots × max_len, or pages × page size)."""
        return self.pool.num_pages * self.pool.page_size if self.pool else self.num_slots * self.max_len

    def kv_held_tokens(self) -> int:
        """K/V positions held now by sequences (a slot holds max_len; a page its size)."""
        if self.pool:
            return self.pool.in_use * self.pool.page_size
        return (self.num_slots - len(self._free)) * self.max_len

    def pages_needed(self, tokens: dict[int, int]) -> int:
        """New pages the slots need to hold their first `tokens[slot]` positions (0: slots)."""
        return sum(self.pool.need(s, t) for s, t in tokens.items()) if self.pool else 0

    def fork_pages_needed(self, prefix_lengths) -> int:
        """Free pages `fork` takes for prefixes of these token counts (pending token included;
        0 for the slot layout): the copy-on-write page of each prefix that ends inside a page."""
        return self.pool.copies_for_fork(int(n) - 1 for n in prefix_lengths) if self.pool else 0

    def pages_held(self, slots) -> int:
        """Distinct pages the sequences in `slots` hold (0 for the slot layout)."""
        return self.pool.distinct_held(slots) if self.pool else 0

    def decode_pages_needed(self, slots: list[int], steps: int, budgets) -> int:
        """Pages a `decode(slots, num_steps=steps, max_new_tokens=budgets)` call would take."""
        budgets = np.broadcast_to(np.asarray(budgets), (len(slots),))
        steps = _bucket(steps, 1)  # as `decode` rounds it
        return self.pages_needed(
            {s: int(self.lengths[s]) + min(steps, int(b)) for s, b in zip(slots, budgets, strict=True)}
        )

    def allocate(self, n: int) -> list[int]:
        """Takes `n` free slots (lowest first); raises OutOfSlotsError if there are fewer."""
        if n > len(self._free):
            raise OutOfSlotsError(f"asked for {n} slots, {len(self._free)} of {self.num_slots} free")
        self._free.sort()
        taken, self._free = self._free[:n], self._free[n:]
        self._peak_slots = max(self._peak_slots, self.num_slots - len(self._free))
        return taken

    def free(self, slots: list[int]) -> None:
        """Returns slots to the pool (their rows are overwritten by the next user); with pages,
        drops their references (a page shared with a live branch stays)."""
        for s in slots:
            self.lengths[s], self.pending[s] = 0, -1
            if self.pool:
                self.pool.free(s)
        self._free.extend(slots)
        # The device-side length is reset lazily: the next fork or append sets it.
        self._stale_lengths |= set(slots)

    def set_params(self, model_or_state) -> None:
        """Swaps in new weights (same graph), e.g. after a train step; no copy is made."""
        self.state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)

    def reset_stats(self) -> EngineStats:
        old, self.stats = self.stats, EngineStats()
        if self.pool:
            old.kv_peak_tokens, old.cow_pages = self.pool.peak * self.pool.page_size, self.pool.copied
            self.pool.reset_peak()
        else:
            old.kv_peak_tokens = self._peak_slots * self.max_len
            self._peak_slots = self.num_slots - len(self._free)
        return old

    def peek_stats(self) -> EngineStats:
        """The counters so far, memory figures included, without resetting them."""
        out = dataclasses.replace(self.stats)
        if self.pool:
            out.kv_peak_tokens, out.cow_pages = self.pool.peak * self.pool.page_size, self.pool.copied
        else:
            out.kv_peak_tokens = self._peak_slots * self.max_len
        return out

    def _push_pages(self) -> None:
        """The host page table to the device, when it changed."""
        if self.pool and self.pool.table_changed:
            self.cache = dataclasses.replace(self.cache, page_table=_device(self.pool.table))
            self.pool.table_changed = False

    def _rows(self, slots: list[int]) -> tuple[int, np.ndarray]:
        b = _row_bucket(len(slots), self.min_rows)
        rows = np.full(b, self.num_slots, np.int32)  # padding rows address no slot
        rows[: len(slots)] = slots
        return b, rows

    # ------------------------------------------------------------- operations
    def append(self, token_lists: dict[int, TokenIds]) -> None:
        """Appends tokens to slots: `{slot: tokens}`; the last token becomes pending.

        A slot without a sequence starts one (prefill); otherwise its pending token is
        written first. Raises ValueError if a slot would overflow `max_len` (check
        `room(slot)` first to handle it).
        """
        seqs: dict[int, list[int]] = {}
        for slot, toks in token_lists.items():  # check everything before changing anything
            toks = [int(t) for t in toks]
            if not toks:
                continue
            seq = ([] if self.pending[slot] < 0 else [int(self.pending[slot])]) + toks
            if self.lengths[slot] + len(seq) > self.max_len:
                raise ValueError(
                    f"slot {slot}: {self.lengths[slot]} + {len(seq)} tokens exceed max_len={self.max_len}"
                )
            seqs[slot] = seq
        if self.pool:  # pages for what is written (raises OutOfPagesError, changing nothing)
            self.pool.grow({s: int(self.lengths[s]) + len(q) - 1 for s, q in seqs.items()})
        writes: dict[int, list[int]] = {}
        for slot, seq in seqs.items():
            if slot in self._stale_lengths:
                self._reset_device_lengths()
            writes[slot] = seq[:-1]
            self.pending[slot] = seq[-1]
            self.windows[slot] = 0
            self.stats.prefilled_tokens += len(token_lists[slot])
        writes = {s: w for s, w in writes.items() if w}
        if not writes:
            return
        self.stats.append_calls += 1
        if self.kernels is Kernels.NATIVE:
            self._prefill_flat(writes)
            return
        c = min(_row_bucket(max(len(w) for w in writes.values()), self.min_chunk), self.max_len)
        slots = list(writes)
        b, rows = self._rows(slots)
        # Attend only the span the longest row reaches (a power-of-two bucket), not the whole
        # slot: prefill attention and its key gathers cost rows × chunk × span (measured: most
        # of a `:tiny` rollout's time went to appends over the full 768-token span).
        reach = max(int(self.lengths[s]) + len(writes[s]) for s in slots)
        attend = _bucket(reach, 128, self.max_len)
        tokens = np.zeros((b, c), np.int32)
        chunk_lens = np.zeros(b, np.int32)
        for i, slot in enumerate(slots):
            tokens[i, : len(writes[slot])] = writes[slot]
            chunk_lens[i] = len(writes[slot])
            self.lengths[slot] += len(writes[slot])
        self._push_pages()
        self.cache = _append(
            self.graphdef,
            self.state,
            self.cache,
            _device(tokens),
            _device(chunk_lens),
            _device(rows),
            attend_len=attend,
        )

    def _prefill_flat(self, writes: dict[int, list[int]]) -> None:
        """`append`'s CPU path: every row's chunk concatenated (no chunk padding), one kernel
        call per layer that reads each row's live keys in place. Tokens are bucketed to
        2^k or 3·2^(k-1) (at least 64) and the row arrays always have one entry per slot (rows
        without tokens cost nothing in the kernel), so the token count is the only shape: a
        rollout compiles a handful of programs, not one per (rows, tokens) pair (measured: each
        new pair cost ~0.85 s of compile, more than a whole rollout's appends)."""
        slots = list(writes)
        r = self.num_slots
        rows = np.full(r, self.num_slots, np.int32)  # padding rows address no slot
        rows[: len(slots)] = slots
        lens = np.zeros(r, np.int64)
        lens[: len(slots)] = [len(writes[s]) for s in slots]
        row_start = np.zeros(r + 1, np.int32)
        row_start[1:] = np.cumsum(lens)
        total = int(row_start[-1])
        n = _row_bucket(total, 64)
        tokens = np.zeros(n, np.int32)
        tokens[:total] = np.concatenate([writes[s] for s in slots])
        token_rows = np.full(n, len(slots) - 1, np.int32)  # padding tokens: any real row (ignored)
        token_rows[:total] = np.repeat(np.arange(r, dtype=np.int32), lens)
        for s in slots:
            self.lengths[s] += len(writes[s])
        self._push_pages()
        self.cache = _prefill(
            self.graphdef,
            self.state,
            self.cache,
            _device(tokens),
            _device(token_rows),
            _device(row_start),
            _device(rows),
        )

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
        keys: jax.Array | np.ndarray,
        num_steps: int | None = None,
        exit_after: int | None = None,
    ) -> DecodeResult:
        """Generates for `slots` until EOS, a stop string, the budget, or a full slot.

        A step may span several calls (a scheduler's quanta): each slot's stop-string window
        carries over from its previous call until `append` or `fork` starts a new step, and
        the sampler's stream depends only on a row's key and write position, so the tokens
        are the same however the step is split.

        Args:
          slots: slots to decode (each must hold a sequence).
          max_new_tokens: budget per slot (scalar or one per slot in `slots`).
          sampling: knobs, one row per slot in `slots` (padded internally).
          keys: PRNG keys, one per slot in `slots`: a typed key array, or their raw words as a
            host array (`jax.random.key_data`, uint32 [n, 2] for threefry) — the rollout
            drivers pass those, so a call dispatches no per-shape eager ops.
          num_steps: decode steps of this call at most (default: the largest budget).
          exit_after: return as soon as this many rows have stopped (default: all of them).
        """
        inputs, static = self._decode_inputs(slots, max_new_tokens, sampling, keys, num_steps, exit_after)
        out = _decode(self.graphdef, self.state, self.cache, inputs, **static)
        self.cache = out.cache
        return self._commit_decode(slots, jax.device_get(dataclasses.replace(out, cache=None)))

    def _decode_inputs(
        self, slots, max_new_tokens, sampling, keys, num_steps, exit_after
    ) -> tuple[_DecodeInputs, dict]:
        """`decode`'s padded host inputs and static arguments; reserves the call's pages."""
        if not slots:
            raise ValueError("decode needs at least one slot")
        if np.any(self.pending[slots] < 0):
            raise ValueError(f"decode on empty slots {[s for s in slots if self.pending[s] < 0]}")
        n = len(slots)
        b, rows = self._rows(slots)
        budget = np.zeros(b, np.int32)
        budget[:n] = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (n,))
        steps = _bucket(int(num_steps or budget.max()), 1)
        if self.kernels is Kernels.NATIVE or (self.kernels is Kernels.PALLAS and self.paged):
            attend = self.max_len  # the kernel reads each row's live keys: one compile for all lengths
        else:  # the XLA path attends a static span: the power-of-two bucket of the longest row
            attend = _bucket(int(self.lengths[slots].max()) + steps + 1, 128, self.max_len)
        active = np.zeros(b, bool)
        active[:n] = True
        pending = np.zeros(b, np.int32)
        pending[:n] = self.pending[slots]
        # Padding on the host: eager jnp ops here would compile once per row count.
        pad = b - n
        sampling = jax.tree.map(lambda x: _pad_rows(np.asarray(x), pad), jax.device_get(sampling))
        if isinstance(keys, jax.Array) and jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
            key_impl = str(jax.random.key_impl(keys))
            keys = np.asarray(jax.random.key_data(keys))
        else:
            key_impl = "threefry2x32"
        window = np.zeros((b, self.windows.shape[1]), np.uint8)
        window[:n] = self.windows[slots]
        if self.pool:  # pages for every position the call may write (OutOfPagesError: nothing changed)
            reach = {s: int(self.lengths[s]) + min(steps, int(budget[i])) for i, s in enumerate(slots)}
            self.pool.grow(reach)
            self._push_pages()
        inputs = _DecodeInputs(
            slots=rows,
            pending=pending,
            active=active,
            keys=_pad_rows(np.asarray(keys, np.uint32), pad),
            sampling=sampling,
            budget=budget,
            eos_ids=self.eos_ids,
            stop_table=self.stop_table,
            window=window,
            exit_after=np.int32(n if exit_after is None else max(1, min(exit_after, n))),
        )
        static = dict(
            num_steps=steps,
            attend_len=attend,
            rows_are_slots=b == self.num_slots and bool(np.array_equal(rows, np.arange(b))),
            kernels=self.kernels,
            key_impl=key_impl,
            shrink_to=self.shrink_to,
        )
        return inputs, static

    def _commit_decode(self, slots: list[int], host: _DecodeCarry) -> DecodeResult:
        """Takes a finished call's host-side carry into the engine's state and its stats."""
        n = len(slots)
        count, ran = host.count[:n], int(host.step)
        self.lengths[slots] += count  # each generated token wrote the previous pending one
        self.pending[slots] = host.pending[:n]
        self.windows[slots] = host.window[:n]
        if self.pool:  # hand back the pages a row reserved but did not reach (its pending one kept)
            for s in slots:
                self.pool.trim(s, int(self.lengths[s]) + 1)
        self.stats.decoded_tokens += int(count.sum())
        self.stats.decode_calls += 1
        self.stats.decode_steps += ran
        self.stats.row_steps += int(host.row_steps)
        self.stats.live_row_steps += n * ran
        return DecodeResult(
            slots=list(slots),
            tokens=host.tokens[:n],
            logprobs=host.logprobs[:n],
            entropies=host.entropies[:n],
            num_tokens=count,
            hit_eos=host.eos_hit[:n],
            hit_stop=host.stop_hit[:n],
            hit_context=host.ctx_hit[:n],
            steps=ran,
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
        if set(src) & set(dst) or len(set(dst)) < len(dst):
            # Pairs are copied in turn: a dst read by a later pair would pass on its new prefix.
            raise ValueError(f"fork: a slot is a destination twice or also a source: src={src}, dst={dst}")
        n = len(src)
        lengths = np.asarray([self.lengths[s] for s in src], np.int64)
        pending = np.asarray([self.pending[s] for s in src], np.int64)
        if prefix is not None:
            for i, p in enumerate(prefix):
                if not 0 < len(p) <= lengths[i] + 1:
                    raise ValueError(f"fork: prefix of {len(p)} tokens is not within slot {src[i]}")
                lengths[i], pending[i] = len(p) - 1, p[-1]
        if self.pool:
            # Shares the full pages of each prefix, copies its partial last page (raises
            # OutOfPagesError before changing anything).
            copy_src, copy_dst = self.pool.fork(list(src), list(dst), [int(x) for x in lengths])
            m = _bucket(max(1, len(copy_src)), 8)
            cs = np.zeros(m, np.int32)
            cd = np.full(m, self.pool.num_pages, np.int32)  # padding pairs copy nothing
            cs[: len(copy_src)], cd[: len(copy_dst)] = copy_src, copy_dst
            b = _bucket(n, 8)
            dst_a = np.full(b, self.num_slots, np.int32)
            len_a = np.zeros(b, np.int32)
            dst_a[:n], len_a[:n] = dst, lengths
            self.cache = _fork_paged(
                self.cache,
                _device(self.pool.table),
                _device(cs),
                _device(cd),
                _device(dst_a),
                _device(len_a),
            )
            self.pool.table_changed = False
        else:
            b = _bucket(n, 8)
            src_a = np.zeros(b, np.int32)
            dst_a = np.full(b, self.num_slots, np.int32)
            len_a = np.zeros(b, np.int32)
            src_a[:n], dst_a[:n], len_a[:n] = src, dst, lengths
            # Each pair copies its own live prefix only, in place (`copy_prefixes`).
            self.cache = _fork(self.cache, _device(src_a), _device(dst_a), _device(len_a))
        self.lengths[dst] = lengths
        self.pending[dst] = pending
        self.windows[dst] = 0
        self._stale_lengths -= set(dst)
        self.stats.forked_tokens += int(lengths.sum() + n)
        self.stats.fork_calls += 1

    def rewind(self, slots: list[int], lengths) -> None:
        """Cuts each slot's sequence back to its first `lengths[i]` cache positions, keeping its
        pending token (what a benchmark needs to decode the same span again); pages past the
        cut go back to the pool."""
        for s, n in zip(slots, lengths, strict=True):
            if not 0 <= int(n) <= self.lengths[s] or self.pending[s] < 0:
                raise ValueError(f"rewind: slot {s} holds {self.lengths[s]} positions, asked for {n}")
            self.lengths[s] = int(n)
            if self.pool:
                self.pool.trim(s, int(n) + 1)
        self._reset_device_lengths()

    def _reset_device_lengths(self) -> None:
        """Pushes the host lengths of freed slots to the device (before they are reused)."""
        self.cache = dataclasses.replace(self.cache, lengths=_device(self.lengths, np.int32))
        self._stale_lengths = set()


def lower_calls(
    graphdef,
    state,
    cache: KVCache | PagedKVCache,
    *,
    rows: int,
    num_steps: int,
    chunk: int,
    attend_len: int,
    stop_table: stops_lib.StopTable,
    kernels: Kernels = Kernels.XLA,
    shrink_to: int = 8,
) -> dict[str, jax.stages.Lowered]:
    """The engine's programs lowered for `rows` rows, without running or allocating anything.

    What a compile for a target needs (`treegrpo_jax.aot`): `state` and `cache` may be
    `ShapeDtypeStruct` trees carrying their shardings. `decode` runs `num_steps` steps attending
    `attend_len` positions and shrinks as `Engine` does; `append` writes `chunk` tokens per row;
    `fork` copies `rows` prefixes (the slot layout; the paged layout's fork copies pages).
    """
    s, n = cache.lengths.shape[0], rows
    slots = np.arange(n, dtype=np.int32) % s
    window = np.zeros((n, stop_table.width), np.uint8)
    sampling = jax.tree.map(np.asarray, SamplingParams.make(n, temperature=1.0))
    inputs = _DecodeInputs(
        slots=slots,
        pending=np.zeros(n, np.int32),
        active=np.ones(n, bool),
        keys=np.zeros((n, 2), np.uint32),
        sampling=sampling,
        budget=np.full(n, num_steps, np.int32),
        eos_ids=np.zeros(1, np.int32),
        stop_table=jax.tree.map(np.asarray, stop_table),
        window=window,
        exit_after=np.int32(n),
    )
    static = dict(num_steps=num_steps, attend_len=attend_len, kernels=kernels, shrink_to=shrink_to)
    out = {"decode": _decode.lower(graphdef, state, cache, inputs, **static)}
    tokens, lens = np.zeros((n, chunk), np.int32), np.full(n, chunk, np.int32)
    out["append"] = _append.lower(graphdef, state, cache, tokens, lens, slots, attend_len=attend_len)
    if isinstance(cache, KVCache):
        out["fork"] = _fork.lower(cache, slots, (slots + 1) % s, np.full(n, attend_len - 1, np.int32))
    return out

"""Flax NNX decoder for the Llama / Qwen2 family (SmolLM2 is a Llama).

Legend: B rows, T query tokens, C chunk tokens, S cache slots (row b of a cached call writes slot `slots[b]`),
U key tokens, E embed, F mlp, H query heads, K kv heads, G = H/K heads per kv head,
D head dim, V vocab, L layers.

Layers are stored stacked (every layer parameter has a leading L axis) and run under
`jax.lax.scan`, so compile time does not grow with depth and a KV cache is one array
per K and V. Matmuls run in `cfg.dtype`; RMSNorm, softmax, RoPE and logits are f32.

Four entry points:
  * `__call__(tokens, positions, mask)`: full-sequence forward with explicit positions
    and a [B, T, T] attention mask (so packed and tree-shaped batches are possible), a
    block-sparse `BlockMask` (`block_attention.py`) that skips the key blocks it does not list,
    or a `CausalMask` (left-aligned causal rows: the fused kernel, `causal_attention.py`);
  * `append(tokens, chunk_lens, cache)`: write a ragged chunk into every slot at the
    slot's own offset and return logits (prefill, observations, and — with C=1 — decode);
  * `prefill(tokens, token_rows, row_start, cache, slots=...)`: flat ragged chunks written with
    the CPU prefill kernel (no padding, live keys only, no logits);
  * `decode(tokens, cache, active)`: one token per slot, convenience over `append`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from treegrpo_jax.model import rope
from treegrpo_jax.model.block_attention import BlockMask, block_sparse_attention
from treegrpo_jax.model.cache import KVCache
from treegrpo_jax.model.causal_attention import CausalMask, causal_attention
from treegrpo_jax.model.causal_attention import implementation as causal_implementation
from treegrpo_jax.model.config import ModelConfig, Remat
from treegrpo_jax.model.paged_cache import PagedKVCache
from treegrpo_jax.native import Kernels

# Under `lax.scan` the layer is recomputed once in the backward pass (prevent_cse is not needed
# inside a scan, and leaving it on blocks fusions).
_REMAT_POLICIES = {
    Remat.LAYER: jax.checkpoint_policies.nothing_saveable,
    Remat.DOTS: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

_NEG_INF = -1e30  # finite: a row that sees nothing (padding) must not produce NaNs


def mask_bias(mask: Bool[ArrayLike, "..."]) -> Float[Array, "..."]:
    """0 where attention is allowed, `_NEG_INF` where not (added to the scores).

    Exactly the select it replaces: scores are far below the spacing of f32 values near 1e30,
    so a hidden score becomes `_NEG_INF` itself.
    """
    return jnp.where(mask, 0.0, _NEG_INF).astype(jnp.float32)


def _linear(x: ArrayLike, w: ArrayLike) -> Array:
    """`x[..., I] @ w[I, ...]` as one 2-D matmul.

    XLA:CPU runs the backward of a rank-3 einsum ("bte,ehd->bthd") through transposes of the
    activations that cost more than the matmuls; flattening both sides avoids them (the
    training step runs ~1.5x faster on CPU), and on TPU/GPU it is the same dot.
    """
    lead, out = x.shape[:-1], w.shape[1:]
    y = x.reshape(-1, x.shape[-1]) @ w.reshape(w.shape[0], -1)
    return y.reshape(*lead, *out)


def _rms_norm(x: ArrayLike, weight: ArrayLike, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(jnp.float32) * normed


class Decoder(nnx.Module):
    """The policy / reference model. Parameters carry logical axis names in `axes`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        e, f, h, k, d, v, n = (
            cfg.embed_dim,
            cfg.mlp_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.vocab_size,
            cfg.num_layers,
        )
        pdt = cfg.jnp_param_dtype
        init = jax.nn.initializers.normal(0.02)

        def param(shape, axes, kind="w"):
            if kind == "w":
                value = init(rngs.params(), shape, pdt)
            else:
                value = (jnp.ones if kind == "one" else jnp.zeros)(shape, pdt)
            return nnx.Param(value, axes=axes)

        self.embed = param((v, e), ("vocab", "embed"))
        self.attn_norm = param((n, e), ("layers", None), "one")
        self.wq = param((n, e, h, d), ("layers", "embed", "heads", "head_dim"))
        self.wk = param((n, e, k, d), ("layers", "embed", "kv_heads", "head_dim"))
        self.wv = param((n, e, k, d), ("layers", "embed", "kv_heads", "head_dim"))
        if cfg.qkv_bias:
            self.bq = param((n, h, d), ("layers", "heads", "head_dim"), "zero")
            self.bk = param((n, k, d), ("layers", "kv_heads", "head_dim"), "zero")
            self.bv = param((n, k, d), ("layers", "kv_heads", "head_dim"), "zero")
        self.wo = param((n, h, d, e), ("layers", "heads", "head_dim", "embed"))
        self.mlp_norm = param((n, e), ("layers", None), "one")
        self.w_gate = param((n, e, f), ("layers", "embed", "mlp"))
        self.w_up = param((n, e, f), ("layers", "embed", "mlp"))
        self.w_down = param((n, f, e), ("layers", "mlp", "embed"))
        self.final_norm = param((e,), (None,), "one")
        if not cfg.tie_embeddings:
            self.lm_head = param((e, v), ("embed", "vocab"))
        # A hashable tuple marked static: a NumPy attribute would become a state leaf, which
        # `nnx.eval_shape` turns into a ShapeDtypeStruct (breaking load-into-sharding).
        self._inv_freq = nnx.static(tuple(rope.inv_frequencies(cfg).tolist()))

    # ----------------------------------------------------------------- pieces
    def _layer_params(self) -> dict[str, Array]:
        names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
        if self.cfg.qkv_bias:
            names += ["bq", "bk", "bv"]
        return {name: getattr(self, name)[...] for name in names}

    def _qkv(self, p, x_BTE, cos, sin):
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        h = _rms_norm(x_BTE, p["attn_norm"], cfg.rms_norm_eps).astype(dt)
        q, k, v = (_linear(h, p[name].astype(dt)) for name in ("wq", "wk", "wv"))
        if cfg.qkv_bias:
            q, k, v = q + p["bq"].astype(dt), k + p["bk"].astype(dt), v + p["bv"].astype(dt)
        return rope.apply_rotary(q, cos, sin), rope.apply_rotary(k, cos, sin), v

    def _attend(self, q_BTHD, k_BKUD, v_BKUD, bias_B11TU) -> Array:
        """Grouped-query attention; keys/values head-major ([B, K, U, D], the cache layout).

        `bias_B11TU` is `mask_bias(mask)[:, None, None]`: an added bias, not a select, so the
        backward pass needs no mask-shaped residual per layer (a select's transpose stores one).
        """
        cfg = self.cfg
        b, t, _, d = q_BTHD.shape
        g = cfg.num_heads // cfg.num_kv_heads
        q = q_BTHD.reshape(b, t, cfg.num_kv_heads, g, d)
        if t == 1:
            # One query per row (decode): a batched [G, D] x [D, U] dot per row and kv head is a
            # poor fit for XLA:CPU's dot emitter; as multiply-and-reduce it is one vectorised
            # fusion that also reads the gathered cache rows in place.
            qf = q[:, 0, :, :, None, :].astype(jnp.float32)  # [B, K, G, 1, D]
            scores = jnp.sum(qf * k_BKUD[:, :, None].astype(jnp.float32), axis=-1)[:, :, :, None]
            probs = jax.nn.softmax(scores * (d**-0.5) + bias_B11TU, axis=-1)  # [B, K, G, 1, U]
            out = jnp.sum(probs[:, :, :, 0, :, None] * v_BKUD[:, :, None].astype(jnp.float32), axis=-2)
            return out.astype(v_BKUD.dtype).reshape(b, 1, cfg.num_heads, d)
        scores = jnp.einsum("btkgd,bkud->bkgtu", q, k_BKUD, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(scores * (d**-0.5) + bias_B11TU, axis=-1).astype(v_BKUD.dtype)
        out = jnp.einsum("bkgtu,bkud->btkgd", probs, v_BKUD)
        return out.reshape(b, t, cfg.num_heads, d)

    def _finish(self, p, x_BTE, o_BTHD) -> Array:
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        b, t, heads, d = o_BTHD.shape
        wo = p["wo"].astype(dt).reshape(heads * d, -1)
        x = x_BTE + _linear(o_BTHD.reshape(b, t, heads * d), wo).astype(x_BTE.dtype)
        h = _rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps).astype(dt)
        gate = _linear(h, p["w_gate"].astype(dt))
        up = _linear(h, p["w_up"].astype(dt))
        mlp = _linear(jax.nn.silu(gate) * up, p["w_down"].astype(dt))
        return x + mlp.astype(x.dtype)

    def _embed(self, tokens: Int[ArrayLike, "B T"]) -> Array:
        # The residual stream is kept in f32 when computing in f32, else in the compute dtype.
        return jnp.take(self.embed[...], tokens, axis=0).astype(self.cfg.jnp_dtype)

    def logits(self, h_BTE: Float[ArrayLike, "B T E"]) -> Float[Array, "B T V"]:
        """LM head on final hidden states; f32 accumulation so log-probs are exact."""
        dt = self.cfg.jnp_dtype
        if self.cfg.tie_embeddings:
            return jnp.einsum(
                "bte,ve->btv",
                h_BTE.astype(dt),
                self.embed[...].astype(dt),
                preferred_element_type=jnp.float32,
            )
        return jnp.einsum(
            "bte,ev->btv", h_BTE.astype(dt), self.lm_head[...].astype(dt), preferred_element_type=jnp.float32
        )

    # ------------------------------------------------------------ entry points
    def hidden(
        self,
        tokens: Int[ArrayLike, "B T"],
        positions: Int[ArrayLike, "B T"],
        mask: Bool[ArrayLike, "B T T"] | BlockMask | CausalMask,
    ) -> Float[Array, "B T E"]:
        """Final-norm hidden states of a full forward. `mask[b, i, j]`: query i may see key j;
        a `BlockMask` computes only the key blocks it lists (packed trees); a `CausalMask`
        (left-aligned causal rows) runs the fused kernel (`causal_attention.py`: cuDNN on GPU)."""
        cos, sin = rope.rotary_angles(positions, self._inv_freq)
        t, chunk = tokens.shape[1], self.cfg.attention_chunk
        if isinstance(mask, BlockMask):
            block = t // mask.key_blocks.shape[1]
            if chunk and t > chunk and chunk % block == 0 and t % chunk == 0:

                def per_chunk(q, k, v, side):  # one chunk's query blocks and their listed keys
                    return block_sparse_attention(q, k, v, BlockMask(key_blocks=side[0], visible=side[1]))

                side = (mask.key_blocks, mask.visible)
                attend = lambda q, k, v: _in_query_chunks(  # noqa: E731
                    per_chunk, q, k, v, side, lambda s, n: tuple(_chunks(x, 1, n) for x in s), t // chunk
                )
            else:
                attend = lambda q, k, v: block_sparse_attention(q, k, v, mask)  # noqa: E731
        elif isinstance(mask, CausalMask) and causal_implementation(self.cfg.jnp_dtype) != "dense":
            impl = causal_implementation(self.cfg.jnp_dtype)
            # Keys come head-major; the fused kernel takes them sequence-major (the two swaps cancel).
            attend = lambda q, k, v: causal_attention(  # noqa: E731
                q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, impl=impl
            )
        else:
            if isinstance(mask, CausalMask):  # no fused kernel here: the same mask, dense
                mask = causal_mask(mask.valid(t))
            bias = mask_bias(mask)[:, None, None]  # once, not per layer
            if chunk and t > chunk and t % chunk == 0:
                attend = lambda q, k, v: _in_query_chunks(  # noqa: E731
                    self._attend, q, k, v, bias, lambda x, n: _chunks(x, 3, n), t // chunk
                )
            else:
                attend = lambda q, k, v: self._attend(q, k, v, bias)  # noqa: E731

        def layer(x, p):
            q, k, v = self._qkv(p, x, cos, sin)
            o = attend(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
            return self._finish(p, x, o), None

        if self.cfg.remat != Remat.NONE:  # only a differentiated pass sees a difference
            layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
        x, _ = jax.lax.scan(layer, self._embed(tokens), self._layer_params())
        return _rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps)

    def __call__(
        self,
        tokens: Int[ArrayLike, "B T"],
        positions: Int[ArrayLike, "B T"],
        mask: Bool[ArrayLike, "B T T"] | BlockMask | CausalMask,
    ) -> Float[Array, "B T V"]:
        return self.logits(self.hidden(tokens, positions, mask))

    def append(
        self,
        tokens: Int[ArrayLike, "B C"],
        chunk_lens: Int[ArrayLike, " B"],
        cache: KVCache | PagedKVCache,
        *,
        slots: Int[ArrayLike, " B"] | None = None,
        attend_len: int | None = None,
        all_logits: bool = False,
        kernels: Kernels = Kernels.XLA,
    ) -> tuple[Array, KVCache | PagedKVCache]:
        """Appends `tokens[b, :chunk_lens[b]]` to slot `slots[b]` at that slot's own offset.

        Args:
          tokens: one row per written slot; entries past `chunk_lens[b]` are ignored.
          chunk_lens: tokens to append per row (0 leaves the slot untouched).
          cache: the slot pool or the paged cache (the same interface).
          slots: the slot of each row (default: row b is slot b, B == S). A row whose slot is
            out of range (≥ S) is padding: its writes are dropped.
          attend_len: static bound on keys to attend over (≥ every written slot's new
            length); attention then reads only the first `attend_len` positions.
          all_logits: return [B, C, V] logits for every chunk position instead of only
            the last appended one ([B, V]; garbage for rows with chunk_lens == 0).
          kernels: for one-token chunks (decode), `native` reads each row's live keys in
            place with the CPU kernel (`decode_attention.py`); `pallas` runs the backend's Pallas
            kernel (pages: `paged_kernels.py`, GPU or TPU; slots: `slot_kernels.py`, GPU — XLA
            on TPU); `xla` gathers a masked span.
            Resolve `auto` first (`treegrpo_jax.native.resolve`).

        Returns:
          (logits, updated cache).
        """
        b, c = tokens.shape
        u = cache.max_len if attend_len is None else attend_len
        rows_are_slots = slots is None
        slots = jnp.arange(b) if rows_are_slots else slots
        positions = cache.offsets(slots)[:, None] + jnp.arange(c)[None, :]  # [B, C]
        valid = jnp.arange(c)[None, :] < chunk_lens[:, None]
        # Writes past the chunk (or of padding rows) go out of range and are dropped.
        write_pos = jnp.where(valid, positions, cache.max_len)
        sees = jnp.arange(u)[None, None, :] <= positions[:, :, None]  # [B, C, U]
        bias = mask_bias(sees)[:, None, None]
        cos, sin = rope.rotary_angles(positions, self._inv_freq)
        if kernels is Kernels.AUTO:
            raise ValueError("Decoder.append: resolve kernels='auto' first (treegrpo_jax.native.resolve)")
        native = kernels is Kernels.NATIVE and c == 1
        # Pallas decode: pages on GPU and TPU, slots on GPU (TPU has no slot kernel: XLA there).
        pallas = (
            kernels is Kernels.PALLAS and c == 1 and (cache.pallas_on_tpu or jax.default_backend() != "tpu")
        )
        # Keys each row attends after its write: its new length (0 for rows that write nothing).
        live_lens = jnp.where(chunk_lens > 0, positions[:, 0] + 1, 0)
        # Row b is slot b: the slot cache reads the whole pool in place (pages are gathered either way).
        read_slots = None if rows_are_slots else slots

        def layer(carry, xs):
            x, cache = carry
            p, i = xs
            q, k, v = self._qkv(p, x, cos, sin)
            if native:  # writes the new key/value in place, then attends the live keys
                o, cache = cache.decode_native(
                    i, q[:, 0], k[:, 0], v[:, 0], slots, write_pos[:, 0], live_lens
                )
                return (self._finish(p, x, o[:, None].astype(q.dtype)), cache), None
            cache = cache.write(i, slots, write_pos, k, v)
            if pallas:  # the backend's kernel reads each row's live keys (pages or slots) in place
                o = cache.attend_pallas(i, q[:, 0], read_slots, live_lens, u)
                return (self._finish(p, x, o[:, None].astype(q.dtype)), cache), None
            keys, values = cache.read(i, read_slots, u)
            o = self._attend(q, keys.astype(q.dtype), values.astype(q.dtype), bias)
            return (self._finish(p, x, o), cache), None

        xs = (self._layer_params(), jnp.arange(self.cfg.num_layers))
        (x, new_cache), _ = jax.lax.scan(layer, (self._embed(tokens), cache), xs)
        new_cache = new_cache.add_lengths(slots, chunk_lens)
        if not all_logits and c > 1:  # (one-token chunks are their own last position)
            last = jnp.clip(chunk_lens - 1, 0, c - 1)
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, E]
        h = _rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps)
        logits = self.logits(h)
        return (logits if all_logits else logits[:, 0]), new_cache

    def prefill(
        self,
        tokens: Int[ArrayLike, " N"],
        token_rows: Int[ArrayLike, " N"],
        row_start: Int[ArrayLike, " R1"],
        cache: KVCache | PagedKVCache,
        *,
        slots: Int[ArrayLike, " R"],
    ) -> KVCache | PagedKVCache:
        """Writes flat ragged chunks into the cache with the CPU prefill kernel; returns the cache.

        Row r appends `tokens[row_start[r]:row_start[r+1]]` to sequence `slots[r]` at its own
        offset (`token_rows[i]` is token i's row, in [0, R); tokens past `row_start[R]` are
        padding). No chunk padding and no attended span: the kernel reads each row's live keys.
        Returns no logits — the engine keeps a sequence's last token pending, so nobody reads
        the prefill's hidden states — which also lets the last layer write its keys and values
        and skip its attention and MLP. Exactly `append(...)` of the same chunks on the K/V it
        writes (`tests/model/test_prefill_attention.py`).
        """
        n_layers = self.cfg.num_layers
        offsets = cache.offsets(slots)  # [R]
        j = jnp.arange(tokens.shape[0]) - row_start[token_rows]
        positions = (offsets[token_rows] + j)[None]  # [1, N]
        cos, sin = rope.rotary_angles(positions, self._inv_freq)

        def layer(carry, xs):
            x, cache = carry
            p, i = xs
            q, k, v = self._qkv(p, x, cos, sin)
            # The last layer's output feeds nothing the cache needs: write its K/V, skip the rest.
            attend = i < n_layers - 1
            o, cache = cache.prefill_native(i, q[0], k[0], v[0], slots, row_start, attend)
            x = jax.lax.cond(attend, lambda: self._finish(p, x, o[None].astype(q.dtype)), lambda: x)
            return (x, cache), None

        xs = (self._layer_params(), jnp.arange(n_layers))
        (_, cache), _ = jax.lax.scan(layer, (self._embed(tokens[None]), cache), xs)
        return cache.add_lengths(slots, row_start[1:] - row_start[:-1])

    def decode(
        self,
        tokens: Int[ArrayLike, " B"],
        cache: KVCache | PagedKVCache,
        active: Bool[ArrayLike, " B"],
        *,
        slots: Int[ArrayLike, " B"] | None = None,
        attend_len: int | None = None,
        kernels: Kernels = Kernels.XLA,
    ) -> tuple[Float[Array, "B V"], KVCache | PagedKVCache]:
        """One token for every active row (into its slot); inactive rows leave the cache untouched."""
        return self.append(
            tokens[:, None],
            active.astype(jnp.int32),
            cache,
            slots=slots,
            attend_len=attend_len,
            kernels=kernels,
        )


def _chunks(x: ArrayLike, axis: int, n: int) -> Array:
    """`x` with its `axis` cut into `n` equal chunks, the chunks leading."""
    shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _in_query_chunks(attend, q_BTHD, k_BKUD, v_BKUD, side, split, n: int) -> Array:
    """`attend(q, k, v, side)` over `n` chunks of the queries (and of `side`, the query-side mask,
    cut by `split(side, n)`), one at a time, each recomputed in the backward pass: the scores
    of one chunk exist at a time, forward and backward. Each query row's softmax still spans all
    of its keys, so the result is the unchunked one up to float rounding."""
    b, t, h, d = q_BTHD.shape
    body = jax.checkpoint(lambda xs: attend(xs[0], k_BKUD, v_BKUD, xs[1]), prevent_cse=False)
    out = jax.lax.map(body, (_chunks(q_BTHD, 1, n), split(side, n)))  # [n, B, T/n, H, D]
    return jnp.moveaxis(out, 0, 1).reshape(b, t, h, d)


def causal_mask(valid: Bool[ArrayLike, "B T"]) -> Bool[Array, "B T T"]:
    """Causal mask for left-aligned rows; padding keys are hidden (padding queries see token 0)."""
    t = valid.shape[1]
    tri = jnp.tril(jnp.ones((t, t), bool))
    return tri[None] & valid[:, None, :] | (~valid[:, :, None] & (jnp.arange(t) == 0)[None, None, :])

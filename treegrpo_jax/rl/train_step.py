"""One RL (or SFT) step: advantages, old/reference log-probs, mini-batch updates. Pure and jitted.

Legend: n_mini mini-batches (optimizer updates), n_micro micro-batches each (gradient
accumulation), b rows per micro-batch, T tokens.

The step takes the whole RL step's rows `[n_mini, n_micro, b, T]` — one row per path
(`PathBatch`) or packed trees (`PackedBatch`), see `layouts` — and, inside one jit:
  1. computes every leaf's advantage over ALL leaves (groups = trees / prompts of the step)
     and each token's leaf sums (`step_inputs.prepare`);
  2. computes `logp_old` with the pre-update params for mini-batches 1…n−1 (mini-batch 0
     is updated from exactly those params, so its `logp_old` is the stop-gradient of its
     own forward: the same numbers, one forward pass fewer), and the reference log-probs
     with the frozen reference params (skipped when kl_coef == 0);
  3. `lax.scan`s over mini-batches; each scans over its micro-batches summing gradients
     of the loss normalised by the *mini-batch* token/row counts (so accumulation equals
     one big batch), then clips, applies AdamW with lr(step), or — when the loss or the
     gradient norm is not finite — keeps params and optimizer state and counts a skip.
SFT mode runs the same path with advantage 1, no ratio, no old/reference passes.

Metrics (scalars, replicated): loss parts, clip fractions, KL, entropy, ratio mean/min/max,
advantage stats, sampler-vs-trainer log-prob gap, grad norm, lr, skipped updates. Means are
averaged over mini-batches. The trainer reads them right after the step (`train/loop.py`: the
next rollout needs the updated weights anyway, so nothing is left to overlap).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from treegrpo_jax.model.causal_attention import implementation as causal_implementation
from treegrpo_jax.parallel.rules import DEFAULT_RULES, Rules
from treegrpo_jax.rl.batch import LayoutKind
from treegrpo_jax.rl.layouts import StepBatch, step_batch_shardings
from treegrpo_jax.rl.logprobs import token_logprobs, tree_token_logprobs
from treegrpo_jax.rl.loss import LossAux, LossConfig, LossMode, policy_loss
from treegrpo_jax.rl.optim import OptimConfig, learning_rate, make_optimizer
from treegrpo_jax.rl.step_inputs import StepRows, prepare
from treegrpo_jax.rl.train_state import TrainState


def _select(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _logp(graphdef, params, mb: StepRows, chunk: int | None):
    model = nnx.merge(graphdef, params)
    # Path rows are left-aligned chains: where a fused causal kernel runs (cuDNN: GPU, bf16) they
    # take it; elsewhere they keep the tree-mask path below, so CPU results stay bit for bit.
    if mb.key_blocks is None and causal_implementation(model.cfg.jnp_dtype) != "dense":
        return token_logprobs(model, mb.tokens, mb.positions, mb.segment > 0, chunk=chunk)
    layout = (mb.positions, mb.segment, mb.span_end, mb.prev)
    return tree_token_logprobs(model, mb.tokens, *layout, key_blocks=mb.key_blocks, chunk=chunk)


def _forward_all(graphdef, params, rows: StepRows, chunk: int | None) -> jax.Array:
    """Log-probs of `[k, n_micro, b, T]` rows, one micro-batch at a time (bounded memory)."""
    micro = rows.reshape_rows(-1, rows.tokens.shape[-2])
    logp = jax.lax.map(lambda mb: _logp(graphdef, params, mb, chunk)[0], micro)
    return jax.lax.stop_gradient(logp.reshape(rows.tokens.shape))


def _micro_loss(
    params, mb: StepRows, old, ref, is_first, counts, *, graphdef, cfg: LossConfig, chunk: int | None
):
    logp, entropy = _logp(graphdef, params, mb, chunk)
    num_tokens, num_rows = counts
    if cfg.mode == LossMode.RL:
        old = jnp.where(is_first, jax.lax.stop_gradient(logp), old)
    loss, aux = policy_loss(
        logp, old, ref, entropy, mb.weights, cfg=cfg, num_tokens=num_tokens, num_rows=num_rows
    )
    if cfg.mode == LossMode.RL:
        aux.sums["logp_gap"] = jnp.sum(jnp.abs(mb.sampler_logp - old) * mb.weights.count) / num_tokens
    return loss, aux


def train_step(
    state: TrainState,
    batch: StepBatch,
    ref_params: nnx.State | None,
    *,
    loss_cfg: LossConfig,
    optim_cfg: OptimConfig,
    logprob_chunk: int | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One RL step over all its rows (pure; see `jit_train_step`).

    Args:
      state: the train state (donated by the jitted version).
      batch: the step's rows, `[n_mini, n_micro, b, T]`: a `PathBatch` (`build_batch`) or a
        `PackedBatch` (`build_packed_batch`); `layouts.batch_from_trees` builds either.
      ref_params: frozen reference params (needed when `loss_cfg.uses_reference`, else None).
      loss_cfg: loss configuration (mode, estimator, clips, coefficients, aggregation).
      optim_cfg: optimizer configuration.
      logprob_chunk: sequence chunk of the LM head (see `logprobs.token_logprobs`; None: automatic).

    Returns:
      (new state, metrics).
    """
    if batch.tokens.ndim != 4:
        raise ValueError(f"train_step wants [n_mini, n_micro, b, T] rows, got tokens {batch.tokens.shape}")
    rl = loss_cfg.mode == LossMode.RL
    if loss_cfg.uses_reference and ref_params is None:
        raise ValueError("LossConfig.kl_coef > 0 needs ref_params (or set kl_coef=0)")
    graphdef, n_mini = state.graphdef, batch.tokens.shape[0]
    # Named scopes label the device ops in a `run.profile_steps` trace (`train/profiling.py`).
    with jax.named_scope("advantages"):
        inputs = prepare(batch, loss_cfg)  # advantages over ALL leaves of the step, then leaf sums
    rows = inputs.rows

    old = ref = None
    if rl:
        with jax.named_scope("log_probs"):
            old = jnp.zeros(rows.tokens.shape, jnp.float32)
            if n_mini > 1:
                rest = jax.tree.map(lambda x: x[1:], rows)
                old = old.at[1:].set(_forward_all(graphdef, state.params, rest, logprob_chunk))
            if loss_cfg.uses_reference:
                ref = _forward_all(graphdef, ref_params, rows, logprob_chunk)

    tx = make_optimizer(optim_cfg, state.params)
    lr = learning_rate(optim_cfg, state.step)
    grad_fn = jax.value_and_grad(
        functools.partial(_micro_loss, graphdef=graphdef, cfg=loss_cfg, chunk=logprob_chunk), has_aux=True
    )

    def mini_update(carry, xs):
        params, opt_state, skipped = carry
        mb, mb_old, mb_ref, is_first, counts = xs

        def micro(acc, ys):
            (_, aux), grads = grad_fn(params, *ys, is_first, counts)
            g_acc, a_acc = acc
            a_acc = LossAux(
                sums=jax.tree.map(jnp.add, a_acc.sums, aux.sums),
                mins=jax.tree.map(jnp.minimum, a_acc.mins, aux.mins),
                maxs=jax.tree.map(jnp.maximum, a_acc.maxs, aux.maxs),
            )
            return (jax.tree.map(jnp.add, g_acc, grads), a_acc), None

        first = jax.tree.map(lambda x: x[0], (mb, mb_old, mb_ref))
        aux_shape = jax.eval_shape(lambda: grad_fn(params, *first, is_first, counts)[0][1])
        big = jnp.finfo(jnp.float32).max
        aux0 = LossAux(
            sums=jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape.sums),
            mins=jax.tree.map(lambda s: jnp.full(s.shape, big, s.dtype), aux_shape.mins),
            maxs=jax.tree.map(lambda s: jnp.full(s.shape, -big, s.dtype), aux_shape.maxs),
        )
        g0 = jax.tree.map(jnp.zeros_like, params)
        (grads, aux), _ = jax.lax.scan(micro, (g0, aux0), (mb, mb_old, mb_ref))

        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(aux.sums["loss"]) & jnp.isfinite(grad_norm)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates))
        carry = (_select(ok, new_params, params), _select(ok, new_opt, opt_state), skipped + (~ok))
        return carry, (aux, grad_norm, ok)

    xs = (rows, old, ref, jnp.arange(n_mini) == 0, (inputs.num_tokens, inputs.num_rows))
    carry = (state.params, state.opt_state, state.skipped)
    with jax.named_scope("minibatch_update"):
        (params, opt_state, skipped), (aux, grad_norm, ok) = jax.lax.scan(mini_update, carry, xs)

    metrics = {k: jnp.mean(v) for k, v in aux.sums.items()}
    metrics.update({k: jnp.min(v) for k, v in aux.mins.items()})
    metrics.update({k: jnp.max(v) for k, v in aux.maxs.items()})
    valid = inputs.leaf_valid
    n_rows = jnp.maximum(jnp.sum(valid), 1)
    adv = jnp.where(valid, inputs.advantage, 0.0)
    adv_mean = jnp.sum(adv) / n_rows
    metrics.update(
        grad_norm=jnp.mean(grad_norm),
        lr=lr,
        skipped_updates=jnp.sum(~ok).astype(jnp.int32),
        num_tokens=jnp.sum(rows.weights.count),  # path tokens (a shared token counts per leaf)
        num_rows=jnp.sum(valid).astype(jnp.int32),
        reward_mean=jnp.sum(jnp.where(valid, inputs.reward, 0.0)) / n_rows,
        adv_mean=adv_mean,
        adv_std=jnp.sqrt(jnp.sum(jnp.where(valid, (adv - adv_mean) ** 2, 0.0)) / n_rows),
        adv_min=jnp.min(jnp.where(valid, adv, jnp.inf)),
        adv_max=jnp.max(jnp.where(valid, adv, -jnp.inf)),
    )
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1, skipped=skipped)
    return new_state, metrics


def jit_train_step(
    shardings: TrainState | None,
    *,
    loss_cfg: LossConfig,
    optim_cfg: OptimConfig,
    mesh: Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    logprob_chunk: int | None = None,
    layout_kind: LayoutKind | str = LayoutKind.PATHS,
):
    """`train_step` jitted with donated state and explicit shardings.

    Compiles once per batch shape (bucket). Call positionally: `step(state, batch, ref_params)`
    with `batch` placed by `batch.shard_batch` and `ref_params` None unless the KL is on.

    Args:
      shardings: the TrainState shardings from `create_train_state` (None without a mesh).
      loss_cfg: loss configuration.
      optim_cfg: optimizer configuration.
      mesh: the device mesh (None: one device, no explicit shardings).
      rules: logical-axis rules (rows go over the `batch` rule).
      logprob_chunk: sequence chunk of the LM head (None: automatic).
      layout_kind: the batches' layout ("paths" or "packed"; `BatchLayout.kind`): sets the
        batch's in_shardings on a mesh (without a mesh either batch works).
    """
    fn = functools.partial(train_step, loss_cfg=loss_cfg, optim_cfg=optim_cfg, logprob_chunk=logprob_chunk)
    if mesh is None:
        return jax.jit(fn, donate_argnums=0)
    ref_sh = shardings.params if loss_cfg.uses_reference else None
    return jax.jit(
        fn,
        in_shardings=(shardings, step_batch_shardings(layout_kind, mesh, rules), ref_sh),
        out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=0,
    )

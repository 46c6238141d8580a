"""Every program a run compiles, for a config and a mesh, as lowerings over abstract inputs.

A run compiles (`train/trainer.py`, `train/cold_start.py`, `rollout/engine.py`):

  * `rl_step T=…`   the RL train step (`rl.train_step`) once per length bucket, on the step's rows
                    `[n_mini, n_micro, b, T]` in the config's layout;
  * `sft_step T=…`  the cold start's step (the same function in SFT mode), `sft.batch_rows` rows;
  * `decode`, `append`, `fork`: the rollout engine's calls at `run.rollout_slots` rows attending
                    `run.context_len` positions (an evaluation runs the same programs, greedy).

Inputs are `jax.ShapeDtypeStruct`s with the shardings a run gives them (parameters and Adam
moments by the logical-axis rules; rows over the `batch` rule; the engine's weights as the train
state holds them; the K/V pool as the engine creates it: one array the mesh replicates). Nothing is
allocated. Row counts are the largest a step can have: every leaf of every prompt as a path row
(`paths`); for packed trees the same rows, leaf/pair/node tables for every leaf and turn, and every
key block listed (the dense bound) — real packed steps are smaller.

Each program also carries a hand count of its FLOPs and of the HBM bytes it must move (weights,
K/V), for the predicted time: the compiler's `cost_analysis` counts a loop body once (the layer
scan, the micro-batch scan, the decode loop), so it cannot be multiplied out by the chip's rate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from treegrpo_jax.model.build import abstract_model, param_shardings
from treegrpo_jax.model.cache import cache_abstract
from treegrpo_jax.model.config import ModelConfig, Remat
from treegrpo_jax.parallel.rules import DEFAULT_RULES
from treegrpo_jax.rl.batch import LayoutKind
from treegrpo_jax.rl.layouts import BATCH_TYPES
from treegrpo_jax.rl.loss import LossMode
from treegrpo_jax.rl.sft import sft_loss_config
from treegrpo_jax.rl.shapes import BatchShape, abstract_batch
from treegrpo_jax.rl.train_state import abstract_train_state, with_shardings
from treegrpo_jax.rl.train_step import jit_train_step
from treegrpo_jax.rollout import stops as stops_lib
from treegrpo_jax.rollout.engine import lower_calls
from treegrpo_jax.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of a run: how to lower it, and what it computes by hand count.

    Attributes:
      name: e.g. `rl_step T=4096`.
      phase: `update`, `cold_start` or `rollout` (which programs are live together).
      lower: lowers it (nothing allocated).
      flops: hand-counted FLOPs of one call, all devices together.
      hbm_bytes: hand-counted bytes one call must read from HBM (weights per pass, K/V), all
        devices together.
      calls: how many times one RL step runs it (for the predicted step; 0: not in an RL step).
    """

    name: str
    phase: str
    lower: Callable[[], jax.stages.Lowered]
    flops: float
    hbm_bytes: float
    calls: float = 0.0


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters a token multiplies through (the embedding lookup is not a matmul; a tied
    embedding is, once, as the LM head)."""
    untied_embed = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.embed_dim
    return cfg.num_params - untied_embed


def forward_flops(cfg: ModelConfig, tokens: float, keys_per_query: float) -> float:
    """FLOPs of a forward pass over `tokens` tokens, each attending `keys_per_query` keys."""
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys_per_query
    return tokens * (2 * matmul_params(cfg) + attention)


def rows_per_micro(cfg: TrainConfig) -> int:
    """Path rows of one micro-batch when every leaf of every prompt is a row (`row_multiple·2^k`)."""
    layout = cfg.layout
    leaves = cfg.run.prompts_per_step * cfg.tree.leaves_per_prompt
    need = -(-leaves // (layout.num_minibatches * layout.num_microbatches))
    b = layout.row_multiple
    while b < need:
        b *= 2
    return b


def _train_shape(cfg: TrainConfig, b: int, t: int) -> BatchShape:
    if cfg.layout.kind == LayoutKind.PATHS:
        return BatchShape(b=b, t=t)
    leaves = cfg.run.prompts_per_step * cfg.tree.leaves_per_prompt
    turns = cfg.agent.max_turns + 1  # nodes on a leaf's path: its steps and the forced answer
    block = math.gcd(t, 64)
    return BatchShape(
        b=b, t=t, leaves=leaves, pairs=leaves * turns, nodes=leaves * turns, key_slots=t // block
    )


def rl_programs(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh) -> list[Program]:
    graphdef, params = abstract_model(model_cfg)
    state, shardings = abstract_train_state(graphdef, params, cfg.optim, mesh=mesh)
    ref = state.params if cfg.loss.uses_reference else None
    layout = cfg.layout
    lead = (layout.num_minibatches, layout.num_microbatches)
    b = rows_per_micro(cfg)
    step = jit_train_step(
        shardings, loss_cfg=cfg.loss, optim_cfg=cfg.optim, mesh=mesh, layout_kind=layout.kind
    )
    batch_type = BATCH_TYPES[layout.kind]
    batch_shardings = batch_type.shardings(mesh, DEFAULT_RULES)
    programs = []
    tokens_per_call = lambda t: layout.num_minibatches * layout.num_microbatches * b * t  # noqa: E731
    passes = 4 if model_cfg.remat == Remat.NONE else 5  # fwd 1 + bwd 2 (+ the recomputed fwd), ×2 FLOPs
    old = (layout.num_minibatches - 1) / layout.num_minibatches  # mini-batches 1…n-1: a logp_old pass
    extra_fwd = old + (1.0 if cfg.loss.uses_reference else 0.0)
    for t in layout.length_buckets:
        batch = abstract_batch(batch_type, lead, _train_shape(cfg, b, t))
        batch = with_shardings(batch, batch_shardings)
        n = tokens_per_call(t)
        flops = forward_flops(model_cfg, n, t) * (passes / 2 + extra_fwd)
        weights = model_cfg.num_params * jnp.dtype(model_cfg.param_dtype).itemsize
        # Weights are read per micro-batch pass; Adam reads/writes params and 2 moments per update.
        hbm = weights * lead[0] * lead[1] * (passes / 2) + 7 * weights * lead[0]
        programs.append(
            Program(
                f"rl_step T={t}",
                "update",
                lambda batch=batch: step.lower(state, batch, ref),
                flops,
                hbm,
                calls=1.0 if t == layout.length_buckets[-1] else 0.0,
            )
        )
    return programs


def sft_programs(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh) -> list[Program]:
    if not cfg.sft.steps:
        return []
    graphdef, params = abstract_model(model_cfg)
    state, shardings = abstract_train_state(graphdef, params, cfg.sft.optim, mesh=mesh)
    loss = sft_loss_config()
    assert loss.mode == LossMode.SFT
    step = jit_train_step(shardings, loss_cfg=loss, optim_cfg=cfg.sft.optim, mesh=mesh)
    batch_type = BATCH_TYPES[LayoutKind.PATHS]
    out = []
    for t in cfg.layout.length_buckets:
        batch = abstract_batch(batch_type, (1, 1), BatchShape(b=cfg.sft.batch_rows, t=t))
        batch = with_shardings(batch, batch_type.shardings(mesh, DEFAULT_RULES))
        n = cfg.sft.batch_rows * t
        passes = 3 if model_cfg.remat == Remat.NONE else 4
        weights = model_cfg.num_params * jnp.dtype(model_cfg.param_dtype).itemsize
        out.append(
            Program(
                f"sft_step T={t}",
                "cold_start",
                lambda batch=batch: step.lower(state, batch, None),
                forward_flops(model_cfg, n, t) * passes,
                weights * (passes + 7),
            )
        )
    return out


def rollout_slots(cfg: TrainConfig) -> int:
    """The engine's sequences, as the trainer sizes them (every leaf of a step at once unless
    `run.rollout_slots` says otherwise; evaluations go in waves of the same pool)."""
    return cfg.run.rollout_slots or cfg.run.prompts_per_step * cfg.tree.leaves_per_prompt


def kv_bytes_per_token(model_cfg: ModelConfig, kv_dtype) -> int:
    return (
        2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * jnp.dtype(kv_dtype).itemsize
    )


def engine_programs(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh) -> list[Program]:
    """decode / append / fork at the pool's full width (the widest call a rollout makes)."""
    graphdef, params = abstract_model(model_cfg)
    params = with_shardings(params, param_shardings(params, mesh))
    slots, ctx = rollout_slots(cfg), cfg.run.context_len
    kv_dtype = jnp.bfloat16 if cfg.model.kv_dtype in ("auto", "bfloat16") else jnp.float32
    # The engine's pool is one array per K and V; nothing shards it, so the mesh replicates it.
    cache = cache_abstract(model_cfg, slots, ctx, kv_dtype)
    replicated = NamedSharding(mesh, PartitionSpec())
    cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), cache)
    steps = cfg.agent.max_step_tokens
    stop_table = stops_lib.make_stop_table([], (), vocab_size=model_cfg.vocab_size)
    calls = lower_calls(
        graphdef,
        params,
        cache,
        rows=slots,
        num_steps=steps,
        chunk=max(cfg.observation.max_tokens, 16),
        attend_len=ctx,
        stop_table=stop_table,
    )
    weights = model_cfg.num_params * jnp.dtype(model_cfg.param_dtype).itemsize
    kv_row = kv_bytes_per_token(model_cfg, kv_dtype) * ctx  # a row's keys and values at full context
    # An RL step: each leaf decodes its steps (`max_turns` of `max_step_tokens` at most) and
    # appends its observations; the pool decodes all leaves at once when it holds them.
    waves = -(-cfg.run.prompts_per_step * cfg.tree.leaves_per_prompt // slots)
    turns = cfg.agent.max_turns
    out = [
        Program(
            "decode",
            "rollout",
            lambda: calls["decode"],
            forward_flops(model_cfg, slots * steps, ctx),
            steps * (weights + slots * kv_row),
            calls=waves * turns,
        ),
        Program(
            "append",
            "rollout",
            lambda: calls["append"],
            forward_flops(model_cfg, slots * max(cfg.observation.max_tokens, 16), ctx),
            weights + slots * kv_row,
            calls=waves * turns,
        ),
    ]
    if "fork" in calls:
        out.append(Program("fork", "rollout", lambda: calls["fork"], 0.0, 2 * slots * kv_row, calls=waves))
    return out


def run_programs(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh) -> list[Program]:
    """Every program of a run of `cfg` on `mesh` (see the module docstring)."""
    return [
        *rl_programs(cfg, model_cfg, mesh),
        *sft_programs(cfg, model_cfg, mesh),
        *engine_programs(cfg, model_cfg, mesh),
    ]


__all__ = ["Program", "forward_flops", "matmul_params", "rollout_slots", "run_programs"]

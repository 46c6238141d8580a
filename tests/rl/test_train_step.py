"""The jitted step: micro-batch accumulation = one big batch; non-finite updates skipped; SFT learns."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.rl.tiny import compile_fast
from treegrpo_jax.rl import (
    BatchLayout,
    LossConfig,
    OptimConfig,
    build_batch,
    create_train_state,
    demonstration_row,
    jit_train_step,
    learning_rate,
    rows_from_trees,
    sft_loss_config,
    train_step,
)
from treegrpo_jax.testing.forest import random_forest

# Adam's first update is g/(|g|+eps): with eps=1e-8 a gradient of ~1e-8 flips on rounding noise.
# A larger eps keeps equivalence tests smooth in the gradient (the step's maths is unchanged).
OPTIM = OptimConfig(learning_rate=1e-3, warmup_ratio=0.0, total_steps=10, eps=1e-3)


def _fresh_state(model):
    params = jax.tree.map(jnp.copy, nnx.state(model))  # the step donates its state: never the fixture's
    return create_train_state(nnx.merge(nnx.graphdef(model), params), OPTIM)[0]


@pytest.fixture(scope="module")
def rows():
    return rows_from_trees(
        random_forest(np.random.default_rng(5), num_prompts=4, trees=2, branches=2, rounds=1)
    )


@pytest.fixture(scope="module")
def ref_params(tiny_model):
    # A frozen reference that differs from the policy, so the KL and its gradient are not 0.
    return jax.jit(lambda p: jax.tree.map(lambda x: x * 1.2, p))(nnx.state(tiny_model))


LOSS = LossConfig(aggregation="seq-mean-token-mean", kl_coef=0.05, entropy_coef=0.01)
LAYOUTS = {
    n_micro: BatchLayout(num_minibatches=2, num_microbatches=n_micro, length_buckets=(32,), row_multiple=m)
    for n_micro, m in [(1, 8), (4, 1)]
}


@pytest.fixture(scope="module")
def compiled(tiny_model, rows, ref_params):
    """The RL step compiled once per layout (shared by the tests of this module)."""
    step = jit_train_step(None, loss_cfg=LOSS, optim_cfg=OPTIM, logprob_chunk=8)
    state = _fresh_state(tiny_model)
    return {k: compile_fast(step, state, build_batch(rows, lay), ref_params) for k, lay in LAYOUTS.items()}


def test_microbatch_accumulation_equals_one_big_batch(tiny_model, rows, ref_params, compiled):
    out = {}
    for n_micro, layout in LAYOUTS.items():
        out[n_micro] = compiled[n_micro](_fresh_state(tiny_model), build_batch(rows, layout), ref_params)
    assert out[4][1]["num_rows"] == len(rows)
    (big, m_big), (small, m_small) = out[1], out[4]
    for a, b in zip(jax.tree.leaves(big.params), jax.tree.leaves(small.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "adv_std", "logp_gap"):
        np.testing.assert_allclose(m_big[key], m_small[key], rtol=1e-5, atol=1e-6, err_msg=key)
    # Mini-batch 1 ran on updated params: its ratios moved away from 1 (logp_old is pre-update).
    assert m_big["ratio_max"] > 1.0 + 1e-5 or m_big["ratio_min"] < 1.0 - 1e-5
    assert int(big.step) == 1 and int(big.skipped) == 0


def test_non_finite_update_is_skipped_and_counted(tiny_model, rows, ref_params, compiled):
    clean = build_batch(rows, LAYOUTS[4])
    poisoned = clean.replace(reward=clean.reward.copy())
    # A NaN reward in mini-batch 0 → NaN advantages for its tree and prompt → NaN loss there.
    poisoned.reward[0, 1, 0] = np.nan
    run, state = compiled[4], _fresh_state(tiny_model)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))

    poisoned_only = clean.replace(reward=np.full_like(clean.reward, np.nan))
    state, metrics = run(state, poisoned_only, ref_params)  # every row NaN: both updates skipped
    assert int(metrics["skipped_updates"]) == 2 and int(state.skipped) == 2 and int(state.step) == 1
    assert np.isnan(metrics["loss"])
    after = jax.tree.map(np.asarray, (state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    # One poisoned mini-batch: only that update is skipped, the other one applies.
    _, metrics = run(_fresh_state(tiny_model), poisoned, ref_params)
    assert int(metrics["skipped_updates"]) == 1

    # The state is intact: a clean step now equals a clean step from scratch.
    state, metrics = run(state, clean, ref_params)
    assert int(metrics["skipped_updates"]) == 0 and int(state.skipped) == 2
    scratch, _ = run(_fresh_state(tiny_model), clean, ref_params)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(scratch.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-7)


def test_sft_step_lowers_nll_on_a_repeated_batch(tiny_model):
    rng = np.random.default_rng(0)
    rows = [
        demonstration_row(
            [
                (rng.integers(1, 64, 3), False),
                (rng.integers(1, 64, 6), True),
                (rng.integers(1, 64, 2), False),
                (rng.integers(1, 64, 4), True),
            ],
            prompt_id=i,
        )  # fmt: skip
        for i in range(6)
    ]
    batch = build_batch(rows, BatchLayout(length_buckets=(16,), row_multiple=8))
    optim = OptimConfig(learning_rate=1e-2, warmup_ratio=0.0, total_steps=100, weight_decay=0.0)
    state = create_train_state(
        nnx.merge(nnx.graphdef(tiny_model), jax.tree.map(jnp.copy, nnx.state(tiny_model))), optim
    )[0]
    step = jit_train_step(None, loss_cfg=sft_loss_config(), optim_cfg=optim, logprob_chunk=8)
    run = compile_fast(step, state, batch, None)
    nll = []
    for _ in range(15):
        state, metrics = run(state, batch, None)
        nll.append(float(metrics["nll"]))
    assert nll[0] > 3.5  # ≈ log 64 at init
    assert nll[-1] < 0.6 * nll[0], nll
    assert set(metrics) >= {"loss", "nll", "entropy", "grad_norm", "lr"} and "kl" not in metrics


def test_learning_rate_schedule_and_optim_config():
    cfg = OptimConfig(
        learning_rate=1.0, warmup_ratio=0.2, total_steps=10, schedule="cosine", min_lr_ratio=0.1
    )
    lrs = [float(learning_rate(cfg, s)) for s in range(11)]
    np.testing.assert_allclose(lrs[:3], [0.0, 0.5, 1.0], atol=1e-6)  # warmup 2 steps (HF/verl: lr·s/w)
    np.testing.assert_allclose(lrs[6], 0.1 + 0.9 * 0.5, atol=1e-6)  # half-way through the cosine
    np.testing.assert_allclose(lrs[10], 0.1, atol=1e-6)
    const = OptimConfig(learning_rate=2.0, warmup_ratio=0.0, total_steps=5)
    assert float(learning_rate(const, 0)) == 2.0 == float(learning_rate(const, 4))
    with pytest.raises(ValueError, match="OptimConfig.warmup_ratio"):
        OptimConfig(warmup_ratio=1.5)
    with pytest.raises(ValueError, match="OptimConfig.schedule"):
        OptimConfig(schedule="linear")


def _closed_form_lr(cfg, s):
    """The schedule as written in rl/optim.py's docstring, one step at a time."""
    w = cfg.warmup_steps
    if s < w:
        return cfg.learning_rate * s / w
    if cfg.schedule == "constant":
        return cfg.learning_rate
    frac = min(max((s - w) / max(cfg.total_steps - w, 1), 0.0), 1.0)
    return cfg.learning_rate * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(learning_rate=1e-6, warmup_ratio=0.285, total_steps=180),  # the paper's
        dict(learning_rate=3e-3, warmup_ratio=0.05, total_steps=1200, schedule="cosine", min_lr_ratio=0.05),
        dict(learning_rate=1e-4, warmup_ratio=0.1, total_steps=8),
        dict(learning_rate=1.0, warmup_ratio=0.0, total_steps=7, schedule="cosine"),
        dict(learning_rate=1.0, warmup_ratio=0.5, total_steps=1, schedule="cosine", min_lr_ratio=0.3),
    ],
)
def test_the_optax_schedule_is_the_closed_form(kw):
    cfg = OptimConfig(**kw)
    steps = range(cfg.total_steps + 3)  # past the end: held at the floor
    got = jax.jit(jax.vmap(lambda s: learning_rate(cfg, s)))(jnp.arange(len(steps)))
    np.testing.assert_allclose(got, [_closed_form_lr(cfg, s) for s in steps], rtol=2e-6, atol=1e-12)


def test_kl_without_reference_params_is_a_clear_error(tiny_model, rows):
    batch = build_batch(rows, BatchLayout(length_buckets=(32,)))
    fn = functools.partial(train_step, loss_cfg=LossConfig(kl_coef=0.1), optim_cfg=OPTIM)
    with pytest.raises(ValueError, match="ref_params"):
        jax.eval_shape(fn, _fresh_state(tiny_model), batch, None)

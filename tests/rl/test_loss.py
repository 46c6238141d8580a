"""The clipped loss against a direct piecewise formula; config validation; SFT mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treegrpo_jax.rl.loss import LossConfig, policy_loss
from treegrpo_jax.rl.token_weights import row_weights

EPS_LOW, EPS_HIGH, DUAL, BETA, ALPHA = 0.2, 0.2, 3.0, 0.05, 0.01

# Ratios chosen to hit every branch (away from the kinks, so gradients are defined too):
#   row 0, A = +1.5: none (1.0), high clip (1.5), A>0 below range: unclipped (0.5), none (1.1)
#   row 1, A = −2.0: low clip (0.5), dual clip (4.0), none (2.0), [masked observation]
#   row 2, A = +0.0: none (1.3); other tokens masked
#   row 3: no model token at all (excluded from the seq-mean row count)
RATIO = np.array(
    [[1, 1.0, 1.5, 0.5, 1.1], [1, 0.5, 4.0, 2.0, 7.0], [1, 1.3, 1, 1, 1], [1, 1, 1, 1, 1]], np.float32
)
MASK = np.array([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]], np.float32)
ADV = np.array([1.5, -2.0, 0.0, 0.7], np.float32)
RNG = np.random.default_rng(0)
LOGP_OLD = (-RNG.random((4, 5)) * 2).astype(np.float32)
LOGP = (LOGP_OLD + np.log(RATIO)).astype(np.float32)
REF = (LOGP + RNG.normal(size=(4, 5)) * 0.3).astype(np.float32)
ENT = (RNG.random((4, 5)) * 3).astype(np.float32)
# Leaves of the tree through each token (the shared-prefix credit's n_t): row 0's first two model
# tokens are shared by 4 leaves, row 1's first by 2; the rest are on one path only.
SHARED = np.array([[4, 4, 4, 1, 1], [2, 2, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], np.float32)
CREDIT = {"sum": lambda n: 1.0, "mean": lambda n: 1.0 / n, "sqrt": lambda n: 1.0 / float(np.sqrt(n))}


def _direct_token_loss(logp, i, t, credit="sum"):
    """The per-token loss written piecewise (not as verl's max/min chain), times the credit."""
    a, r = ADV[i], jnp.exp(logp[i, t] - LOGP_OLD[i, t])
    if a > 0:
        pg = -a * jnp.minimum(r, 1 + EPS_HIGH)
    elif a < 0:
        pg = -a * jnp.minimum(jnp.maximum(r, 1 - EPS_LOW), DUAL)
    else:
        pg = 0.0 * r
    d = REF[i, t] - logp[i, t]
    return CREDIT[credit](SHARED[i, t]) * (pg + BETA * (jnp.exp(d) - d - 1) - ALPHA * ENT[i, t])


def _direct(logp, aggregation, num_tokens, num_rows, credit="sum"):
    if aggregation == "token-mean":
        terms = [_direct_token_loss(logp, i, t, credit) for i in range(4) for t in range(5) if MASK[i, t]]
        return sum(terms) / num_tokens
    rows = []
    for i in range(4):
        terms = [_direct_token_loss(logp, i, t, credit) for t in range(5) if MASK[i, t]]
        if terms:
            rows.append(sum(terms) / len(terms))
    return sum(rows) / num_rows


@pytest.mark.parametrize("credit", ["sum", "mean", "sqrt"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("scale", [1.0, 3.0])  # a larger (mini-batch) normaliser scales the loss
def test_loss_matches_direct_formula_every_branch(aggregation, scale, credit):
    cfg = LossConfig(
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        dual_clip=DUAL,
        kl_coef=BETA,
        entropy_coef=ALPHA,
        aggregation=aggregation,
        credit=credit,
    )
    n_tok, n_rows = MASK.sum() * scale, 3.0 * scale

    def ours(logp):
        weights = row_weights(
            jnp.asarray(ADV),
            jnp.asarray(MASK),
            cfg.aggregation,
            shared=jnp.asarray(SHARED),
            credit=cfg.credit,
        )
        return policy_loss(
            logp, LOGP_OLD, REF, jnp.asarray(ENT), weights, cfg=cfg, num_tokens=n_tok, num_rows=n_rows
        )

    (loss, aux), grad = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(LOGP))
    want, want_grad = jax.value_and_grad(lambda lp: _direct(lp, aggregation, n_tok, n_rows, credit))(
        jnp.asarray(LOGP)
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    # One token each clipped high, low and dual out of 9 model tokens.
    for key in ("clip_frac_high", "clip_frac_low", "clip_frac_dual"):
        np.testing.assert_allclose(aux.sums[key], 1 / n_tok, rtol=1e-6, err_msg=key)
    model_ratios = RATIO[MASK > 0]
    np.testing.assert_allclose(aux.mins["ratio_min"], model_ratios.min(), rtol=1e-5)
    np.testing.assert_allclose(aux.maxs["ratio_max"], model_ratios.max(), rtol=1e-5)  # 7.0 is masked
    np.testing.assert_allclose(aux.sums["ratio_mean"], model_ratios.sum() / n_tok, rtol=1e-5)
    # The clipped tokens carry no policy gradient: only the KL term moves them.
    d = REF - LOGP
    kl_grad = BETA * (1 - np.exp(d)) * MASK / n_tok * np.vectorize(CREDIT[credit])(SHARED)
    if aggregation == "token-mean":
        for i, t in [(0, 2), (1, 1), (1, 2)]:
            np.testing.assert_allclose(grad[i, t], kl_grad[i, t], rtol=1e-4, atol=1e-7)


def test_entropy_coef_zero_has_no_entropy_gradient_and_sft_is_nll():
    ent = jnp.asarray(ENT)
    cfg = LossConfig(entropy_coef=0.0, kl_coef=0.0)
    w = row_weights(jnp.asarray(ADV), jnp.asarray(MASK), cfg.aggregation)
    g = jax.grad(lambda e: policy_loss(LOGP, LOGP_OLD, None, e, w, cfg=cfg, num_tokens=9.0, num_rows=3.0)[0])
    assert np.all(np.asarray(g(ent)) == 0)
    sft = LossConfig(mode="sft", kl_coef=0.0, entropy_coef=0.0)
    ones = row_weights(jnp.ones(4), jnp.asarray(MASK), sft.aggregation)  # SFT: advantage 1
    loss, _ = policy_loss(LOGP, None, None, ent, ones, cfg=sft, num_tokens=9.0, num_rows=3.0)
    np.testing.assert_allclose(loss, -(LOGP * MASK).sum() / 9.0, rtol=1e-6)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("eps_low", 1.5),
        ("eps_high", -0.1),
        ("dual_clip", 0.5),
        ("kl_coef", -1.0),
        ("entropy_coef", -0.1),
        ("aggregation", "token-sum"),
        ("estimator", "chain"),
        ("mode", "dpo"),
        ("credit", "median"),
    ],
)
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"LossConfig.{field}"):
        LossConfig(**{field: value})

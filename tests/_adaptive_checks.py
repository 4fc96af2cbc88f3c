"""Adaptive clipping on the Keras 3 backends with a train step of keras_dpsgd's own (JAX, torch): per-layer Three
Tools, flat, quantile, divide_by_bound. The bound update against a one-example loop, a discarded partial lot's
norm sums, the norm query's noise and ε against the accountant, and a hook of one's own refused.

tests/backends/jax/test_jax_adaptive.py and tests/backends/torch/test_torch_adaptive.py collect the checks
(``__all__``) with ``import *``, each in its own child process on its own backend (the rules themselves, once
per array table: tests/dp/test_adaptive.py).
"""

import math

import keras
import numpy as np
import pytest
from scipy import stats

import keras_dpsgd.keras3 as k3
from keras_dpsgd import model_epsilon
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.tools import adaptive_clipping as ac
from tests._behaviour import built, keras3_front
from tests._keras3_helpers import example_grads

__all__ = [
    "test_bound_update_and_step_match_a_one_example_loop",
    "test_a_discarded_partial_lot_takes_its_norm_sums_with_it",
    "test_norm_query_noise_is_gaussian_with_scale_sigma_beta_c_and_charged_by_the_ledger",
    "test_a_hook_of_ones_own_on_an_adaptive_optimizer_is_refused",
]

FRONT = keras3_front()
LR = 0.5


def _group_norms(grads, per_layer):
    """[B, G] ‖g_i^g‖, one example at a time (flat: one group of all variables)."""
    norms = np.array([[np.linalg.norm(g) for g in row] for row in grads])
    return norms if per_layer else np.sqrt(np.sum(norms**2, axis=1, keepdims=True))


def _expected(grads, bounds, per_layer, rule, alpha, beta, eta, target, lot, divide):
    """(the step's mean clipped gradient /C if divide_by_bound, the next bounds) by the papers' formulas."""
    norms = _group_norms(grads, per_layer)
    groups = list(range(len(grads[0]))) if per_layer else [0] * len(grads[0])
    total = [np.zeros_like(g) for g in grads[0]]
    for row, n in zip(grads, norms):
        for v, g in enumerate(row):
            c = bounds[groups[v]]
            total[v] += g * min(1.0, c / n[groups[v]]) / (c if divide else 1.0)
    if rule == "mean":
        new = alpha * np.minimum(norms, beta * bounds[None, :]).sum(axis=0) / lot
    else:
        below = (norms <= bounds[None, :]).sum(axis=0) / lot
        new = bounds * np.exp(-eta * (below - target))
    return [t / lot for t in total], np.maximum(new, 1e-6)


@pytest.mark.parametrize(
    "per_layer, rule, divide, k",
    [(True, "mean", False, 1), (False, "quantile", True, 2)],
)
def test_bound_update_and_step_match_a_one_example_loop(per_layer, rule, divide, k):
    """Zero noise: the bounds move by Three Tools' / Andrew et al.'s rule from the lot's norms, the step clips to the
    bounds in force. With k = 2 the two batches of a lot make one query (accumulated), released once."""
    model, x, y = built(FRONT, "dense")
    bounds = np.array([0.3, 0.05, 0.2, 0.08]) if per_layer else np.array([0.4])
    alpha, beta, eta, target = 1.3, 2.0, 0.7, 0.4
    opt = FRONT.compiled(
        model,
        k3.AdaptiveDPSGDOptimizer,
        l2_norm_clip=list(bounds) if per_layer else float(bounds[0]),
        norm_noise_multiplier=0.0,
        alpha=alpha,
        beta=beta,
        rule=rule,
        target_quantile=target,
        quantile_learning_rate=eta,
        divide_by_bound=divide,
        gradient_accumulation_steps=k,
        learning_rate=LR,
    ).optimizer
    x, y = x[:6], y[:6]
    for _ in range(2):  # the second lot is clipped to the bounds the first one set
        grads = example_grads(model, x, y, FRONT.loss())
        step, new = _expected(grads, bounds, per_layer, rule, alpha, beta, eta, target, len(x), divide)
        before = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
        logger = k3.ClipBoundsLogger(update_freq=0)
        hist = model.fit(x, y, batch_size=len(x) // k, epochs=1, shuffle=False, verbose=0, callbacks=[logger])
        after = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
        for b, a, g in zip(before, after, step):
            np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)
        saved = np.asarray(opt.clip_bounds.numpy(), np.float64)
        np.testing.assert_allclose(saved, new[:, None].repeat(len(saved) // len(new), 1).ravel(), rtol=2e-5)
        logged = hist.history["clip_bound/" + model.trainable_variables[-1].path][-1]
        assert logged == pytest.approx(saved[-1], rel=1e-6)  # ClipBoundsLogger reads the step's bounds
        assert not np.allclose(new, bounds)  # the bounds moved
        bounds = new
    assert int(opt.noised_steps.numpy()) == 2
    np.testing.assert_array_equal(opt._norm_sums.numpy(), 0.0)  # zeroed after each release


def test_a_discarded_partial_lot_takes_its_norm_sums_with_it():
    """k = 2, 3 batches per fit: the third batch makes an incomplete lot, discarded at the end of fit
    (``AdaptiveClippingCore.discard_partial_lot``). Its query terms leave
    with it: the sums are zero, and the next fit's first lot sets its bounds from its own 4 examples only (an
    example of the discarded batch would otherwise count in a lot it was never sampled into: twice the
    query's sensitivity)."""
    model, x, y = built(FRONT, "dense")
    x, y = x[:6], y[:6]
    bounds, beta = np.array([0.3, 0.05, 0.2, 0.08]), 2.0
    opt = FRONT.compiled(
        model,
        k3.AdaptiveDPSGDOptimizer,
        l2_norm_clip=list(bounds),
        norm_noise_multiplier=0.0,
        beta=beta,
        gradient_accumulation_steps=2,
        learning_rate=0.0,  # the norms stay fixed
    ).optimizer
    norms = _group_norms(example_grads(model, x, y, FRONT.loss()), True)
    for fit in range(2):
        model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
        assert (opt.discarded_lots, int(opt.noised_steps.numpy())) == (fit + 1, fit + 1)
        np.testing.assert_array_equal(opt._norm_sums.numpy(), 0.0)
        new = np.minimum(norms[:4], beta * bounds[None, :]).sum(axis=0) / 4  # α = 1, lot = examples 0-3
        np.testing.assert_allclose(np.asarray(opt.clip_bounds.numpy(), np.float64), new, rtol=2e-5)
        assert not np.allclose(new, bounds)
        bounds = new


def test_norm_query_noise_is_gaussian_with_scale_sigma_beta_c_and_charged_by_the_ledger():
    """z = (L·C_new/α − Σ min(‖g‖, βC)) / (σ_q β C) is N(0, 1) (lr = 0: the gradients stay fixed); the ledger's ε
    is the gradient's and the queries' releases composed (Three Tools, Sec. 3), above the gradient's alone."""
    model, x, y = built(FRONT, "dense")
    q, sigma, sigma_q, beta, steps = 0.25, 1.2, 1.5, 2.0, 8
    opt = FRONT.compiled(
        model,
        k3.AdaptiveDPSGDOptimizer,
        l2_norm_clip=[1.0] * 4,
        noise_multiplier=sigma,
        norm_noise_multiplier=sigma_q,
        beta=beta,
        learning_rate=0.0,
        min_clip_bound=1e-9,
        sampling_rate=q,
        expected_lot_size=float(len(x)),
        seed=None,
        assume_poisson=True,
    ).optimizer
    norms = _group_norms(example_grads(model, x, y, FRONT.loss()), True)
    zs, prev = [], np.ones(4)
    for _ in range(steps):
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
        new = np.asarray(opt.clip_bounds.numpy(), np.float64)
        zs.extend((len(x) * new - np.minimum(norms, beta * prev[None, :]).sum(axis=0)) / (sigma_q * beta * prev))
        prev = new
    zs = np.array(zs)
    assert abs(zs.mean()) < 4 / math.sqrt(len(zs))
    assert 0.6 < zs.std() < 1.4
    assert stats.kstest(zs, "norm").pvalue > 1e-4

    assert int(opt.noised_steps.numpy()) == steps
    event = ac.adaptive_clipping_event(
        noise_multiplier=sigma, norm_noise_multiplier=sigma_q, num_layers=4, sampling_rate=q, steps=steps
    )
    eps, _ = model_epsilon(model, target_delta=1e-5)
    assert eps == pytest.approx(compute_epsilon([event], 1e-5), rel=1e-9)
    gradients_only = PoissonSampledGaussianEvent(q, sigma / 2, count=steps)  # σ/√V, no queries
    assert compute_epsilon([gradients_only], 1e-5) < eps


def test_a_hook_of_ones_own_on_an_adaptive_optimizer_is_refused():
    class Canary(k3.AdaptiveDPSGDOptimizer):
        def on_noised_step(self, num_examples):
            super().on_noised_step(num_examples)

    model, x, y = built(FRONT, "dense")
    FRONT.compiled(model, Canary, l2_norm_clip=1.0, norm_noise_multiplier=1.0)
    before = [np.array(v.numpy()) for v in model.trainable_variables]
    with pytest.raises(ValueError, match="Canary overrides on_noised_step .*not supported on the (JAX|torch) backend"):
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())
    keras.backend.clear_session()

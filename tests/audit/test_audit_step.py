"""The white-box step audit (issue 30): its statistics in closed form, the hook's record, soundness on a
correct optimizer, detection of a noise scaled by 0.8, 0.5 and 0 (tf_keras; Keras 3 in test_keras3_audit.py).

The setting is the issue's: digits, a 64-unit MLP, lots of 64, two epochs, C = 10, σ = 1, δ = 1/N^1.1
(the CLI's default then; claimed ε = 2.07 by the RDP accountant).
"""

import math

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from keras_dpsgd.data.datasets import load_digits
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.audit import (
    gdp_delta,
    gdp_epsilon,
    noise_multiplier_upper_bound,
    subsampled_gaussian_epsilon_lower,
    with_step_audit,
)
from keras_dpsgd.tf_keras import DPSGDOptimizer
from tests._audit_helpers import scaled_noise, step_audit_run, without_noise


@pytest.fixture(scope="module")
def digits():
    return load_digits()


# ------------------------------------------------------- ε conversion, closed form
@pytest.mark.parametrize("mu,delta", [(0.5, 1e-5), (1.0, 1e-5), (3.0, 1e-3)])
def test_gdp_epsilon_inverts_the_dong_roth_su_curve(mu, delta):
    from scipy.stats import norm

    eps = gdp_epsilon(mu, delta)
    assert eps > 0
    closed = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
    assert closed == pytest.approx(delta, rel=1e-8) and gdp_delta(mu, eps) == pytest.approx(delta, rel=1e-8)


def test_epsilon_lower_against_dp_accounting():
    """q = 1: T Gaussian steps are exactly √T/σ-GDP, and dp_accounting's pessimistic PLD agrees from above;
    q < 1: the optimistic bound sits just below dp_accounting's pessimistic one and below RDP's."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    def pessimistic(sigma, q, steps, delta):
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
        event = dp_event.GaussianDpEvent(sigma)
        acc.compose(event if q == 1 else dp_event.PoissonSampledDpEvent(q, event), steps)
        return acc.get_epsilon(delta)

    exact = subsampled_gaussian_epsilon_lower(2.0, 1.0, 9, 1e-5)
    assert exact == pytest.approx(gdp_epsilon(1.5, 1e-5), rel=1e-9)
    assert exact == pytest.approx(pessimistic(2.0, 1.0, 9, 1e-5), abs=2e-3)
    q, steps, delta = 64 / 1347, 44, 1347**-1.1
    for sigma in (0.8, 1.0):
        lower = subsampled_gaussian_epsilon_lower(sigma, q, steps, delta)
        assert pessimistic(sigma, q, steps, delta) - 0.05 < lower <= pessimistic(sigma, q, steps, delta)
        assert lower < compute_epsilon(PoissonSampledGaussianEvent(q, sigma, steps), delta)


def test_epsilon_lower_edges():
    assert subsampled_gaussian_epsilon_lower(0.0, 0.05, 44, 1e-5) == math.inf  # the join shows
    assert subsampled_gaussian_epsilon_lower(0.0, 1e-9, 1, 1e-5) == 0.0  # joins less often than δ
    assert subsampled_gaussian_epsilon_lower(math.inf, 0.05, 44, 1e-5) == 0.0
    # below σ = 0.2 the bound stays that of 0.2: monotone, still a lower bound
    assert subsampled_gaussian_epsilon_lower(0.01, 0.05, 4, 1e-5) == subsampled_gaussian_epsilon_lower(
        0.2, 0.05, 4, 1e-5
    )
    with pytest.raises(ValueError, match="sampling_rate"):
        subsampled_gaussian_epsilon_lower(1.0, 0.0, 4, 1e-5)
    with pytest.raises(ValueError, match="noise_multiplier"):
        subsampled_gaussian_epsilon_lower(-1.0, 0.5, 4, 1e-5)


# ------------------------------------------------------- the noise bound's coverage
def test_noise_multiplier_upper_bound_covers_at_the_stated_confidence():
    """Correct Gaussian observations (σ = 1, shift 1), small samples, 4,000 repetitions: the bound falls
    below the truth at most 5% of the time (+ 3 binomial standard deviations); each half of the union
    bound (noise high, shift low) misses at its exact 2.5%."""
    rng = np.random.default_rng(0)
    reps, n0, n1 = 4000, 60, 15
    z = rng.normal(size=(reps, n0))
    shift = 1.0 + rng.normal(size=(reps, n1))
    bounds = [
        noise_multiplier_upper_bound(n0, (z[r] ** 2).sum(), n1, shift[r].sum(), (shift[r] ** 2).sum())
        for r in range(reps)
    ]
    slack = 3 * math.sqrt(0.05 * 0.95 / reps)
    assert np.mean([b["noise_multiplier_upper_bound"] < 1.0 for b in bounds]) <= 0.05 + slack
    assert np.mean([b["noise_multiplier_high"] < 1.0 for b in bounds]) == pytest.approx(0.025, abs=0.008)
    assert np.mean([b["shift_lower_bound"] > 1.0 for b in bounds]) == pytest.approx(0.025, abs=0.008)


def test_noise_multiplier_upper_bound_closed_form():
    from scipy import stats

    out = noise_multiplier_upper_bound(100, 81.0, 1, 1.0, 1.0, confidence=0.9)
    assert out["noise_multiplier_high"] == pytest.approx(math.sqrt(81.0 / stats.chi2.ppf(0.05, 100)), rel=1e-12)
    assert out["noise_multiplier_estimate"] == pytest.approx(0.9)
    assert out["noise_multiplier_upper_bound"] == math.inf  # one canary join: no bound on the shift
    with pytest.raises(ValueError, match="noise_count"):
        noise_multiplier_upper_bound(0, 1.0, 2, 2.0, 2.0)


# ------------------------------------------------------- the hook's record
def test_step_record_in_closed_form_and_refusals():
    """σ = 0, q = 1: every canary joins; the record holds n1 = m shifts of exactly 1 and n0 = d − m zeros."""
    variables = [tf.Variable(tf.zeros([3, 4])), tf.Variable(tf.zeros([5]))]
    opt = with_step_audit(DPSGDOptimizer)(l2_norm_clip=2.0, noise_multiplier=0.0)
    opt.build(variables)
    opt.install_gradient_canaries(variables, np.ones(6, bool), rng=np.random.default_rng(0), sampling_rate=1.0, steps=2)
    summed = [tf.fill([3, 4], 0.5), tf.fill([5], -0.25)]
    opt.add_noise(summed)
    opt.add_noise(summed)
    np.testing.assert_allclose(opt.step_statistics(), [[11.0, 0.0, 6.0, 6.0, 6.0]] * 2, atol=1e-12)
    with pytest.raises(tf.errors.InvalidArgumentError, match="installed for 2 steps"):
        opt.add_noise(summed)
    per_layer = with_step_audit(DPSGDOptimizer)(l2_norm_clip=[1.0, 2.0], noise_multiplier=1.0)
    per_layer.build(variables)
    with pytest.raises(ValueError, match="flat clipping"):
        per_layer.install_gradient_canaries(
            variables, np.ones(2, bool), rng=np.random.default_rng(0), sampling_rate=1.0, steps=1
        )


# ------------------------------------------------------- acceptance (issue 30)
def test_soundness_correct_optimizer(digits):
    """A correct optimizer over two seeds: not flagged, and the measured noise is σ to 1%."""
    for seed in (1, 2):
        result = step_audit_run(tf_keras, digits, seed=seed)
        assert result.epsilon == pytest.approx(2.07, abs=0.01)
        assert not result.is_violation and 0.0 < result.epsilon_lower_bound < result.epsilon, result
        assert result.noise_multiplier_estimate == pytest.approx(1.0, rel=0.01)
        assert result.shift_estimate == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("factor", [0.8, 0.5, 0.0])
def test_detects_noise_scaled_below_the_charged(digits, factor):
    broken = without_noise(DPSGDOptimizer) if factor == 0 else scaled_noise(DPSGDOptimizer, factor)
    result = step_audit_run(tf_keras, digits, seed=3, optimizer_cls=broken)
    assert result.noise_multiplier == 1.0 and result.epsilon == pytest.approx(2.07, abs=0.01)  # what is charged
    assert result.is_violation and result.verdict().startswith("BUG"), result
    assert result.noise_multiplier_estimate == pytest.approx(factor, abs=0.01)
    if factor == 0:
        assert result.epsilon_lower_bound == math.inf

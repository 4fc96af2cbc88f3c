"""RDP of the subsampled Gaussian and the (ε, δ) conversions, against dp_accounting and closed forms."""

import itertools
import math

import numpy as np
import pytest
from scipy import integrate, special

from keras_dpsgd.accounting import (
    DEFAULT_ORDERS,
    MOMENTS_ORDERS,
    TF_PRIVACY_LEGACY_ORDERS,
    GaussianEvent,
    MomentsAccountant,
    PoissonSampledGaussianEvent,
    RdpAccountant,
    compute_epsilon_and_order,
    delta_from_rdp,
    epsilon_from_rdp,
    rdp_gaussian,
    rdp_poisson_subsampled_gaussian,
    steps_for_epochs,
)

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp  # noqa: E402

QS = [1e-3, 0.01, 0.1, 0.5, 1.0]
SIGMAS = [0.5, 0.8, 1.3, 4.0]


def _oracle_rdp(q, sigma, orders=DEFAULT_ORDERS):
    acc = dpa_rdp.RdpAccountant(list(orders))
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)))
    return np.asarray(acc._rdp)


_ORACLE = {}


def _oracle(q, sigma):
    if (q, sigma) not in _ORACLE:
        _ORACLE[(q, sigma)] = _oracle_rdp(q, sigma)
    return _ORACLE[(q, sigma)]


def test_default_orders_are_dp_accountings():
    assert np.array_equal(np.asarray(DEFAULT_ORDERS), np.asarray(dpa_rdp.DEFAULT_RDP_ORDERS, dtype=float))
    assert MOMENTS_ORDERS == tuple(float(a) for a in range(2, 34))


@pytest.mark.parametrize("q,sigma", list(itertools.product(QS, SIGMAS)))
def test_rdp_matches_dp_accounting_on_default_orders(q, sigma):
    mine = rdp_poisson_subsampled_gaussian(q, sigma)
    ref = _oracle(q, sigma)
    # dp_accounting gives ∞ for orders whose fractional series does not converge; so do we.
    assert np.array_equal(np.isfinite(mine), np.isfinite(ref))
    fin = np.isfinite(ref)
    assert fin.sum() > 100
    np.testing.assert_allclose(mine[fin], ref[fin], rtol=1e-6, atol=0)


@pytest.mark.parametrize("q,sigma", list(itertools.product(QS, SIGMAS)))
@pytest.mark.parametrize("steps", [1, 100, 10_000])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-8])
def test_epsilon_matches_dp_accounting(q, sigma, steps, delta):
    eps, order = compute_epsilon_and_order(PoissonSampledGaussianEvent(q, sigma, steps), delta)
    ref_eps, ref_order = dpa_rdp.compute_epsilon(DEFAULT_ORDERS, steps * _oracle(q, sigma), delta)
    assert eps == pytest.approx(ref_eps, rel=1e-6, abs=1e-12)
    if ref_eps > 0:
        assert order == ref_order


def test_gaussian_rdp_is_the_closed_form_exactly():
    alphas = np.asarray(DEFAULT_ORDERS)
    for sigma in [0.3, 1.0, 7.5]:
        expected = alphas / (2 * sigma**2)
        assert np.array_equal(rdp_poisson_subsampled_gaussian(1.0, sigma), expected)
        assert np.array_equal(rdp_gaussian(sigma), expected)
        acc = RdpAccountant().compose(GaussianEvent(sigma, count=7))
        np.testing.assert_allclose(acc.rdp, 7 * expected, rtol=1e-15)


def test_zero_noise_is_infinite_and_results_are_read_only():
    assert np.isinf(rdp_poisson_subsampled_gaussian(0.01, 0.0)).all()
    assert np.isinf(rdp_gaussian(0.0)).all()
    r = rdp_poisson_subsampled_gaussian(0.01, 1.0)
    with pytest.raises(ValueError):
        r[0] = 0.0  # cached arrays must not be corrupted by callers


def test_rdp_increases_with_q_and_decreases_with_sigma():
    a = rdp_poisson_subsampled_gaussian(0.01, 1.0)
    assert (rdp_poisson_subsampled_gaussian(0.02, 1.0) >= a).all()
    assert (rdp_poisson_subsampled_gaussian(0.01, 1.1) <= a).all()


def _rdp_by_quadrature(q, sigma, alpha):
    """ε_RDP(α) = log(A_α)/(α-1), A_α - 1 = ∫ μ0(z)[(1 - q + q μ1/μ0)^α - 1] dz (Abadi Eq. 3-4)."""

    def f(z):
        log_pdf = -z * z / (2 * sigma**2) - math.log(sigma * math.sqrt(2 * math.pi))
        power = alpha * math.log1p(q * math.expm1((2 * z - 1) / (2 * sigma**2)))
        if power > 700:
            return math.exp(log_pdf + power)
        return math.exp(log_pdf) * math.expm1(power)

    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    lo, hi = -40 * sigma, 40 * sigma + alpha
    pts = sorted({0.0, 0.5, min(max(z0, lo + 1), hi - 1)})
    val, _ = integrate.quad(f, lo, hi, points=pts, limit=500, epsabs=0, epsrel=1e-11)
    return math.log1p(val) / (alpha - 1)


@pytest.mark.parametrize("q,sigma", [(0.01, 1.0), (0.1, 2.0), (0.05, 1.5)])
def test_series_against_numerical_integration(q, sigma):
    orders = [2.0, 3.0, 8.0, 1.5, 2.5, 4.5, 8.5]
    mine = rdp_poisson_subsampled_gaussian(q, sigma, orders)
    exact = np.array([_rdp_by_quadrature(q, sigma, a) for a in orders])
    # Integer orders: the finite binomial sum is exact.
    np.testing.assert_allclose(mine[:3], exact[:3], rtol=1e-6)
    # Fractional orders: the series of |terms| is an upper bound (conservative) and close.
    assert (mine[3:] >= exact[3:] * (1 - 1e-7)).all()
    # (up to ~30% above the exact value at α = 1.5, as in dp_accounting; tight at larger α)
    assert (mine[3:] <= exact[3:] * 1.5).all()
    np.testing.assert_allclose(mine[-2:], exact[-2:], rtol=1e-3)


def test_tight_conversion_is_dp_accountings_and_classic_is_mironov_prop3():
    rdp = 3000 * rdp_poisson_subsampled_gaussian(0.004, 1.1)
    alphas = np.asarray(DEFAULT_ORDERS)
    for delta in [1e-3, 1e-6, 1e-10]:
        assert epsilon_from_rdp(DEFAULT_ORDERS, rdp, delta) == pytest.approx(
            dpa_rdp.compute_epsilon(DEFAULT_ORDERS, rdp, delta), rel=1e-12
        )
        classic = np.min(rdp + math.log(1 / delta) / (alphas - 1))
        assert epsilon_from_rdp(DEFAULT_ORDERS, rdp, delta, "classic")[0] == pytest.approx(classic, rel=1e-12)
        assert epsilon_from_rdp(DEFAULT_ORDERS, rdp, delta)[0] < classic
        d, _ = delta_from_rdp(DEFAULT_ORDERS, rdp, epsilon_from_rdp(DEFAULT_ORDERS, rdp, delta)[0])
        assert d == pytest.approx(delta, rel=1e-6)
    with pytest.raises(ValueError, match="conversion must be one of"):
        epsilon_from_rdp(DEFAULT_ORDERS, rdp, 1e-5, "loose")


def _gaussian_exact_delta(sigma, eps):
    """Exact δ(ε) of the Gaussian mechanism, sensitivity 1 (Balle & Wang 2018, Thm 8)."""
    return special.ndtr(-eps * sigma + 1 / (2 * sigma)) - math.exp(eps) * special.ndtr(-eps * sigma - 1 / (2 * sigma))


@pytest.mark.parametrize("sigma,count", [(1.0, 1), (2.0, 10), (5.0, 100)])
@pytest.mark.parametrize("conversion", ["tight", "classic"])
def test_rdp_epsilon_is_valid_for_the_gaussian_mechanism(sigma, count, conversion):
    eps = RdpAccountant(conversion=conversion).compose(GaussianEvent(sigma, count)).get_epsilon(1e-5)
    # k Gaussian releases = one Gaussian with σ/√k; the true δ at the reported ε is at most 1e-5.
    assert _gaussian_exact_delta(sigma / math.sqrt(count), eps) <= 1e-5


def test_anchor_tf_privacy_test_case_tight_conversion():
    # TF Privacy's test case: N=60000, B=150, σ=1.3, 15 epochs, δ=1e-5 -> ε = 0.72422 (order 19).
    steps = 6000  # TF Privacy's ceil(E·N/B); also keras_dpsgd's E·ceil(N/B) here (N/B = 400)
    assert steps_for_epochs(60000, 150, 15) == steps
    event = PoissonSampledGaussianEvent(150 / 60000, 1.3, steps)
    for orders in (DEFAULT_ORDERS, TF_PRIVACY_LEGACY_ORDERS):
        eps, order = RdpAccountant(orders).compose(event).get_epsilon_and_order(1e-5)
        assert eps == pytest.approx(0.72422, abs=5e-6)
        assert order == 19.0
    ref = dpa_rdp.RdpAccountant()
    ref.compose(dp_accounting.PoissonSampledDpEvent(150 / 60000, dp_accounting.GaussianDpEvent(1.3)), steps)
    assert ref.get_epsilon(1e-5) == pytest.approx(0.72422, abs=5e-6)


def test_anchor_tf_privacy_tutorial_classic_conversion():
    # TF Privacy tutorial: N=60000, B=256, σ=1.1, 60 epochs, δ=1e-5 -> "ε = 3.01". Reproduced by the
    # classic conversion (Abadi Thm 2.2 / Mironov Prop 3) on TF Privacy's old grid (1.1..10.9, 12..63),
    # which gives 3.0084, and by the moments accountant (integer λ <= 32), 3.0092.
    steps = 14063  # TF Privacy's ceil(E·N/B); keras_dpsgd's epoch is ceil(N/B) = 235 lots: 14100 steps
    event = PoissonSampledGaussianEvent(256 / 60000, 1.1, steps)
    legacy = RdpAccountant(TF_PRIVACY_LEGACY_ORDERS, conversion="classic").compose(event).get_epsilon(1e-5)
    moments = MomentsAccountant().compose(event).get_epsilon(1e-5)
    assert legacy == pytest.approx(3.0084, abs=1e-4) and round(legacy, 2) == 3.01
    assert moments == pytest.approx(3.0092, abs=1e-4) and round(moments, 2) == 3.01
    # The tight conversion gives the smaller, still valid 2.5967.
    assert RdpAccountant().compose(event).get_epsilon(1e-5) == pytest.approx(2.5967, abs=1e-4)


@pytest.mark.parametrize("orders", [[], [1.0], [0.5], [float("nan")], [float("inf")]])
def test_bad_orders(orders):
    with pytest.raises(ValueError, match=r"orders(\[0\])? must be"):
        rdp_poisson_subsampled_gaussian(0.1, 1.0, orders)


@pytest.mark.parametrize("q,sigma", [(0.01, 1.0), (0.3, 2.5)])
def test_custom_unsorted_orders_match_dp_accounting(q, sigma):
    orders = [300.0, 2.0, 1.5, 1000.0, 7.0, 2.25, 100.0, 65.0, 3.0, 200.0]
    mine = rdp_poisson_subsampled_gaussian(q, sigma, orders)
    np.testing.assert_allclose(mine, _oracle_rdp(q, sigma, orders), rtol=1e-6)

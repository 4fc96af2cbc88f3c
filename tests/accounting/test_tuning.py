"""The privacy cost of tuning (Papernot & Steinke 2022): the event, its bound, its serialization.

The bound is checked three ways: against a second implementation of Theorems 2 and 6 written here in
mpmath from the paper's formulas (E[K] summed from the probabilities, not from its closed form; the
conversion to (ε, δ) written out again), against the exact Rényi divergence of a search whose trial
is a Gaussian mechanism (numerical integration of the best-of-K density), and against the naive
composition of a fixed number of trials.
"""

import json
import math

import mpmath
import numpy as np
import pytest

from keras_dpsgd.accounting import (
    DEFAULT_ORDERS,
    GaussianEvent,
    GaussianThresholdingEvent,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    TuningEvent,
    compute_epsilon,
    expected_trials,
    rdp_poisson_subsampled_gaussian,
    rdp_tuning,
    sample_trials,
)
from keras_dpsgd.accounting import tuning as T

mpmath.mp.dps = 40
DELTA = 1e-5
SUBSAMPLED = PoissonSampledGaussianEvent(0.01, 1.0, 1000)  # ε ≈ 2.1 at δ = 1e-5 alone


# ---------------------------------------------------------------- a second implementation, in mpmath
def _mean_by_sum(distribution, mu=None, eta=None, gamma=None):
    """E[K] = Σ k P[K = k], the truncated negative binomial probabilities summed (not the closed form)."""
    if distribution == "poisson":
        return mpmath.mpf(mu)
    eta, gamma = mpmath.mpf(eta), mpmath.mpf(gamma)

    def weight(k):  # C(k + η − 1, k)(1 − γ)^k, k >= 1
        return mpmath.binomial(k + eta - 1, k) * (1 - gamma) ** k

    if eta == 0:  # the limit: logarithmic, (1 − γ)^k / k
        return mpmath.nsum(lambda k: (1 - gamma) ** k, [1, mpmath.inf]) / mpmath.nsum(
            lambda k: (1 - gamma) ** k / k, [1, mpmath.inf]
        )
    return mpmath.nsum(lambda k: k * weight(k), [1, mpmath.inf]) / mpmath.nsum(weight, [1, mpmath.inf])


def _delta_at(orders, curve, eps):
    """Smallest δ at ε over the orders: Canonne-Kamath-Steinke 2020 Prop 12, and the KL bound."""
    best = mpmath.mpf(1)
    for a, r in zip(orders, curve):
        a = mpmath.mpf(a)
        if a > mpmath.mpf("1.01"):
            best = min(best, mpmath.exp((a - 1) * (r - eps + mpmath.log(1 - 1 / a)) - mpmath.log(a)))
        best = min(best, mpmath.sqrt(1 - mpmath.exp(-r)))
    return best


def _epsilon_at(orders, curve, delta):
    """Smallest ε at δ over the orders (the same conversion, solved for ε)."""
    best = mpmath.inf
    for a, r in zip(orders, curve):
        a = mpmath.mpf(a)
        if delta >= mpmath.sqrt(1 - mpmath.exp(-r)):
            return mpmath.mpf(0)
        if a > mpmath.mpf("1.01"):
            best = min(best, r + mpmath.log(1 - 1 / a) - (mpmath.log(delta) + mpmath.log(a)) / (a - 1))
    return max(best, mpmath.mpf(0))


def _paper_epsilon(trial_curve, distribution, delta=DELTA, **params):
    """ε at δ of the search, Theorem 2 (truncated negative binomial) or Theorem 6 (Poisson), in mpmath."""
    orders = [mpmath.mpf(a) for a in DEFAULT_ORDERS]
    curve = [mpmath.mpf(float(r)) for r in trial_curve]
    log_mean = mpmath.log(_mean_by_sum(distribution, **params))
    out = []
    for lam, r in zip(orders, curve):
        if distribution == "poisson":
            eps_hat = mpmath.log(1 + 1 / (lam - 1))  # Theorem 6: e^ε̂ <= 1 + 1/(λ − 1)
            extra = params["mu"] * _delta_at(orders, curve, eps_hat)
        else:
            eta, gamma = mpmath.mpf(params["eta"]), mpmath.mpf(params["gamma"])
            extra = min(
                (1 + eta) * (1 - 1 / lh) * rh + (1 + eta) * mpmath.log(1 / gamma) / lh for lh, rh in zip(orders, curve)
            )
        out.append(r + extra + log_mean / (lam - 1))
    return float(_epsilon_at(orders, out, mpmath.mpf(delta)))


def _gaussian_curve(sigma, count):
    return [count * a / (2 * sigma * sigma) for a in DEFAULT_ORDERS]  # closed form, Mironov 2017 Prop 7


CASES = [
    ("poisson", {"mu": 10.0}),
    ("poisson", {"mu": 1.0}),
    ("truncated_negative_binomial", {"eta": 0.0, "gamma": 0.05}),
    ("truncated_negative_binomial", {"eta": 1.0, "gamma": 0.1}),
    ("truncated_negative_binomial", {"eta": 0.5, "gamma": 0.2}),
]


@pytest.mark.parametrize("distribution,params", CASES)
def test_epsilon_equals_the_papers_bound_for_a_gaussian_trial(distribution, params):
    event = TuningEvent(distribution, (GaussianEvent(8.0, count=4),), **params)
    expected = _paper_epsilon(_gaussian_curve(8.0, 4), distribution, **params)
    assert compute_epsilon(event, DELTA) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("distribution,params", CASES[::2])
def test_epsilon_equals_the_papers_bound_for_dp_sgd_trials(distribution, params):
    # The trial's curve comes from the library's sub-sampled Gaussian RDP (checked against dp_accounting in
    # test_accounting_rdp.py); the bound on top of it is computed here again.
    event = TuningEvent(distribution, (SUBSAMPLED,), **params)
    trial = 1000 * rdp_poisson_subsampled_gaussian(0.01, 1.0)
    expected = _paper_epsilon(trial, distribution, **params)
    assert compute_epsilon(event, DELTA) == pytest.approx(expected, rel=1e-9)


def test_expected_trials_closed_forms_equal_the_sums():
    for distribution, params in CASES:
        event = TuningEvent(distribution, (SUBSAMPLED,), **params)
        assert expected_trials(event) == pytest.approx(float(_mean_by_sum(distribution, **params)), rel=1e-12)
    geometric = TuningEvent("truncated_negative_binomial", (SUBSAMPLED,), eta=1.0, gamma=0.1)
    assert expected_trials(geometric) == pytest.approx(10.0)  # the geometric: 1/γ


# ---------------------------------------------------------------- the bound against an exact divergence
def _pgf_derivative(distribution, params, x):
    """f'(x) of f(x) = E[x^K] (P[max of K draws <= y] = f(F(y))), and P[K = 0]."""
    if distribution == "poisson":
        mu = params["mu"]
        return mu * np.exp(mu * (x - 1.0)), math.exp(-mu)
    eta, gamma = params["eta"], params["gamma"]
    # f(x) = ((1 − (1 − γ)x)^(−η) − 1) / (γ^(−η) − 1), the truncated negative binomial (η ≠ 0)
    return eta * (1.0 - gamma) * (1.0 - (1.0 - gamma) * x) ** (-eta - 1.0) / (gamma**-eta - 1.0), 0.0


def _best_of_k_divergence(distribution, params, shift, sigma, lam):
    """D_λ of the best of K draws of N(shift, σ²) from the best of K draws of N(0, σ²) (K = 0: ⊥)."""
    from scipy import stats

    y = np.linspace(-14 * sigma - abs(shift), 14 * sigma + abs(shift), 40001)

    def density(m):
        slope, _ = _pgf_derivative(distribution, params, stats.norm.cdf(y, m, sigma))
        return stats.norm.pdf(y, m, sigma) * slope

    p, q = density(shift), density(0.0)
    mask = (p > 0) & (q > 0)
    _, nothing = _pgf_derivative(distribution, params, 0.0)
    total = np.trapezoid(np.where(mask, p, 0.0) ** lam * np.where(mask, q, 1.0) ** (1 - lam), y) + nothing
    return math.log(total) / (lam - 1)


@pytest.mark.parametrize(
    "distribution,params", [("poisson", {"mu": 3.0}), ("truncated_negative_binomial", {"eta": 1.0, "gamma": 0.2})]
)
def test_bound_is_above_the_exact_divergence_of_a_gaussian_search(distribution, params):
    sigma, orders = 2.0, (2.0, 4.0)
    event = TuningEvent(distribution, (GaussianEvent(sigma),), **params)
    bound = rdp_tuning(event, DEFAULT_ORDERS)
    for lam in orders:
        exact = max(
            _best_of_k_divergence(distribution, params, 1.0, sigma, lam),
            _best_of_k_divergence(distribution, params, -1.0, sigma, lam),
        )
        # the selection leaks (more than one trial's λ/(2σ²)), and the bound covers it
        assert lam / (2 * sigma * sigma) < exact <= bound[DEFAULT_ORDERS.index(lam)]


def test_poisson_below_one_trial_on_average_is_refused_since_the_bound_fails_there():
    # Theorem 6's log(μ)/(λ − 1) is negative for μ < 1: at μ = 0.5 the bound on a Gaussian search
    # falls below its exact divergence, so such a search is refused.
    sigma, lam, mu = 2.0, 2.0, 0.5
    exact = _best_of_k_divergence("poisson", {"mu": mu}, 1.0, sigma, lam)
    trial = lam / (2 * sigma * sigma)
    eps_hat = math.log1p(1.0 / (lam - 1.0))
    delta_hat = float(_delta_at([mpmath.mpf(a) for a in DEFAULT_ORDERS], _gaussian_curve(sigma, 1), eps_hat))
    assert exact > trial + mu * delta_hat + math.log(mu) / (lam - 1.0)
    with pytest.raises(ValueError, match=r"mu must be in \[1, inf\), got 0.5"):
        TuningEvent("poisson", (GaussianEvent(sigma),), mu=mu)


# ---------------------------------------------------------------- sanity and the naive way
def test_more_expected_trials_cost_more():
    poisson = [compute_epsilon(TuningEvent("poisson", SUBSAMPLED, mu=mu), DELTA) for mu in (1.0, 3.0, 10.0, 30.0)]
    tnb = [
        compute_epsilon(TuningEvent("truncated_negative_binomial", SUBSAMPLED, eta=1.0, gamma=g), DELTA)
        for g in (0.5, 0.2, 0.1, 0.02)
    ]
    assert np.all(np.diff(poisson) > 0) and np.all(np.diff(tnb) > 0)
    assert poisson[0] > compute_epsilon(SUBSAMPLED, DELTA)  # a search costs more than one run


def test_a_fixed_number_of_trials_composed_costs_more_than_a_random_number():
    # The setting: 10 DP-SGD runs of 1000 steps at q = 0.01, σ = 1 (each ε ≈ 2.10 at δ = 1e-5). Composing
    # the 10 runs (the naive way: k = 10 fixed, every run counted) gives ε ≈ 6.71; releasing the best of a
    # random K with E[K] = 10 gives ε ≈ 4.10 (geometric: η = 1, γ = 0.1) or ≈ 4.33 (Poisson, μ = 10).
    naive = compute_epsilon([SUBSAMPLED] * 10, DELTA)
    geometric = compute_epsilon(TuningEvent("truncated_negative_binomial", SUBSAMPLED, eta=1.0, gamma=0.1), DELTA)
    poisson = compute_epsilon(TuningEvent("poisson", SUBSAMPLED, mu=10.0), DELTA)
    assert naive == pytest.approx(6.71, abs=0.01)
    assert geometric == pytest.approx(4.10, abs=0.01) and poisson == pytest.approx(4.33, abs=0.01)
    assert naive > 1.5 * max(geometric, poisson)


def test_the_trial_is_the_largest_candidate_at_every_order():
    small = PoissonSampledGaussianEvent(0.01, 1.0, 100)
    event = TuningEvent("poisson", (small, SUBSAMPLED), mu=4.0)
    alone = TuningEvent("poisson", (SUBSAMPLED,), mu=4.0)
    np.testing.assert_array_equal(T.rdp_trial(event), 1000 * rdp_poisson_subsampled_gaussian(0.01, 1.0))
    assert compute_epsilon(event, DELTA) == compute_epsilon(alone, DELTA)


def test_count_composes_searches_and_the_moments_accountant_composes_too():
    event = TuningEvent("poisson", SUBSAMPLED, mu=2.0)
    twice = TuningEvent("poisson", SUBSAMPLED, mu=2.0, count=2)
    assert compute_epsilon(twice, DELTA) == pytest.approx(compute_epsilon([event, event], DELTA), rel=1e-12)
    assert compute_epsilon(event, DELTA, accountant="moments") >= compute_epsilon(event, DELTA)


def test_pld_accountant_refuses_a_search():
    pytest.importorskip("dp_accounting")
    with pytest.raises(ValueError, match="no bound for a hyperparameter search"):
        compute_epsilon(TuningEvent("poisson", SUBSAMPLED, mu=2.0), DELTA, accountant="pld")


def test_sampled_trials_follow_the_distribution():
    rng = np.random.default_rng(7)  # seeded for the test only; the default draws from OS entropy
    for distribution, params in CASES:
        event = TuningEvent(distribution, SUBSAMPLED, **params)
        draws = np.array([sample_trials(event, rng) for _ in range(4000)])
        assert distribution == "poisson" or draws.min() >= 1
        # the mean within 5 standard errors (a false alarm below 1e-6)
        assert abs(draws.mean() - expected_trials(event)) < 5 * draws.std() / math.sqrt(len(draws))
        probs = T.trial_probabilities(event, 2000)
        assert probs.sum() == pytest.approx(1.0, abs=1e-9)


# ---------------------------------------------------------------- serialization and validation
def test_a_search_round_trips_through_a_ledger_and_old_ledgers_hold_none():
    event = TuningEvent("truncated_negative_binomial", (SUBSAMPLED, GaussianEvent(3.0)), eta=0.0, gamma=0.05)
    ledger = PrivacyLedger([event, SUBSAMPLED])
    data = json.loads(json.dumps(ledger.to_dict()))
    assert data["version"] == 3
    assert PrivacyLedger.from_dict(data) == ledger
    with pytest.raises(ValueError, match="a version 2 ledger holds no 'tuning' event"):
        PrivacyLedger.from_dict(dict(data, version=2))
    with pytest.raises(ValueError, match="exactly the fields"):
        PrivacyLedger.from_dict(dict(data, events=[dict(data["events"][0], extra=1)]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"distribution": "uniform", "mu": 2.0}, r"distribution must be one of \('poisson', "),
        ({"distribution": "poisson", "mu": float("nan")}, r"mu must be in \[1, inf\), got nan"),
        ({"distribution": "poisson", "mu": True}, r"mu must be in \[1, inf\), got True"),
        ({"distribution": "poisson", "eta": 1.0}, r"takes the parameters \['mu'\].*missing \['mu'\]"),
        ({"distribution": "truncated_negative_binomial", "eta": -1.0, "gamma": 0.5}, r"eta must be in \(-1, inf\)"),
        ({"distribution": "truncated_negative_binomial", "eta": 0.0, "gamma": 1.0}, r"gamma must be in \(0, 1\)"),
        ({"distribution": "truncated_negative_binomial", "eta": 0.0}, r"missing \['gamma'\]"),
        ({"distribution": "truncated_negative_binomial", "eta": 0.0, "gamma": 0.5, "mu": 2.0}, r"not used \['mu'\]"),
    ],
)
def test_bad_parameters_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TuningEvent(candidates=(SUBSAMPLED,), **kwargs)


def test_candidates_must_be_gaussian_runs():
    with pytest.raises(ValueError, match="at least one event"):
        TuningEvent("poisson", (), mu=2.0)
    with pytest.raises(TypeError, match="GaussianThresholdingEvent"):
        TuningEvent("poisson", (GaussianThresholdingEvent(2.0, 1e-9),), mu=2.0)
    inner = TuningEvent("poisson", SUBSAMPLED, mu=2.0)
    with pytest.raises(TypeError, match="TuningEvent"):
        TuningEvent("poisson", (inner,), mu=2.0)


# ---------------------------------------------------------------- dp_accounting as the oracle
@pytest.mark.parametrize(
    "distribution,params",
    [
        ("poisson", {"mu": 10.0}),
        ("poisson", {"mu": 1.0}),
        ("truncated_negative_binomial", {"eta": 1.0, "gamma": 0.1}),
        ("truncated_negative_binomial", {"eta": 0.0, "gamma": 0.05}),
        ("truncated_negative_binomial", {"eta": 0.5, "gamma": 0.2}),
    ],
)
def test_epsilon_equals_dp_accountings_repeat_and_select(distribution, params):
    """dp_accounting's RDP accountant composes RepeatAndSelectDpEvent by Theorems 2 and 6 of arXiv:2110.03620v2
    (it maps E[K] back to γ by bisection, to 1e-9, and lowers each order's value to the smallest at a higher
    order, which can only lower its ε): ours equals it to 1e-6 and is never below it by more."""
    from dp_accounting import dp_event as E
    from dp_accounting.rdp import rdp_privacy_accountant as R

    event = TuningEvent(distribution, (SUBSAMPLED,), **params)
    trial = E.SelfComposedDpEvent(E.PoissonSampledDpEvent(0.01, E.GaussianDpEvent(1.0)), 1000)
    shape = math.inf if distribution == "poisson" else params["eta"]
    accountant = R.RdpAccountant(orders=list(DEFAULT_ORDERS))
    accountant.compose(E.RepeatAndSelectDpEvent(trial, expected_trials(event), shape))
    theirs = accountant.get_epsilon(DELTA)
    ours = compute_epsilon(event, DELTA)
    assert ours == pytest.approx(theirs, rel=1e-6)
    assert ours >= theirs * (1 - 1e-9)


def test_negative_eta_bound_is_above_the_exact_divergence():
    """η in (−1, 0) (outside dp_accounting's range): the bound still covers the exact divergence."""
    params, sigma = {"eta": -0.5, "gamma": 0.2}, 2.0
    bound = rdp_tuning(TuningEvent("truncated_negative_binomial", (GaussianEvent(sigma),), **params), DEFAULT_ORDERS)
    for lam in (2.0, 4.0):
        exact = max(_best_of_k_divergence("truncated_negative_binomial", params, s, sigma, lam) for s in (1.0, -1.0))
        assert 0 < exact <= bound[DEFAULT_ORDERS.index(lam)]

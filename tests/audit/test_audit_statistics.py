"""keras_dpsgd.audit.statistics against closed forms (pure numpy/scipy: no TensorFlow)."""

import math

import numpy as np
import pytest
from scipy import special, stats

from keras_dpsgd.audit import statistics as S


# ------------------------------------------------------------ Clopper-Pearson
@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (5, 10), (10, 10), (37, 1000), (999, 1000)])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.999])
def test_clopper_pearson_against_beta_quantiles(k, n, confidence):
    a = 1.0 - confidence
    low = 0.0 if k == 0 else stats.beta.ppf(a, k, n - k + 1)
    high = 1.0 if k == n else stats.beta.ppf(1 - a, k + 1, n - k)
    assert S.clopper_pearson_lower(k, n, confidence) == pytest.approx(low, rel=1e-12, abs=1e-15)
    assert S.clopper_pearson_upper(k, n, confidence) == pytest.approx(high, rel=1e-12, abs=1e-15)
    lo2, hi2 = S.clopper_pearson_interval(k, n, confidence)
    assert lo2 == pytest.approx(0.0 if k == 0 else stats.beta.ppf(a / 2, k, n - k + 1), rel=1e-12, abs=1e-15)
    assert hi2 == pytest.approx(1.0 if k == n else stats.beta.ppf(1 - a / 2, k + 1, n - k), rel=1e-12, abs=1e-15)


def test_clopper_pearson_lower_is_the_exact_binomial_test_boundary():
    # P(Binomial(n, p_low) >= k) = 1 - confidence: the defining property of the exact bound.
    k, n, c = 30, 100, 0.95
    p_low = S.clopper_pearson_lower(k, n, c)
    assert stats.binom.sf(k - 1, n, p_low) == pytest.approx(1 - c, rel=1e-9)


@pytest.mark.parametrize(
    "bad,err",
    [
        (dict(successes=11, trials=10), ValueError),
        (dict(successes=1, trials=0), ValueError),
        (dict(successes=1.5, trials=10), TypeError),
        (dict(successes=1, trials=10, confidence=1.0), ValueError),
    ],
)
def test_clopper_pearson_refuses_bad_input(bad, err):
    with pytest.raises(err, match="successes|trials|confidence"):
        S.clopper_pearson_lower(**bad)


# ------------------------------------------------------------ ε from rates
def test_epsilon_from_rates_closed_form():
    assert S.epsilon_from_rates(0.5, 0.05, 0.0) == pytest.approx(math.log(10))
    assert S.epsilon_from_rates(0.5, 0.05, 0.1) == pytest.approx(math.log(8))
    # The symmetric inequality: TNR = 0.9, FNR = 0.01 -> log(90) beats log(0.99/0.1).
    assert S.epsilon_from_rates(0.99, 0.1, 0.0) == pytest.approx(math.log(0.9 / 0.01))
    assert S.epsilon_from_rates(0.3, 0.4, 0.0) == 0.0  # worse than chance proves nothing
    assert S.epsilon_from_rates(0.5, 0.0, 0.0) == math.inf


def test_epsilon_from_counts_uses_one_sided_bounds_at_half_the_miss_probability():
    tp, pos, fp, neg, c, d = 60, 100, 5, 100, 0.95, 1e-5
    tpr = stats.beta.ppf(0.025, tp, pos - tp + 1)
    fpr = stats.beta.ppf(0.975, fp + 1, neg - fp)
    expected = max(math.log((tpr - d) / fpr), math.log((1 - fpr - d) / (1 - tpr)))
    got = S.epsilon_lower_bound_from_counts(tp, pos, fp, neg, delta=d, confidence=c)
    assert got == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------ one run
def _theorem_p_value(m, r, v, eps, delta):
    """Steinke et al. 2023, Theorem 5.2 as stated, with the max over every i in 1..m (no shortcut)."""
    p = math.exp(eps) / (math.exp(eps) + 1)
    f = lambda w: stats.binom.sf(w - 1, r, p) if w > 0 else 1.0  # noqa: E731  P[B >= w]
    return min(1.0, f(v) + 2 * m * delta * max((f(v - i) - f(v)) / i for i in range(1, m + 1)))


@pytest.mark.parametrize("m,r,v", [(20, 20, 15), (100, 40, 33), (200, 200, 120), (50, 10, 10)])
@pytest.mark.parametrize("eps", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-3])
def test_one_run_p_value_is_the_theorem(m, r, v, eps, delta):
    assert S.one_run_p_value(m, r, v, eps, delta) == pytest.approx(_theorem_p_value(m, r, v, eps, delta), rel=1e-9)


def test_one_run_pure_dp_is_the_binomial_tail():
    # Theorem 3.1 (δ = 0): W is dominated by Binomial(r, e^ε / (1 + e^ε)).
    assert S.one_run_p_value(1000, 100, 70, 0.3, 0.0) == pytest.approx(
        stats.binom.sf(69, 100, special.expit(0.3)), rel=1e-12
    )


@pytest.mark.parametrize("r", [10, 100, 1000])
@pytest.mark.parametrize("confidence", [0.95, 0.99])
def test_one_run_epsilon_all_guesses_correct_closed_form(r, confidence):
    # δ = 0 and v = r: Theorem 3.1 gives P = (e^ε/(1+e^ε))^r, so ε_emp = logit(β^(1/r)): the most
    # that r guesses can ever prove.
    beta = 1 - confidence
    expected = special.logit(beta ** (1 / r))
    assert S.one_run_epsilon(r, r, r, delta=0.0, confidence=confidence) == pytest.approx(expected, abs=1e-6)


def _theorem_p_value_vectorized(m, r, v, eps, delta):
    """Theorem 5.2 over every i in 1..m at once (an implementation independent of the library's)."""
    p = special.expit(eps)
    w = v - np.arange(1, m + 1)
    f_shifted = np.where(w > 0, stats.binom.sf(np.maximum(w, 1) - 1, r, p), 1.0)
    f_v = stats.binom.sf(v - 1, r, p)
    return min(1.0, f_v + 2 * m * delta * np.max((f_shifted - f_v) / np.arange(1, m + 1)))


@pytest.mark.parametrize("r", [10, 50, 100, 500, 1000])
@pytest.mark.parametrize("accuracy", [1.0, 0.9, 0.75])
def test_one_run_epsilon_is_the_root_of_the_theorem_in_the_papers_setting(r, accuracy):
    """The paper's setting (Steinke et al. 2023, Sec. 7: m = 1000 canaries, δ = 1e-5, 95% confidence;
    ε_emp as a function of the number of guesses r and their accuracy v/r): ε_emp is the root in ε of
    Theorem 5.2's p-value = β, found here with scipy's brentq on an independent implementation.
    The paper's printed values are checked in test_one_run_epsilon_matches_the_papers_printed_values."""
    from scipy import optimize

    m, delta, beta = 1000, 1e-5, 0.05
    v = int(round(accuracy * r))
    if _theorem_p_value_vectorized(m, r, v, 0.0, delta) >= beta:
        assert S.one_run_epsilon(m, r, v, delta=delta, confidence=1 - beta) == 0.0
        return
    root = optimize.brentq(lambda e: _theorem_p_value_vectorized(m, r, v, e, delta) - beta, 0.0, 60.0, xtol=1e-10)
    assert S.one_run_epsilon(m, r, v, delta=delta, confidence=1 - beta) == pytest.approx(root, abs=1e-3)


# The paper's own worked values (Steinke, Nasr, Jagielski, arXiv 2305.08846v1): Appendix D (p. 46) runs its
# reference code at m = 1000 canaries, r = 100 guesses, v = 75 right, δ = 1e-4, 95% and prints 0.673 (0.699 with
# no abstentions, m = r = 100); Section 7 (p. 28) reports m = 100,000, r = 1510, v = 1439, δ = 1e-5 at 95%
# as ε ≥ 2.675. (Read here through a public repository's notes quoting those pages: the PDF is not offline.)
@pytest.mark.parametrize(
    "m,r,v,delta,printed",
    [
        (1000, 100, 75, 1e-4, 0.673),
        (100, 100, 75, 1e-4, 0.699),
        (100_000, 1510, 1439, 1e-5, 2.675),
    ],
)
def test_one_run_epsilon_matches_the_papers_printed_values(m, r, v, delta, printed):
    got = S.one_run_epsilon(m, r, v, delta=delta, confidence=0.95)
    assert got == pytest.approx(printed, abs=1e-3)  # the paper prints three digits


def test_one_run_epsilon_closed_form_values():
    # Values of the closed form above (δ = 0, all r guesses right, 95%):
    # r = 100 -> log(0.05^0.01 / (1 - 0.05^0.01)) = 3.4930...; r = 1000 -> 5.8091...
    assert S.one_run_epsilon(100, 100, 100, confidence=0.95) == pytest.approx(3.4930, abs=1e-3)
    assert S.one_run_epsilon(1000, 1000, 1000, confidence=0.95) == pytest.approx(5.8091, abs=1e-3)
    # δ only enters through 2mδ: more canaries with the same guesses weaken the bound.
    assert S.one_run_epsilon(10**5, 100, 100, delta=1e-5) < S.one_run_epsilon(100, 100, 100, delta=1e-5)


def test_one_run_epsilon_rejects_exactly_below_it():
    m, r, v, d, c = 1000, 300, 230, 1e-5, 0.95
    eps = S.one_run_epsilon(m, r, v, delta=d, confidence=c)
    assert eps > 0
    assert S.one_run_p_value(m, r, v, eps, d) < 1 - c
    assert S.one_run_p_value(m, r, v, eps + 1e-6 + 1e-3 * eps, d) >= 1 - c


@pytest.mark.parametrize("eps", [0.5, 2.0])
def test_one_run_audit_is_sound_for_randomized_response(eps):
    # ε-DP randomized response is the worst case of Theorem 3.1: each guess is right with
    # probability e^ε/(1+e^ε). Over many simulated runs ε_emp > ε at most β of the time.
    rng = np.random.default_rng(0)
    m, runs, over = 100, 100, 0
    for _ in range(runs):
        included = rng.random(m) < 0.5
        right = rng.random(m) < special.expit(eps)
        truth = np.where(included, 1.0, -1.0)
        scores = np.where(right, truth, -truth) + 1e-3 * rng.standard_normal(m)
        over += S.one_run_audit(scores, included, confidence=0.95, guesses=[20, 100])["epsilon_lower_bound"] > eps
    assert over / runs <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / runs)


def test_one_run_audit_perfect_scores():
    included = np.arange(100) % 2 == 0
    out = S.one_run_audit(included.astype(float), included, confidence=0.95)
    # K = 8 candidates (4 sizes x 2 shapes); all 100 guesses right at β/8.
    assert out["candidates"] == 8 and out["correct"] == out["guesses"] == 100
    assert out["epsilon_lower_bound"] == pytest.approx(special.logit((0.05 / 8) ** (1 / 100)), abs=1e-6)


def test_one_run_guesses():
    g = S.one_run_guesses([5.0, 1.0, 3.0, 4.0, 2.0], 2, 1)
    assert g.tolist() == [1, -1, 0, 1, 0]


def test_roc_auc_matches_pairwise_definition():
    rng = np.random.default_rng(1)
    s, pos = rng.standard_normal(50).round(1), rng.random(50) < 0.4
    pairs = [(a > b) + 0.5 * (a == b) for a in s[pos] for b in s[~pos]]
    assert S.roc_auc(s, pos) == pytest.approx(np.mean(pairs))


# Imports without TensorFlow: tests/test_keras_switch.py::test_keras_neutral_modules_import_without_tensorflow.

"""Statistics of empirical privacy auditing (pure numpy/scipy, no TensorFlow).

Two ways from an attack's success to a lower bound ε_emp on the privacy loss:

* **From (TPR, FPR)** of a membership test (Kairouz et al. 2015; Jagielski
  et al. 2020): an (ε, δ)-DP algorithm admits no test with
  TPR > e^ε·FPR + δ, nor with TNR > e^ε·FNR + δ. With exact Clopper–Pearson
  bounds on the two rates, ε ≥ log((TPR_low − δ)/FPR_high) and
  ε ≥ log((1 − FPR_high − δ)/(1 − TPR_low)) hold at the stated confidence.
  The rates must come from independent trials (one example in or out of one
  training run each), which membership inference on one model does not give:
  see :mod:`keras_dpsgd.audit.membership`.
* **One run** (Steinke, Nasr, Jagielski 2023, "Privacy auditing with one (1)
  training run", NeurIPS 2023): m canaries, each included in the training
  data independently with probability 1/2 (S_i uniform in {−1, +1}); after
  training the auditor guesses T_i in {−1, 0, +1} (0: abstain) from the
  output alone; r = ||T||_1 guesses, v of them correct. If the algorithm is
  (ε, δ)-DP in each canary, their Theorem 5.2 (Theorem 3.1 for δ = 0) bounds
  P[v correct] by the tail of Binomial(r, e^ε/(1 + e^ε)) plus a δ term:

      P[W ≥ v] ≤ f(v) + 2mδ · max_{i ∈ {1..m}} (f(v − i) − f(v)) / i,
      f(w) = P[Binomial(r, e^ε/(e^ε + 1)) ≥ w].

  ε_emp at confidence 1 − β is the largest ε that this p-value rejects at
  level β. Note that r (the guesses), not m, is the binomial's size, and that
  m enters only through δ: abstaining on unsure canaries is free.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy import special, stats

from keras_dpsgd import _validate as V

__all__ = [
    "check_confidence",
    "clopper_pearson_interval",
    "clopper_pearson_lower",
    "clopper_pearson_upper",
    "epsilon_from_rates",
    "epsilon_lower_bound_from_counts",
    "gdp_delta",
    "gdp_epsilon",
    "noise_multiplier_upper_bound",
    "one_run_audit",
    "one_run_epsilon",
    "one_run_guesses",
    "one_run_p_value",
    "require_pld",
    "roc_auc",
    "subsampled_gaussian_epsilon_lower",
]


# ------------------------------------------------------------- validation
def _check_count(name: str, value, low: int, high: int | None = None) -> int:
    if high is None:
        return V.integer_at_least(low, **{name: value})
    return V.integer_in_range(low, high, **{name: value})


def check_confidence(confidence) -> float:
    """Validates a confidence level in (0, 1)."""
    return V.in_range(0, 1, "()", confidence=confidence)


# ---------------------------------------------------------- Clopper-Pearson
def clopper_pearson_lower(successes: int, trials: int, confidence: float = 0.95) -> float:
    """One-sided exact lower bound p_low: P(p >= p_low) >= confidence.

    The 1 − confidence quantile of Beta(k, n − k + 1); 0 when k = 0
    (Clopper and Pearson 1934).
    """
    n = _check_count("trials", trials, 1)
    k = _check_count("successes", successes, 0, n)
    c = check_confidence(confidence)
    return 0.0 if k == 0 else float(stats.beta.ppf(1.0 - c, k, n - k + 1))


def clopper_pearson_upper(successes: int, trials: int, confidence: float = 0.95) -> float:
    """One-sided exact upper bound p_high: P(p <= p_high) >= confidence.

    The `confidence` quantile of Beta(k + 1, n − k); 1 when k = n.
    """
    n = _check_count("trials", trials, 1)
    k = _check_count("successes", successes, 0, n)
    c = check_confidence(confidence)
    return 1.0 if k == n else float(stats.beta.ppf(c, k + 1, n - k))


def clopper_pearson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided exact interval: each side at (1 + confidence)/2."""
    c = check_confidence(confidence)
    side = 0.5 * (1.0 + c)
    return clopper_pearson_lower(successes, trials, side), clopper_pearson_upper(successes, trials, side)


# ------------------------------------------------------ ε from (TPR, FPR)
def epsilon_from_rates(tpr: float, fpr: float, delta: float = 0.0) -> float:
    """ε implied by a test with these rates against (ε, δ)-DP, >= 0.

    max(log((TPR − δ)/FPR), log((1 − FPR − δ)/(1 − TPR)), 0): DP forces
    TPR <= e^ε FPR + δ and TNR <= e^ε FNR + δ. Pass a lower bound on TPR and
    an upper bound on FPR to get a lower bound on ε.
    """
    tpr = V.in_range(0, 1, "[]", tpr=tpr)
    fpr = V.in_range(0, 1, "[]", fpr=fpr)
    d = V.in_range(0, 1, "[)", delta=delta)
    best = 0.0
    for hit, miss in ((tpr - d, fpr), (1.0 - fpr - d, 1.0 - tpr)):
        if hit > 0.0:
            best = max(best, math.inf if miss <= 0.0 else math.log(hit / miss))
    return best


def epsilon_lower_bound_from_counts(
    true_positives: int,
    positives: int,
    false_positives: int,
    negatives: int,
    *,
    delta: float = 0.0,
    confidence: float = 0.95,
) -> float:
    """ε lower bound from a test's counts, valid at `confidence` for independent trials.

    TPR_low and FPR_high are one-sided Clopper–Pearson bounds, each at
    1 − (1 − confidence)/2, so that both hold together at `confidence`
    (union bound); both inequalities of :func:`epsilon_from_rates` use them.
    """
    c = check_confidence(confidence)
    each = 1.0 - 0.5 * (1.0 - c)
    tpr_low = clopper_pearson_lower(true_positives, positives, each)
    fpr_high = clopper_pearson_upper(false_positives, negatives, each)
    return epsilon_from_rates(tpr_low, fpr_high, delta)


# ------------------------------------------------------------ one run
def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float = 0.0) -> float:
    """Steinke et al. (2023) Theorem 5.2: P[>= `correct` of `guesses` right] under (ε, δ)-DP.

    f(v) + 2mδ · max_{1 <= i <= m} (f(v − i) − f(v))/i with f the upper tail
    of Binomial(r, e^ε/(1 + e^ε)). For i >= v, f(v − i) = 1, so the maximum
    over i > v is at i = v and the search stops there.

    Args:
      canaries: m, the number of canaries (each included with probability 1/2).
      guesses: r <= m, the number of non-abstaining guesses.
      correct: v <= r, how many guesses were right.
      epsilon: ε >= 0 of the null hypothesis.
      delta: δ of the null hypothesis.

    Returns:
      The p-value, in [0, 1].
    """
    m = _check_count("canaries", canaries, 1)
    r = _check_count("guesses", guesses, 0, m)
    v = _check_count("correct", correct, 0, r)
    epsilon = V.in_range(0, math.inf, "[]", epsilon=epsilon)
    d = V.in_range(0, 1, "[)", delta=delta)
    if v == 0:
        return 1.0
    p = float(special.expit(epsilon))
    tail = float(stats.binom.sf(v - 1, r, p))  # f(v)
    if d == 0.0:
        return tail
    # f(v - i) - f(v) = P[v - i <= B < v] = sum_{j=1..i} pmf(v - j), i = 1..v.
    between = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, p))
    slope = float(np.max(between / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * d * slope)


def one_run_epsilon(
    canaries: int, guesses: int, correct: int, *, delta: float = 0.0, confidence: float = 0.95
) -> float:
    """ε_emp: the largest ε whose (ε, δ)-DP hypothesis the one-run p-value rejects.

    At confidence 1 − β the algorithm is not (ε_emp, δ)-DP: every ε' <= ε_emp
    has p-value < β (checked on a grid below the bisection's answer, so a
    non-monotone p-value can only lower the result). 0 when nothing is
    rejected.
    """
    beta = 1.0 - check_confidence(confidence)

    def rejected(eps: float) -> bool:
        return one_run_p_value(canaries, guesses, correct, eps, delta) < beta

    if not rejected(0.0):
        return 0.0
    high = 1.0
    while rejected(high):
        high *= 2.0
        if high > 1e3:
            return math.inf
    low = 0.0
    for _ in range(40):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if rejected(mid) else (low, mid)
    last = 0.0
    for eps in np.linspace(0.0, low, 17)[1:]:
        if not rejected(float(eps)):
            return last  # the last grid point below the first ε not rejected
        last = float(eps)
    return low


def one_run_guesses(scores: Sequence[float], k_plus: int, k_minus: int) -> np.ndarray:
    """Guesses T: +1 for the `k_plus` highest scores, −1 for the `k_minus` lowest, else 0."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or not np.all(np.isfinite(s)):
        raise ValueError(f"scores must be a finite 1-D array, got shape {s.shape}")
    m = len(s)
    kp = _check_count("k_plus", k_plus, 0, m)
    km = _check_count("k_minus", k_minus, 0, m - kp)
    order = np.argsort(s, kind="stable")
    guesses = np.zeros(m, dtype=np.int64)
    if km:
        guesses[order[:km]] = -1
    if kp:
        guesses[order[m - kp :]] = 1
    return guesses


# Fractions of m guessed among which the audit picks the best (Bonferroni).
DEFAULT_GUESS_FRACTIONS = (0.1, 0.25, 0.5, 1.0)


def one_run_audit(
    scores: Sequence[float],
    included: Sequence[bool],
    *,
    delta: float = 0.0,
    confidence: float = 0.95,
    guesses: int | Sequence[int] | None = None,
) -> dict:
    """ε_emp of one run from canary scores (higher: more likely included).

    Each candidate guesses on the k most confident canaries, in two shapes:
    "both" (the k/2 highest scores guessed in, the k/2 lowest out) and "in"
    (the k highest guessed in, abstaining on the rest: the better shape when
    an included canary may not show, e.g. one that joined no lot). The bound
    is computed for every candidate at level β/K over the K candidates
    (Bonferroni) and the largest is reported: choosing the candidate after
    seeing the scores costs a factor K in β, not validity.

    Args:
      scores: one score per canary, computed from the training output only.
      included: whether each canary was in the training data (fair coins
        drawn before training).
      delta: δ of the hypothesis (the run's δ).
      confidence: 1 − β.
      guesses: a number of guesses k, or several; default
        `DEFAULT_GUESS_FRACTIONS` of m (at least 2).

    Returns:
      dict with epsilon_lower_bound, confidence, canaries, guesses (k of the
      best candidate), shape ("both" or "in"), correct, candidates (K).
    """
    s = np.asarray(scores, dtype=np.float64)
    inc = np.asarray(included)
    if inc.shape != s.shape or s.ndim != 1:
        raise ValueError(f"scores and included must be 1-D of one length, got {s.shape} and {inc.shape}")
    if inc.dtype != np.bool_:
        raise TypeError(f"included must be booleans, got dtype {inc.dtype}")
    m = len(s)
    if m < 2:
        raise ValueError(f"canaries must be >= 2, got {m}")
    c = check_confidence(confidence)
    if guesses is None:
        ks = sorted({max(2, int(round(f * m))) for f in DEFAULT_GUESS_FRACTIONS})
    else:
        ks = sorted({_check_count("guesses", int(k), 1, m) for k in np.atleast_1d(guesses)})
    candidates = [(k, shape) for k in ks for shape in ("both", "in")]
    each = 1.0 - (1.0 - c) / len(candidates)
    truth = np.where(inc, 1, -1)
    best = None
    for k, shape in candidates:
        t = one_run_guesses(s, k - k // 2, k // 2) if shape == "both" else one_run_guesses(s, k, 0)
        correct = int(np.sum(t == truth))
        eps = one_run_epsilon(m, int(np.sum(t != 0)), correct, delta=delta, confidence=each)
        if best is None or eps > best["epsilon_lower_bound"]:
            best = {"epsilon_lower_bound": eps, "guesses": k, "shape": shape, "correct": correct}
    best.update(confidence=c, canaries=m, candidates=len(candidates))
    return best


def roc_auc(scores: Sequence[float], positive: Sequence[bool]) -> float:
    """Area under the ROC curve (ties count 1/2): P(score of a positive > a negative's)."""
    s = np.asarray(scores, dtype=np.float64)
    pos = np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    ranks = stats.rankdata(s)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


# ---------------------------------------------------- white-box step audit
def noise_multiplier_upper_bound(
    noise_count: int,
    noise_sum_squares: float,
    shift_count: int,
    shift_sum: float,
    shift_sum_squares: float,
    *,
    confidence: float = 0.95,
) -> dict:
    """An upper confidence bound on the effective noise multiplier of observed Gaussian releases.

    The step audit (:mod:`keras_dpsgd.audit.step`) observes, in units of the clip bound C,
    u = (noised sum − clipped sum) / C at every coordinate of every step. Under the claimed
    mechanism u = b + z with z ~ N(0, σ²) i.i.d. and b the canary (±1 where a canary joined,
    0 elsewhere). Two exact Gaussian intervals, each at 1 − β/2 (union bound):

    * noise: the `noise_count` observations with b = 0 give σ_high² = Σu² / χ²_{β/2}(n₀);
    * shift: the `shift_count` observations with b = ±1 give b·u ~ N(a, σ²) with a = 1 for a
      correct step; a_low = mean − t_{1−β/2}(n₁ − 1)·sd/√n₁ (Student).

    The effective noise multiplier (noise over the sensitivity the canaries show) is then at
    most σ_high / a_low with probability >= `confidence`; ∞ when a_low <= 0 or n₁ < 2.

    Returns:
      dict with noise_multiplier_upper_bound, noise_multiplier_estimate (√(Σu²/n₀)),
      noise_multiplier_high (σ_high), shift_estimate, shift_lower_bound, confidence.
    """
    n0 = _check_count("noise_count", noise_count, 1)
    n1 = _check_count("shift_count", shift_count, 0)
    c = check_confidence(confidence)
    beta = 1.0 - c
    s0 = float(noise_sum_squares)
    if not (math.isfinite(s0) and s0 >= 0.0):
        raise ValueError(f"noise_sum_squares must be finite and >= 0, got {noise_sum_squares}")
    sigma_hat = math.sqrt(s0 / n0)
    sigma_high = math.sqrt(s0 / float(stats.chi2.ppf(beta / 2.0, n0)))
    if n1 >= 2:
        mean = float(shift_sum) / n1
        var = max(0.0, (float(shift_sum_squares) - n1 * mean * mean) / (n1 - 1))
        shift_low = mean - float(stats.t.ppf(1.0 - beta / 2.0, n1 - 1)) * math.sqrt(var / n1)
    else:
        mean, shift_low = math.nan, -math.inf
    upper = sigma_high / shift_low if shift_low > 0.0 else math.inf
    return {
        "noise_multiplier_upper_bound": upper,
        "noise_multiplier_estimate": sigma_hat,
        "noise_multiplier_high": sigma_high,
        "shift_estimate": mean,
        "shift_lower_bound": shift_low,
        "confidence": c,
    }


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of μ-Gaussian DP (Dong, Roth, Su 2019, Corollary 2.13): Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)."""
    mu = V.positive(mu=mu)
    eps = V.nonnegative(epsilon=epsilon)
    return float(stats.norm.cdf(-eps / mu + mu / 2.0) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2.0))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The ε at which μ-GDP holds with `delta` (the root of :func:`gdp_delta`; 0 if δ(0) <= δ)."""
    from scipy import optimize

    mu = V.positive(mu=mu)
    d = V.in_range(0, 1, "()", delta=delta)
    if gdp_delta(mu, 0.0) <= d:
        return 0.0
    high = 1.0
    while gdp_delta(mu, high) > d:
        high *= 2.0
    return float(optimize.brentq(lambda e: gdp_delta(mu, e) - d, 0.0, high, xtol=1e-12, rtol=1e-12))


def require_pld():
    """dp_accounting's ``privacy_loss_distribution`` module, which the step audit's ε needs.

    Raises:
      ImportError: dp_accounting is not installed; the message names the extra and the way out.
    """
    try:
        from dp_accounting.pld import privacy_loss_distribution
    except ImportError as err:
        raise ImportError(
            "the step audit needs dp_accounting for its ε: pip install keras-dpsgd[pld] "
            "(or audit with --mode one-run / canary_audit, which does not)"
        ) from err
    return privacy_loss_distribution


def subsampled_gaussian_epsilon_lower(
    noise_multiplier: float, sampling_rate: float, steps: int, delta: float, *, discretization: float = 1e-3
) -> float:
    """A LOWER bound on the exact ε(δ) of `steps` Poisson-subsampled Gaussian releases.

    q = 1: the exact μ-GDP value with μ = √T/σ (:func:`gdp_epsilon`). q < 1: dp_accounting's
    privacy loss distribution with the optimistic discretization (``pessimistic_estimate=False``),
    whose ε never exceeds the true one (the accountants report the pessimistic, upper one).
    σ = 0: ∞ when the chance that the example joins a lot, 1 − (1 − q)^T, exceeds δ (a noiseless
    release shows it). σ below 0.2 is raised to 0.2 (ε only grows as σ falls: still a lower bound).
    """
    sigma = V.in_range(0, math.inf, "[]", noise_multiplier=noise_multiplier)
    q = V.in_range(0, 1, "(]", sampling_rate=sampling_rate)
    t = V.integer_at_least(1, steps=steps)
    d = V.in_range(0, 1, "()", delta=delta)
    if sigma == 0.0:
        return math.inf if 1.0 - (1.0 - q) ** t > d else 0.0
    if not math.isfinite(sigma):
        return 0.0
    sigma = max(sigma, 0.2)
    if q == 1.0:
        return gdp_epsilon(math.sqrt(t) / sigma, d)
    dist = require_pld().from_gaussian_mechanism(
        sigma,
        sampling_prob=q,
        pessimistic_estimate=False,
        use_connect_dots=False,
        value_discretization_interval=discretization,
    )
    return max(0.0, float(dist.self_compose(t).get_epsilon_for_delta(d)))

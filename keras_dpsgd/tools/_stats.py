"""Binomial statistics for the memorization test (pure numpy/scipy).

Under the null hypothesis "the model did not memorize", its predictions on
random-label training data are independent of the labels, which are uniform
over K classes; each prediction is then correct with probability exactly 1/K
whatever the model predicts, and the number of correct predictions on n
examples is Binomial(n, 1/K). We test it one-sided (memorization can only raise
the accuracy) with the exact binomial test, and report the matching exact
Clopper–Pearson lower confidence bound (Clopper and Pearson 1934): the lower
bound exceeds 1/K iff the binomial test rejects at level 1 − confidence.
"""

from __future__ import annotations

from scipy import stats

from keras_dpsgd import _validate


def _check(correct: int, n: int, confidence: float) -> None:
    n = _validate.integer_at_least(1, n=n)
    _validate.integer_in_range(0, n, correct=correct)
    _validate.in_range(0, 1, "()", confidence=confidence)


def clopper_pearson_lower(correct: int, n: int, confidence: float = 0.95) -> float:
    """One-sided exact lower confidence bound on a binomial proportion.

    P(p >= bound) >= confidence for the true success probability p: the bound
    is the `1 - confidence` quantile of Beta(correct, n - correct + 1)
    (0 when correct = 0).

    Args:
      correct: number of successes, an integer in [0, n].
      n: number of trials, an integer >= 1.
      confidence: one-sided confidence level in (0, 1).

    Returns:
      The lower bound in [0, 1].
    """
    _check(correct, n, confidence)
    if correct == 0:
        return 0.0
    return float(stats.beta.ppf(1.0 - confidence, correct, n - correct + 1))


def binomial_p_value(correct: int, n: int, chance: float) -> float:
    """One-sided exact p-value P(Binomial(n, chance) >= correct)."""
    _check(correct, n, 0.5)
    if not 0.0 < chance < 1.0:
        raise ValueError(f"chance must be in (0, 1), got {chance!r}")
    return float(stats.binom.sf(correct - 1, n, chance))


def significantly_above_chance(correct: int, n: int, chance: float, confidence: float = 0.95) -> bool:
    """True when the Clopper–Pearson lower bound at `confidence` exceeds `chance`."""
    return clopper_pearson_lower(correct, n, confidence) > chance

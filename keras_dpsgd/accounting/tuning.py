"""The privacy cost of hyperparameter tuning with a random number of trials (pure numpy/scipy).

Papernot & Steinke 2022 ("Hyperparameter tuning with Rényi differential privacy", ICLR 2022,
arXiv:2110.03620): run a DP training Q a random number K of times, each time with settings drawn
at random from a search space, and release only the best run (by a score that is part of Q's
output, e.g. the accuracy of Q's model on held-out data). Their bounds, for Q (λ, ε(λ))-RDP at
every order of a grid (numbering of arXiv:2110.03620v2, as dp_accounting cites it in
``rdp_privacy_accountant._compute_rdp_repeat_and_select``, the reference implementation of
``RepeatAndSelectDpEvent``, which computes the same two formulas: ``tests/accounting/test_tuning.py`` checks ours
against it, and against a third implementation in mpmath):

* **Truncated negative binomial** K ~ D_{η,γ} (their **Definition 1**: P[K = k] ∝ C(k + η − 1, k)(1 − γ)^k
  for k >= 1; η = 0 is the logarithmic distribution P[K = k] = (1 − γ)^k / (k log(1/γ)), η = 1 the
  geometric), their **Theorem 2**: for every λ > 1 and λ̂ >= 1 the search is (λ, ε')-RDP with ::

      ε'(λ) = ε(λ) + (1 + η)(1 − 1/λ̂) ε(λ̂) + (1 + η) log(1/γ) / λ̂ + log E[K] / (λ − 1),
      E[K] = η(1 − γ) / (γ(1 − γ^η))  (η ≠ 0),     E[K] = (1/γ − 1) / log(1/γ)  (η = 0).

  λ̂ is free: we take, per λ, the smallest value over the orders of the grid (all > 1). η ranges over
  (−1, ∞) (the paper's range as we read it); dp_accounting takes η >= 0 only, so η < 0 is checked against the
  exact divergence of a Gaussian search instead.
* **Poisson** K ~ Poisson(μ) (K = 0 releases nothing), their **Theorem 6**: if Q is also
  (ε̂, δ̂)-DP with e^ε̂ <= 1 + 1/(λ − 1), the search is (λ, ε')-RDP with ::

      ε'(λ) = ε(λ) + μ δ̂ + log(μ) / (λ − 1).

  We take the largest ε̂ allowed, ε̂ = log(1 + 1/(λ − 1)), and δ̂ the smallest δ at ε̂ that Q's RDP
  curve proves over the grid (:func:`~keras_dpsgd.accounting.delta_from_rdp`, the conversion of
  Canonne, Kamath and Steinke 2020; a smaller ε̂ only raises δ̂). We require μ >= 1: for μ < 1 the
  log μ term is negative and the bound fails (for a trial that ignores its data the bound is
  log(μ)/(λ − 1) < 0 while the divergence is 0; on randomized response the exact divergence of the
  search exceeds it, ``tests/accounting/test_tuning.py``), so such a search is refused.

A fixed number of trials k released together (or the best of k, without the randomness of K) is
the k-fold composition of Q ("the naive way"): k·ε(λ). The random K costs a constant factor on ε
plus a log E[K] term instead, far less for many trials (see :doc:`/tuning`).

Both theorems need (their Sec. 3.3) K drawn from the stated distribution independently of the data,
each trial's settings drawn independently from one public distribution (random search), one RDP
bound for every setting a trial may draw (the largest candidate's, :class:`TuningEvent`), and only
the best trial released (scores compared on a total order, ties broken by the trial's position).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from keras_dpsgd import _validate as V
from keras_dpsgd.accounting import conversions, rdp
from keras_dpsgd.accounting.events import (
    GaussianEvent,
    PoissonSampledComposedGaussianEvent,
    PoissonSampledGaussianEvent,
    TuningEvent,
    flatten_events,
)

__all__ = ["expected_trials", "rdp_trial", "rdp_tuning", "sample_trials", "trial_probabilities"]


def expected_trials(event: TuningEvent) -> float:
    """E[K] of the event's distribution (Papernot & Steinke 2022, Theorem 2 and Sec. 3.2)."""
    if event.distribution == "poisson":
        return float(event.mu)
    eta, gamma = event.eta, event.gamma
    if eta == 0.0:
        return (1.0 / gamma - 1.0) / math.log(1.0 / gamma)
    return eta * (1.0 - gamma) / (gamma * (1.0 - gamma**eta))


def _rdp_leaf(event, orders: tuple[float, ...]) -> np.ndarray:
    if isinstance(event, GaussianEvent):
        return event.count * rdp.rdp_gaussian(event.noise_multiplier, orders)
    if isinstance(event, (PoissonSampledGaussianEvent, PoissonSampledComposedGaussianEvent)):
        step = rdp.rdp_poisson_subsampled_gaussian(event.sampling_rate, event.noise_multiplier, orders)
        with np.errstate(invalid="ignore"):
            return event.count * step
    raise TypeError(f"a tuning trial holds Gaussian events only, got {type(event).__name__}")


def rdp_trial(event: TuningEvent, orders: Sequence[float] = rdp.DEFAULT_ORDERS) -> np.ndarray:
    """RDP of one trial: at every order, the largest over the candidates (each composed over its events).

    A trial draws its candidate from a public distribution; the Rényi divergence of two mixtures with
    the same weights is at most the largest of the components' (exp((λ − 1)D_λ) is jointly convex),
    so the largest candidate's RDP bounds the trial's at each order.
    """
    orders = rdp.check_orders(orders)
    curves = []
    for candidate in event.candidates:
        total = np.zeros(len(orders))
        for leaf in flatten_events((candidate,)):
            if leaf.count:
                with np.errstate(invalid="ignore"):
                    total = total + _rdp_leaf(leaf, orders)
        curves.append(total)
    return np.max(np.stack(curves), axis=0)


def rdp_tuning(event: TuningEvent, orders: Sequence[float] = rdp.DEFAULT_ORDERS) -> np.ndarray:
    """RDP of one search that releases its best trial (Papernot & Steinke 2022, Theorems 2 and 6).

    Args:
      event: the search.
      orders: RDP orders λ > 1; for the truncated negative binomial, λ̂ ranges over the same orders.

    Returns:
      ε'(λ) per order (∞ where the trial's RDP is ∞); `event.count` is not applied.
    """
    orders = rdp.check_orders(orders)
    lam = np.asarray(orders, dtype=np.float64)
    trial = rdp_trial(event, orders)
    log_mean = math.log(expected_trials(event))
    with np.errstate(invalid="ignore", over="ignore"):
        if event.distribution == "poisson":
            surcharge = event.mu * _poisson_delta_hat(trial, orders)
        else:
            one_eta = 1.0 + event.eta
            per_hat = one_eta * (1.0 - 1.0 / lam) * trial + one_eta * math.log(1.0 / event.gamma) / lam
            surcharge = np.min(np.where(np.isnan(per_hat), np.inf, per_hat))
        out = trial + surcharge + log_mean / (lam - 1.0)
    return np.where(np.isnan(out), np.inf, out)


def _poisson_delta_hat(trial: np.ndarray, orders: tuple[float, ...]) -> np.ndarray:
    """δ̂(λ): the trial's smallest δ at ε̂ = log(1 + 1/(λ − 1)) over the grid (Theorem 6's condition)."""
    out = np.empty(len(orders))
    for i, lam in enumerate(orders):
        if not np.isfinite(trial).any():
            out[i] = 1.0
            continue
        out[i] = conversions.delta_from_rdp(orders, trial, math.log1p(1.0 / (lam - 1.0)), "tight")[0]
    return out


def trial_probabilities(event: TuningEvent, k_max: int) -> np.ndarray:
    """P[K = k] for k = 0..k_max (the truncated negative binomial of Papernot & Steinke 2022; Poisson: e^-μ μ^k / k!)."""
    k_max = V.integer_at_least(1, k_max=k_max)
    k = np.arange(k_max + 1, dtype=np.float64)
    if event.distribution == "poisson":
        from scipy import stats

        return stats.poisson.pmf(k, event.mu)
    eta, gamma = event.eta, event.gamma
    out = np.zeros(k_max + 1)
    # P[K = 1], then P[K = k + 1] / P[K = k] = (1 − γ)(k + η)/(k + 1).
    out[1] = (1.0 - gamma) / math.log(1.0 / gamma) if eta == 0.0 else eta * (1.0 - gamma) / (gamma**-eta - 1.0)
    for i in range(1, k_max):
        out[i + 1] = out[i] * (1.0 - gamma) * (i + eta) / (i + 1.0)
    return out


def sample_trials(event: TuningEvent, generator: Optional[np.random.Generator] = None) -> int:
    """Draws K from the event's distribution.

    Poisson: ``generator.poisson(μ)``. Truncated negative binomial: the inverse of its distribution
    function at one uniform draw, over the probabilities of :func:`trial_probabilities` (float64:
    the drawn law differs from D_{η,γ} by the rounding of the sum, below 1e-12).

    Args:
      event: the search.
      generator: a numpy Generator; default one seeded from the operating system's entropy
        (``secrets``), as every draw that the privacy proof needs secret must be.
    """
    if generator is None:
        import secrets

        generator = np.random.default_rng(secrets.randbits(128))
    if event.distribution == "poisson":
        return int(generator.poisson(event.mu))
    u = generator.random()
    total, k, p = 0.0, 1, trial_probabilities(event, 1)[1]
    while True:
        total += p
        if u < total or p < 1e-300:
            return k
        p *= (1.0 - event.gamma) * (k + event.eta) / (k + 1.0)
        k += 1

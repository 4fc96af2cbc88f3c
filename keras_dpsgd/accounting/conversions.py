"""Conversions from an RDP curve to (ε, δ)-DP (pure numpy).

Each conversion gives, per order α, an ε valid at δ; the reported ε is the
minimum over the grid, with the order attaining it.

* ``"tight"`` (default): Canonne, Kamath and Steinke 2020 (Prop 12 of
  arXiv:2004.00010 v4; also Balle et al. 2020, Thm 21, and Asoodeh et al.
  2020, Eq. 20)::

      ε(α) = r(α) + log1p(-1/α) - (log δ + log α) / (α - 1),   α > 1.01,

  combined with the bound through the KL divergence (Bretagnolle-Huber:
  TV <= sqrt(1 - exp(-KL)) and KL <= r(α)): ε = 0 whenever
  δ >= sqrt(1 - exp(-r(α))). Orders α <= 1.01 are skipped (numerically
  unstable). This is exactly dp_accounting's ``rdp.compute_epsilon``.
* ``"classic"``: Mironov 2017, Prop 3, i.e. Abadi et al. 2016, Thm 2.2 written
  with the log moment α_M(λ) = λ·r(λ + 1)::

      ε = min_λ (α_M(λ) + log(1/δ)) / λ = min_α r(α) + log(1/δ) / (α - 1).

  This is what the moments accountant of Abadi et al. 2016 (orders 2..33) and
  TF Privacy before 2020 reported.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from keras_dpsgd import _validate as V

__all__ = ["check_conversion", "delta_from_rdp", "epsilon_from_rdp", "epsilon_per_order"]

CONVERSIONS = ("tight", "classic")


def check_conversion(conversion: str) -> str:
    return V.one_of(CONVERSIONS, conversion=conversion)


def epsilon_per_order(
    orders: Sequence[float], rdp: Sequence[float], delta: float, conversion: str = "tight"
) -> np.ndarray:
    """ε(α) at δ for every order α of the grid (∞ where no bound applies).

    Args:
      orders: RDP orders α > 1.
      rdp: RDP values r(α), same length as `orders` (may hold ∞).
      delta: δ in (0, 1).
      conversion: "tight" or "classic" (see the module docstring).

    Returns:
      Array of ε values, one per order, clipped below at 0.
    """
    delta = V.in_range(0, 1, "()", delta=delta)
    check_conversion(conversion)
    alphas = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    if alphas.shape != r.shape or alphas.ndim != 1:
        raise ValueError(f"orders and rdp must be 1-D of the same length, got shapes {alphas.shape} and {r.shape}")
    if np.isnan(r).any():
        raise ValueError("rdp must not contain NaN")
    # A_α >= 1 by Jensen, so r(α) >= 0; a tiny negative value is rounding.
    r = np.maximum(r, 0.0)
    log_delta = math.log(delta)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if conversion == "classic":
            eps = r - log_delta / (alphas - 1.0)
        else:
            eps = r + np.log1p(-1.0 / alphas) - (log_delta + np.log(alphas)) / (alphas - 1.0)
            eps = np.where(alphas > 1.01, eps, np.inf)
            kl_enough = delta * delta + np.expm1(-r) > 0.0
            eps = np.where(kl_enough, 0.0, eps)
    eps = np.where(np.isnan(eps), np.inf, eps)
    return np.maximum(eps, 0.0)


def epsilon_from_rdp(
    orders: Sequence[float], rdp: Sequence[float], delta: float, conversion: str = "tight"
) -> tuple[float, float | None]:
    """Smallest ε over the order grid, and the order attaining it.

    Returns:
      (ε, α). ε is ∞ (and α None) when every order gives ∞.
    """
    eps = epsilon_per_order(orders, rdp, delta, conversion)
    idx = int(np.argmin(eps))
    if not math.isfinite(eps[idx]):
        return math.inf, None
    return float(eps[idx]), float(np.asarray(orders, dtype=np.float64)[idx])


def delta_from_rdp(
    orders: Sequence[float], rdp: Sequence[float], epsilon: float, conversion: str = "tight"
) -> tuple[float, float | None]:
    """Smallest δ at a given ε over the order grid (inverse of the conversions).

    tight: log δ(α) = (α-1)(r - ε + log1p(-1/α)) - log α, min with the KL bound
    0.5·log1p(-exp(-r)); classic: log δ(α) = (α-1)(r - ε).

    Returns:
      (δ, α), δ capped at 1.
    """
    epsilon = V.in_range(0, math.inf, "[]", epsilon=epsilon)
    check_conversion(conversion)
    alphas = np.asarray(orders, dtype=np.float64)
    r = np.maximum(np.asarray(rdp, dtype=np.float64), 0.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if conversion == "classic":
            log_d = (alphas - 1.0) * (r - epsilon)
        else:
            rdp_bound = (alphas - 1.0) * (r - epsilon + np.log1p(-1.0 / alphas)) - np.log(alphas)
            rdp_bound = np.where(alphas > 1.01, rdp_bound, np.inf)
            kl_bound = 0.5 * np.log1p(-np.exp(-r))
            log_d = np.minimum(rdp_bound, kl_bound)
    log_d = np.where(np.isnan(log_d), np.inf, log_d)
    idx = int(np.argmin(log_d))
    return float(min(math.exp(min(log_d[idx], 0.0)), 1.0)), float(alphas[idx])

"""Rényi DP of the Poisson-subsampled Gaussian mechanism (pure numpy/scipy).

For sampling rate q, noise multiplier σ and order α > 1, the RDP of one step of
DP-SGD (Abadi et al. 2016, Algorithm 1) under add/remove-one adjacency is

    ε_RDP(α) = log(A_α) / (α - 1),
    A_α = E_{z ~ μ0}[(1 - q + q·μ1(z)/μ0(z))^α],   μ0 = N(0, σ²), μ1 = N(1, σ²),

which is the log moment of Abadi et al. 2016 Sec 3.2 (Eq. 3-4) with λ = α - 1,
as analysed by Mironov, Talwar and Zhang 2019 ("Rényi Differential Privacy of
the Sampled Gaussian Mechanism", Sec 3.2-3.3).

* Integer α: the binomial expansion is finite and exact (MTZ 2019 Sec 3.2),
  summed in log space::

      A_α = Σ_{i=0}^{α} C(α, i) (1-q)^{α-i} q^i exp((i² - i) / (2σ²)).

* Fractional α: A_α splits at z0 = σ² log(1/q - 1) + 1/2 into two integrals,
  each expanded with the generalized binomial series (MTZ 2019 Sec 3.3). We sum
  the *absolute values* of the series terms, which by the triangle inequality
  is an upper bound on A_α (conservative: it can only overstate ε), and stop
  with the same rule as dp_accounting / TF Privacy (both term sequences
  decreasing and below e^-30 of the running total). An order whose series does
  not stop within 1000 terms gets RDP = ∞ (excluded from the minimum over
  orders; conservative).
* q = 1: the Gaussian mechanism, ε_RDP(α) = α / (2σ²) exactly.
* σ = 0: ε_RDP = ∞.

All orders of a grid are computed at once (vectorized); results are cached per
(q, σ, orders), so repeated queries of the same event are free.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np
from scipy import special

from keras_dpsgd import _validate as V

__all__ = ["check_orders", "rdp_gaussian", "rdp_poisson_subsampled_gaussian"]

# dp_accounting's default grid (RdpAccountant.DEFAULT_RDP_ORDERS): 1.1..10.9 by
# 0.1, 11..63, 128, 256, 512, 1024. Built the same way so the floats coincide.
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(11, 64)] + [128.0, 256.0, 512.0, 1024.0]
)

# The orders of Abadi et al. 2016's moments accountant: log moments at integer
# λ = 1..32, i.e. RDP orders α = λ + 1 = 2..33.
MOMENTS_ORDERS: tuple[float, ...] = tuple(float(lam + 1) for lam in range(1, 33))

# TF Privacy's historical `compute_dp_sgd_privacy` grid (used by its 2019
# tutorial): 1.1..10.9 by 0.1 and 12..63 (11 was missing).
TF_PRIVACY_LEGACY_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)]
)

_FRAC_MAX_TERMS = 1000  # same cut-off as dp_accounting
_FRAC_CHUNK = 32
_STOP_GAP = 30.0  # stop once new terms are below e^-30 of the running total


def check_orders(orders: Sequence[float]) -> tuple[float, ...]:
    """Validates an order grid: a non-empty sequence of finite floats > 1."""
    if isinstance(orders, (str, bytes)):
        raise V.ArgumentTypeError(f"orders must be a sequence of finite numbers > 1, got {orders!r}")
    result = tuple(V.in_range(1, math.inf, "()", **{f"orders[{i}]": a}) for i, a in enumerate(orders))
    if not result:
        raise ValueError("orders must be a non-empty sequence of floats > 1, got an empty sequence")
    return result


def rdp_gaussian(noise_multiplier: float, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP of the Gaussian mechanism with sensitivity 1: α / (2σ²) (Mironov 2017, Prop 7).

    Args:
      noise_multiplier: σ >= 0 (0 gives ∞ at every order).
      orders: RDP orders α > 1.

    Returns:
      Array of RDP values, one per order.
    """
    sigma = V.nonnegative(noise_multiplier=noise_multiplier)
    alphas = np.asarray(check_orders(orders), dtype=np.float64)
    if sigma == 0.0:
        return np.full_like(alphas, np.inf)
    return alphas / (2.0 * sigma * sigma)


def rdp_poisson_subsampled_gaussian(
    sampling_rate: float, noise_multiplier: float, orders: Sequence[float] = DEFAULT_ORDERS
) -> np.ndarray:
    """RDP of one step of the Poisson-subsampled Gaussian mechanism.

    Args:
      sampling_rate: q in (0, 1].
      noise_multiplier: σ >= 0, noise standard deviation over ℓ2 sensitivity.
      orders: RDP orders α > 1 (integers use the exact finite sum, fractional
        orders the conservative MTZ 2019 series; see the module docstring).

    Returns:
      A read-only float64 array of ε_RDP(α), one per order (may hold ∞).
    """
    q = V.in_range(0, 1, "(]", sampling_rate=sampling_rate)
    sigma = V.nonnegative(noise_multiplier=noise_multiplier)
    return _rdp_cached(q, sigma, check_orders(orders))


@functools.lru_cache(maxsize=4096)
def _rdp_cached(q: float, sigma: float, orders: tuple[float, ...]) -> np.ndarray:
    alphas = np.asarray(orders, dtype=np.float64)
    if sigma == 0.0:
        out = np.full_like(alphas, np.inf)
    elif q == 1.0:
        out = alphas / (2.0 * sigma * sigma)
    else:
        out = np.empty_like(alphas)
        is_int = np.array([a.is_integer() for a in orders], dtype=bool)
        if is_int.any():
            ints = tuple(int(a) for a, i in zip(orders, is_int) if i)
            out[is_int] = _log_a_int(q, sigma, ints) / (alphas[is_int] - 1.0)
        if (~is_int).any():
            fracs = tuple(a for a, i in zip(orders, is_int) if not i)
            out[~is_int] = _log_a_frac(q, sigma, fracs) / (alphas[~is_int] - 1.0)
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=16)
def _int_tables(orders: tuple[int, ...]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per group of similar orders: (positions, log C(α, i) with -inf for i > α, i, α).

    Orders are grouped so that a group's widest row is at most twice its
    narrowest (or 64 terms), which keeps the term matrices small for grids
    that mix 2..63 with 128..1024.
    """
    positions = sorted(range(len(orders)), key=lambda k: orders[k])
    groups, current = [], []
    for k in positions:
        if current and orders[k] > max(64, 2 * orders[current[0]]):
            groups.append(current)
            current = []
        current.append(k)
    groups.append(current)
    tables = []
    for group in groups:
        alphas = np.asarray([orders[k] for k in group], dtype=np.float64)[:, None]
        i = np.arange(int(alphas.max()) + 1, dtype=np.float64)[None, :]
        valid = i <= alphas
        log_comb = np.where(
            valid,
            special.gammaln(alphas + 1.0)
            - special.gammaln(i + 1.0)
            - special.gammaln(np.maximum(alphas - i, 0.0) + 1.0),
            -np.inf,
        )
        tables.append(
            (np.asarray(group), log_comb, np.broadcast_to(i, log_comb.shape), np.broadcast_to(alphas, log_comb.shape))
        )
    return tables


def _log_a_int(q: float, sigma: float, orders: tuple[int, ...]) -> np.ndarray:
    """log A_α for integer α: exact log-space binomial sum (MTZ 2019 Sec 3.2)."""
    out = np.empty(len(orders))
    log_q, log_1mq, two_s2 = math.log(q), math.log1p(-q), 2.0 * sigma * sigma
    for group, log_comb, i, alphas in _int_tables(orders):
        with np.errstate(invalid="ignore"):
            terms = log_comb + i * log_q + (alphas - i) * log_1mq + (i * i - i) / two_s2
        terms = np.where(np.isfinite(log_comb), terms, -np.inf)
        out[group] = special.logsumexp(terms, axis=1)
    return out


@functools.lru_cache(maxsize=16)
def _frac_log_comb(orders: tuple[float, ...]) -> np.ndarray:
    """log |C(α, i)| for i = 0.._FRAC_MAX_TERMS-1 (generalized binomial)."""
    alphas = np.asarray(orders, dtype=np.float64)[:, None]
    i = np.arange(_FRAC_MAX_TERMS, dtype=np.float64)[None, :]
    return special.gammaln(alphas + 1.0) - special.gammaln(i + 1.0) - special.gammaln(alphas - i + 1.0)


def _log_a_frac(q: float, sigma: float, orders: tuple[float, ...]) -> np.ndarray:
    """Upper bound on log A_α for fractional α: MTZ 2019 Sec 3.3 series of |terms|.

    Term i of the two parts (integrals below and above z0)::

        s0_i = |C(α,i)| q^i (1-q)^{α-i} exp((i²-i)/(2σ²)) Φ((z0 - i)/σ)
        s1_i = |C(α,i)| q^{α-i} (1-q)^i exp((j²-j)/(2σ²)) Φ((j - z0)/σ),  j = α - i
    """
    log_comb_all = _frac_log_comb(orders)
    alphas = np.asarray(orders, dtype=np.float64)
    n = len(alphas)
    log_q, log_1mq = math.log(q), math.log1p(-q)
    z0 = sigma * sigma * math.log(1.0 / q - 1.0) + 0.5
    two_s2 = 2.0 * sigma * sigma

    result = np.full(n, np.inf)
    active = np.arange(n)
    total = np.full(n, -np.inf)
    last0 = np.full(n, -np.inf)
    last1 = np.full(n, -np.inf)
    for start in range(0, _FRAC_MAX_TERMS, _FRAC_CHUNK):
        stop = min(start + _FRAC_CHUNK, _FRAC_MAX_TERMS)
        i = np.arange(start, stop, dtype=np.float64)[None, :]
        a = alphas[active][:, None]
        j = a - i
        log_comb = log_comb_all[active, start:stop]
        s0 = log_comb + i * log_q + j * log_1mq + (i * i - i) / two_s2 + special.log_ndtr((z0 - i) / sigma)
        s1 = log_comb + j * log_q + i * log_1mq + (j * j - j) / two_s2 + special.log_ndtr((j - z0) / sigma)
        running = np.logaddexp.accumulate(np.logaddexp(s0, s1), axis=1)
        running = np.logaddexp(total[active][:, None], running)
        prev0 = np.concatenate([last0[active][:, None], s0[:, :-1]], axis=1)
        prev1 = np.concatenate([last1[active][:, None], s1[:, :-1]], axis=1)
        done = (s0 < prev0) & (s1 < prev1) & (np.maximum(s0, s1) < running - _STOP_GAP)
        hit = done.any(axis=1)
        first = np.argmax(done, axis=1)
        rows = np.nonzero(hit)[0]
        result[active[rows]] = running[rows, first[rows]]
        total[active] = running[:, -1]
        last0[active] = s0[:, -1]
        last1[active] = s1[:, -1]
        active = active[~hit]
        if active.size == 0:
            break
    return result

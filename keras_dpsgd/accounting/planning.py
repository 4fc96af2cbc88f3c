"""Accounting and planning functions: ε of a ledger, σ for a budget, steps within a budget.

All answers are conservative with respect to the chosen accountant: a
calibrated σ is never below the exact root of ε(σ) = target (the upper end of
the final bisection bracket is returned), and a step budget k always satisfies
ε(k) <= target < ε(k + 1).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, Sequence

import numpy as np

from keras_dpsgd.accounting import _validation as V
from keras_dpsgd.accounting import accountants as A
from keras_dpsgd.accounting import conversions, rdp
from keras_dpsgd.accounting.events import PoissonSampledGaussianEvent

__all__ = [
    "batch_table",
    "calibrate_noise_multiplier",
    "check_delta",
    "compute_epsilon",
    "compute_epsilon_and_order",
    "compute_noise_multiplier",
    "default_delta",
    "effective_noise_multiplier",
    "max_epochs_from_steps",
    "max_epochs_within_budget",
    "max_steps_within_budget",
    "steps_for_epochs",
]

_SIGMA_RTOL = 1e-7
_SIGMA_MAX = 1e7
_MAX_STEPS_CAP = 10**15


def compute_epsilon_and_order(events, delta: float, *, accountant: str = "rdp") -> tuple[float, float | None]:
    """ε at δ of every event in `events`, and the RDP order attaining it.

    Args:
      events: a PrivacyLedger, one event, or an iterable of events.
      delta: δ in (0, 1).
      accountant: "rdp" (tight conversion, default), "moments" (Abadi et al.
        2016: integer λ <= 32, classic conversion) or "pld" (dp_accounting).

    Returns:
      (ε, order): order is the RDP order α (None for "pld" or when ε is 0 or ∞).
    """
    delta = V.check_delta(delta)
    return A.make_accountant(accountant).compose(events).get_epsilon_and_order(delta)


def compute_epsilon(events, delta: float, *, accountant: str = "rdp") -> float:
    """ε at δ of every event in `events` (see :func:`compute_epsilon_and_order`)."""
    return compute_epsilon_and_order(events, delta, accountant=accountant)[0]


def _bisect_sigma(
    epsilon_of_sigma: Callable[[float], float],
    target_epsilon: float,
    *,
    start: float = 1.0,
    shrink: float = 0.5,
    rtol: float = _SIGMA_RTOL,
) -> float:
    """Upper end of a bracket [lo, hi] with ε(lo) > target >= ε(hi), hi - lo <= rtol·hi.

    ε must be non-increasing in σ. Bracketing: double `start` until ε <= target,
    then shrink by `shrink` until ε > target (ε(0) = ∞); then bisection.
    """
    hi = start
    while epsilon_of_sigma(hi) > target_epsilon:
        hi *= 2.0
        if hi > _SIGMA_MAX:
            raise ValueError(
                f"target_epsilon {target_epsilon} is unreachable: even noise_multiplier {_SIGMA_MAX:g} exceeds it"
            )
    lo = hi * shrink
    while lo > 1e-6 and epsilon_of_sigma(lo) <= target_epsilon:
        hi, lo = lo, lo * shrink
    if lo <= 1e-6:
        lo = 0.0  # ε(0) = ∞ > target
    while hi - lo > rtol * hi:
        mid = 0.5 * (lo + hi)
        if epsilon_of_sigma(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def calibrate_noise_multiplier(
    make_events: Callable[[float], object], *, target_epsilon: float, target_delta: float, accountant: str = "rdp"
) -> float:
    """Smallest σ (never below the exact value) such that ε(make_events(σ)) <= target.

    Generic form of :func:`compute_noise_multiplier`: `make_events(σ)` returns
    the events (ledger, event or iterable) of a run with noise multiplier σ,
    e.g. DP-SGD steps plus adaptive-clipping norm queries at σ_eff. ε must be
    non-increasing in σ.

    Raises:
      ValueError: bad targets, or the target is unreachable (e.g. events that do
        not depend on σ already spend it).
    """
    target_epsilon = V.check_epsilon(target_epsilon)
    target_delta = V.check_delta(target_delta, "target_delta")
    if accountant not in A.ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {A.ACCOUNTANTS}, got {accountant!r}")

    def eps(sigma: float, name: str = accountant) -> float:
        return compute_epsilon(make_events(sigma), target_delta, accountant=name)

    if accountant != "pld":
        return _bisect_sigma(eps, target_epsilon)
    # PLD probes are slow (~0.1-0.5 s): start from the RDP answer, which is
    # close, and stop at a relative width of 1e-4 (still the bracket's upper end).
    hint = _bisect_sigma(lambda s: eps(s, "rdp"), target_epsilon, rtol=1e-4)
    return _bisect_sigma(eps, target_epsilon, start=hint, shrink=0.9, rtol=1e-4)


def compute_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sampling_rate: float,
    steps: int,
    accountant: str = "rdp",
    prior_events=(),
) -> float:
    """Smallest σ, never below the exact value, for `steps` DP-SGD steps within (ε, δ).

    Bracketing by doubling, then bisection to a relative width of 1e-7; the
    upper end of the bracket is returned, so ε(σ) <= target_epsilon.

    Args:
      target_epsilon: ε > 0.
      target_delta: δ in (0, 1).
      sampling_rate: q in (0, 1] (Poisson sampling of each step).
      steps: number of noised steps, >= 1.
      accountant: "rdp", "moments" or "pld".
      prior_events: events already spent (ledger, event or iterable).

    Returns:
      The noise multiplier σ.
    """
    q = V.check_sampling_rate(sampling_rate)
    steps = V.check_positive_int(steps, "steps")
    target_epsilon = V.check_epsilon(target_epsilon)
    target_delta = V.check_delta(target_delta, "target_delta")
    prior = A.as_event_list(prior_events)
    if accountant in ("rdp", "moments"):
        base = A.make_accountant(accountant)
        base.compose(prior)
        prior_rdp, orders, conv = base.rdp, base.orders, base.conversion

        def eps(sigma: float) -> float:
            step = rdp.rdp_poisson_subsampled_gaussian(q, sigma, tuple(orders))
            with np.errstate(invalid="ignore"):
                total = prior_rdp + steps * step
            return conversions.epsilon_from_rdp(orders, total, target_delta, conv)[0]

        return _bisect_sigma(eps, target_epsilon)
    return calibrate_noise_multiplier(
        lambda sigma: prior + [PoissonSampledGaussianEvent(q, sigma, steps)],
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        accountant=accountant,
    )


def _largest_k(eps_of_k: Callable[[int], float], target: float, hint: int = 1) -> int:
    """Largest k >= 0 with eps(k) <= target for non-decreasing eps (0 if eps(0) > target)."""
    if eps_of_k(0) > target:
        return 0
    lo, hi = 0, max(1, int(hint))
    while eps_of_k(hi) <= target:
        lo, hi = hi, hi * 2
        if hi > _MAX_STEPS_CAP:
            return lo  # effectively unbounded; lo is verified to fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if eps_of_k(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def max_steps_within_budget(
    *,
    target_epsilon: float,
    target_delta: float,
    sampling_rate: float,
    noise_multiplier: float,
    prior_events=(),
    accountant: str = "rdp",
) -> int:
    """Largest number k of further steps with ε(prior + k steps) <= target_epsilon.

    Exact for the chosen accountant: ε(k) <= target < ε(k + 1) (binary search
    on k; for "rdp"/"moments" each probe is one vectorized conversion of
    prior_rdp + k·step_rdp, so a call takes about a millisecond). Returns 0 if
    not even one step fits; stops searching past 10**15 steps (effectively
    unbounded), returning a verified count of at least 5·10**14.
    """
    q = V.check_sampling_rate(sampling_rate)
    sigma = V.check_noise_multiplier(noise_multiplier)
    target_epsilon = V.check_epsilon(target_epsilon)
    target_delta = V.check_delta(target_delta, "target_delta")
    prior = A.as_event_list(prior_events)
    if accountant not in A.ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {A.ACCOUNTANTS}, got {accountant!r}")
    if sigma == 0.0:
        return 0
    base = A.make_accountant("moments" if accountant == "moments" else "rdp")
    base.compose(prior)
    prior_rdp, orders, conv = base.rdp, base.orders, base.conversion
    step = rdp.rdp_poisson_subsampled_gaussian(q, sigma, tuple(orders))

    def rdp_eps(k: int) -> float:
        with np.errstate(invalid="ignore"):
            total = prior_rdp + k * step if k else prior_rdp
        if not total.any():
            return 0.0
        return conversions.epsilon_from_rdp(orders, total, target_delta, conv)[0]

    k_rdp = _largest_k(rdp_eps, target_epsilon)
    if accountant != "pld":
        return k_rdp

    def pld_eps(k: int) -> float:
        return compute_epsilon(prior + [PoissonSampledGaussianEvent(q, sigma, k)], target_delta, accountant="pld")

    return _largest_k(pld_eps, target_epsilon, hint=max(1, k_rdp))


def max_epochs_within_budget(
    *,
    num_examples: int,
    batch_size: int,
    target_epsilon: float,
    target_delta: float,
    noise_multiplier: float,
    accountant: str = "rdp",
) -> float:
    """Largest number of epochs E (a multiple of B/N) whose ceil(E·N/B) steps fit in (ε, δ).

    E = k·B/N with k = :func:`max_steps_within_budget` at q = B/N, so that
    ceil(E·N/B) = k steps (0.0 if not even one step fits).
    """
    n = V.check_positive_int(num_examples, "num_examples")
    b = V.check_positive_int(batch_size, "batch_size")
    if b > n:
        raise ValueError(f"batch_size must be <= num_examples ({n}), got {b}")
    k = max_steps_within_budget(
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        sampling_rate=b / n,
        noise_multiplier=noise_multiplier,
        accountant=accountant,
    )
    return max_epochs_from_steps(n, b, k)


def max_epochs_from_steps(num_examples: int, batch_size: int, steps: int) -> float:
    """Largest float E with ceil(E·N/B) <= steps (E = steps·B/N, stepped down if rounding went up)."""
    n = V.check_positive_int(num_examples, "num_examples")
    b = V.check_positive_int(batch_size, "batch_size")
    k = V.check_nonnegative_int(steps, "steps")
    epochs = float(Fraction(k * b, n))
    while epochs > 0 and steps_for_epochs(n, b, epochs) > k:  # float rounded up: step down
        epochs = float(np.nextafter(epochs, 0.0))
    return epochs


def steps_for_epochs(num_examples: int, batch_size: int, epochs: float) -> int:
    """ceil(epochs · N / B), exact for decimal `epochs` (no float round-up surprises)."""
    n = V.check_positive_int(num_examples, "num_examples")
    b = V.check_positive_int(batch_size, "batch_size")
    e = V.check_positive_float(epochs, "epochs")
    if b > n:
        raise ValueError(f"batch_size must be <= num_examples ({n}), got {b}")
    return math.ceil(Fraction(repr(e)) * n / b)


def batch_table(
    *,
    num_examples: int,
    epochs: float,
    target_epsilon: float,
    target_delta: float,
    lot_sizes: Sequence[int],
    accountant: str = "rdp",
) -> list[dict]:
    """Noise per example versus lot size (Three Tools paper's table).

    For each lot size L: q = L / N, steps = ceil(E·N / L), σ = the smallest
    noise multiplier spending (ε, δ) in those steps, and noise_per_example =
    σ / L (the standard deviation of the noise on the averaged gradient, in
    units of the clip norm).

    Returns:
      Rows with keys lot_size, sampling_rate, steps, noise_multiplier,
      noise_per_example, in the order of `lot_sizes`.
    """
    n = V.check_positive_int(num_examples, "num_examples")
    V.check_positive_float(epochs, "epochs")
    target_epsilon = V.check_epsilon(target_epsilon)
    target_delta = V.check_delta(target_delta, "target_delta")
    lot_sizes = list(lot_sizes)
    if not lot_sizes:
        raise ValueError("lot_sizes must be a non-empty sequence of integers in [1, num_examples], got []")
    rows = []
    for lot in lot_sizes:
        lot = V.check_positive_int(lot, "lot_size")
        steps = steps_for_epochs(n, lot, epochs)
        sigma = compute_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sampling_rate=lot / n,
            steps=steps,
            accountant=accountant,
        )
        rows.append(
            {
                "lot_size": lot,
                "sampling_rate": lot / n,
                "steps": steps,
                "noise_multiplier": sigma,
                "noise_per_example": sigma / lot,
            }
        )
    return rows


def default_delta(num_examples: int) -> float:
    """δ = 1 / N^1.1, below 1/N as the Three Tools paper recommends."""
    n = V.check_positive_int(num_examples, "num_examples")
    return 1.0 / n**1.1


def check_delta(delta: float, num_examples: int) -> float:
    """Returns δ if it is in (0, 1/N); raises ValueError otherwise.

    δ >= 1/N allows mechanisms that publish one example in the clear.
    """
    delta = V.check_delta(delta)
    n = V.check_positive_int(num_examples, "num_examples")
    if delta >= 1.0 / n:
        raise ValueError(f"delta must be < 1/num_examples = {1.0 / n:.3g} (N = {n}), got {delta!r}")
    return delta


def effective_noise_multiplier(noise_multipliers: Sequence[float]) -> float:
    """σ_eff = (Σ_l 1/σ_l²)^(-1/2): one Gaussian step with per-part noise σ_l.

    Used for per-layer clipping where part l has its own σ_l and clip share
    (the composed mechanism has the privacy of one Gaussian with σ_eff).
    0 if any σ_l is 0.
    """
    sigmas = [V.check_noise_multiplier(s, "noise_multipliers[i]") for s in noise_multipliers]
    if not sigmas:
        raise ValueError("noise_multipliers must be a non-empty sequence of floats >= 0, got an empty sequence")
    if any(s == 0.0 for s in sigmas):
        return 0.0
    return float(sum(1.0 / (s * s) for s in sigmas) ** -0.5)

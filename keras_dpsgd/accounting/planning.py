"""Accounting and planning functions: ε of a ledger, σ for a budget, steps within a budget.

All answers are conservative with respect to the chosen accountant: a
calibrated σ is never below the exact root of ε(σ) = target (the upper end of
the final bisection bracket is returned), and a step budget k always satisfies
ε(k) <= target < ε(k + 1).
"""

from __future__ import annotations

import copy
import math
import warnings
from fractions import Fraction
from typing import Callable, Sequence, Union

import numpy as np

from keras_dpsgd import _validate as V
from keras_dpsgd.accounting import accountants as A
from keras_dpsgd.accounting.events import PoissonSampledGaussianEvent, composed_noise_multiplier
from keras_dpsgd.dp.refusals import refuse

__all__ = [
    "batch_table",
    "calibrate_noise_multiplier",
    "check_delta",
    "compute_epsilon",
    "compute_epsilon_and_order",
    "compute_noise_multiplier",
    "default_delta",
    "effective_noise_multiplier",
    "lots_per_epoch",
    "max_epochs_from_steps",
    "max_epochs_within_budget",
    "max_steps_within_budget",
    "steps_for_epochs",
]

_SIGMA_RTOL = 1e-7
_SIGMA_MAX = 1e7
_MAX_STEPS_CAP = 10**15


Accountant = Union[str, A.PrivacyAccountant]


def compute_epsilon_and_order(events, delta: float, *, accountant: Accountant = "rdp") -> tuple[float, float | None]:
    """ε at δ of every event in `events`, and the RDP order attaining it.

    Args:
      events: a PrivacyLedger, one event, or an iterable of events.
      delta: δ in (0, 1).
      accountant: a registered name (:func:`~keras_dpsgd.accounting.accountant_names`:
        "rdp", tight conversion, the default; "moments", Abadi et al. 2016:
        integer λ <= 32, classic conversion; "pld", dp_accounting) or an
        accountant object (copied, see :func:`make_accountant`).

    Returns:
      (ε, order): order is the RDP order α (None for "pld" or when ε is 0 or ∞).
    """
    delta = V.in_range(0, 1, "()", delta=delta)
    return A.make_accountant(accountant).compose(events).get_epsilon_and_order(delta)


def compute_epsilon(
    events=None,
    target_delta: float | None = None,
    *,
    noise_multiplier: float | None = None,
    sampling_rate: float | None = None,
    steps: int | None = None,
    accountant: Accountant = "rdp",
    prior_events=(),
    delta: float | None = None,
) -> float:
    """ε at δ of a run, with the keywords of :func:`compute_noise_multiplier`.

    The run is given either as `events` (a ledger, one event or an iterable of
    events) or as `noise_multiplier`, `sampling_rate` and `steps` (that many
    DP-SGD steps), plus `prior_events` already spent. The keywords are those of
    :func:`compute_noise_multiplier`, so one dict serves both:
    ``compute_epsilon(noise_multiplier=compute_noise_multiplier(target_epsilon=e, **kw), **kw) <= e``.

    Args:
      events: a PrivacyLedger, one event, or an iterable of events (or None with the three below).
      target_delta: δ in (0, 1) (positional second argument, as before).
      noise_multiplier: σ >= 0 of each step (with `sampling_rate` and `steps`, instead of `events`).
      sampling_rate: q in (0, 1] (Poisson sampling of each step).
      steps: number of noised steps, >= 1.
      accountant: a registered name ("rdp", "moments", "pld", ...) or an accountant object.
      prior_events: events already spent (ledger, event or iterable).
      delta: deprecated spelling of `target_delta` (a DeprecationWarning).

    Returns:
      ε (see :func:`compute_epsilon_and_order`).

    Raises:
      ValueError: δ missing or outside (0, 1), δ given twice, or the run given both ways or neither.
    """
    if delta is not None:
        if target_delta is not None:
            raise ValueError(f"give target_delta only (delta is its deprecated spelling), got both: {delta!r}")
        warnings.warn(
            "compute_epsilon(delta=...) is deprecated: use target_delta=, as compute_noise_multiplier does",
            DeprecationWarning,
            stacklevel=2,
        )
        target_delta = delta
    target_delta = V.in_range(0, 1, "()", target_delta=target_delta)
    step_args = {"noise_multiplier": noise_multiplier, "sampling_rate": sampling_rate, "steps": steps}
    given = [name for name, value in step_args.items() if value is not None]
    if events is not None and given:
        raise ValueError(f"give either events or noise_multiplier, sampling_rate and steps, not both (got {given})")
    if events is None:
        if len(given) != 3:
            missing = sorted(set(step_args) - set(given))
            raise ValueError(f"give events, or all of noise_multiplier, sampling_rate and steps (missing {missing})")
        events = PoissonSampledGaussianEvent(
            V.in_range(0, 1, "(]", sampling_rate=sampling_rate),
            V.nonnegative(noise_multiplier=noise_multiplier),
            V.integer_at_least(1, steps=steps),
        )
    return A.make_accountant(accountant).compose(prior_events).compose(events).get_epsilon(target_delta)


def _epsilon_after(base: A.PrivacyAccountant, delta: float) -> Callable[[object], float]:
    """ε at δ of what `base` holds plus `events`, `base` left unchanged (one probe of a search)."""

    def epsilon(events) -> float:
        return copy.deepcopy(base).compose(events).get_epsilon(delta)

    return epsilon


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
    make_events: Callable[[float], object],
    *,
    target_epsilon: float,
    target_delta: float,
    accountant: Accountant = "rdp",
    prior_events=(),
) -> float:
    """Smallest σ (never below the exact value) such that ε(prior + make_events(σ)) <= target.

    The one calibration routine, over any accountant: `make_events(σ)`
    returns the events (ledger, event or iterable) of a run with noise
    multiplier σ, e.g. DP-SGD steps plus adaptive-clipping norm queries at
    σ_eff. ε must be non-increasing in σ. The search is a bisection on the
    chosen accountant to its ``calibration_rtol``, started from the answer of
    its ``calibration_hint`` accountant if it names one (PLD starts from RDP).

    Raises:
      ValueError: bad targets, or the target is unreachable (e.g. events that do
        not depend on σ already spend it).
    """
    target_epsilon = V.positive(target_epsilon=target_epsilon)
    target_delta = V.in_range(0, 1, "()", target_delta=target_delta)
    base = A.make_accountant(accountant).compose(prior_events)
    start, shrink = 1.0, 0.5
    if base.calibration_hint is not None:
        hint = A.make_accountant(base.calibration_hint).compose(prior_events)
        hint_eps = _epsilon_after(hint, target_delta)
        start = _bisect_sigma(lambda s: hint_eps(make_events(s)), target_epsilon, rtol=base.calibration_rtol)
        shrink = 0.9
    eps = _epsilon_after(base, target_delta)
    return _bisect_sigma(
        lambda s: eps(make_events(s)), target_epsilon, start=start, shrink=shrink, rtol=base.calibration_rtol
    )


def compute_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sampling_rate: float,
    steps: int,
    accountant: Accountant = "rdp",
    prior_events=(),
) -> float:
    """Smallest σ, never below the exact value, for `steps` DP-SGD steps within (ε, δ).

    Bracketing by doubling, then bisection to the accountant's
    ``calibration_rtol`` (1e-7 for RDP); the upper end of the bracket is
    returned, so ε(σ) <= target_epsilon (:func:`calibrate_noise_multiplier`).

    Args:
      target_epsilon: ε > 0.
      target_delta: δ in (0, 1).
      sampling_rate: q in (0, 1] (Poisson sampling of each step).
      steps: number of noised steps, >= 1.
      accountant: a registered name ("rdp", "moments", "pld", ...) or an accountant object.
      prior_events: events already spent (ledger, event or iterable).

    Returns:
      The noise multiplier σ.
    """
    q = V.in_range(0, 1, "(]", sampling_rate=sampling_rate)
    steps = V.integer_at_least(1, steps=steps)
    return calibrate_noise_multiplier(
        lambda sigma: PoissonSampledGaussianEvent(q, sigma, steps),
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        accountant=accountant,
        prior_events=prior_events,
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
    accountant: Accountant = "rdp",
) -> int:
    """Largest number k of further steps with ε(prior + k steps) <= target_epsilon.

    Exact for the chosen accountant: ε(k) <= target < ε(k + 1) (binary search
    on k; for "rdp"/"moments" each probe is one vectorized conversion of
    prior_rdp + k·step_rdp, about a millisecond per call; an accountant with a
    ``calibration_hint`` starts from that accountant's answer). Returns 0 if
    not even one step fits; stops searching past 10**15 steps (effectively
    unbounded), returning a verified count of at least 5·10**14.
    """
    q = V.in_range(0, 1, "(]", sampling_rate=sampling_rate)
    sigma = V.nonnegative(noise_multiplier=noise_multiplier)
    target_epsilon = V.positive(target_epsilon=target_epsilon)
    target_delta = V.in_range(0, 1, "()", target_delta=target_delta)
    base = A.make_accountant(accountant).compose(prior_events)
    if sigma == 0.0:
        return 0

    def search(acc: A.PrivacyAccountant, hint: int = 1) -> int:
        eps = _epsilon_after(acc, target_delta)
        return _largest_k(lambda k: eps(PoissonSampledGaussianEvent(q, sigma, k)), target_epsilon, hint)

    hint = 1
    if base.calibration_hint is not None:
        hint = max(1, search(A.make_accountant(base.calibration_hint).compose(prior_events)))
    return search(base, hint)


def max_epochs_within_budget(
    *,
    num_examples: int,
    batch_size: int,
    target_epsilon: float,
    target_delta: float,
    noise_multiplier: float,
    accountant: Accountant = "rdp",
) -> float:
    """Largest number of epochs E (a multiple of 1/P) whose :func:`steps_for_epochs` fit in (ε, δ).

    E = k/P with k = :func:`max_steps_within_budget` at q = B/N and P = :func:`lots_per_epoch`, so
    that ``steps_for_epochs(N, B, E)`` = k steps (0.0 if not even one step fits).
    """
    n, b = _examples_and_batch(num_examples, batch_size)
    k = max_steps_within_budget(
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        sampling_rate=b / n,
        noise_multiplier=noise_multiplier,
        accountant=accountant,
    )
    return max_epochs_from_steps(n, b, k)


def max_epochs_from_steps(num_examples: int, batch_size: int, steps: int) -> float:
    """Largest float E with ``steps_for_epochs(N, B, E)`` <= steps (E = steps/P, stepped down if rounding went up)."""
    n = V.integer_at_least(1, num_examples=num_examples)
    b = V.integer_at_least(1, batch_size=batch_size)
    k = V.integer_at_least(0, steps=steps)
    epochs = float(Fraction(k, lots_per_epoch(n, b)))
    while epochs > 0 and steps_for_epochs(n, b, epochs) > k:  # float rounded up: step down
        epochs = float(np.nextafter(epochs, 0.0))
    return epochs


def lots_per_epoch(num_examples: int, expected_lot_size: float) -> int:
    """P = ceil(N / L): the steps (lots) of one epoch, the one definition of an epoch in keras_dpsgd.

    An epoch is P lots, P·L >= N examples on average (Abadi et al. 2016, Section 3.1: "an epoch" is
    N/L lots; rounded up to whole steps, as a ``DataLoader`` of N examples in batches of L has
    ceil(N/L) of them). Planning (:func:`steps_for_epochs`, the CLI's ``noise`` and ``epsilon``),
    :func:`keras_dpsgd.make_private_with_epsilon` and :attr:`keras_dpsgd.PoissonLots.lots_per_epoch`
    (the lots ``fit`` runs per epoch) all read it here, so a plan of E epochs is the steps training
    runs and ``WithinLimit`` stops after them, not before.

    Args:
      num_examples: N >= 1.
      expected_lot_size: L in (0, N] (qN: may be fractional when q is given; a relative rounding of
        1e-9 in qN is ignored, so q = L/N gives ceil(N/L) exactly).
    """
    n = V.integer_at_least(1, num_examples=num_examples)
    lot = V.in_range(0, n, "(]", expected_lot_size=expected_lot_size)
    return max(1, math.ceil(n / lot - 1e-9))


def steps_for_epochs(num_examples: int, batch_size: int, epochs: float) -> int:
    """ceil(E · P) steps for E epochs of P = :func:`lots_per_epoch` lots (E · P exactly when E is whole).

    Exact for decimal `epochs` (no float round-up surprises).
    """
    n, b = _examples_and_batch(num_examples, batch_size)
    e = V.positive(epochs=epochs)
    return math.ceil(Fraction(repr(e)) * lots_per_epoch(n, b))


def _examples_and_batch(num_examples: int, batch_size: int) -> tuple[int, int]:
    """(N, B), validated: integers with 1 <= B <= N."""
    n = V.integer_at_least(1, num_examples=num_examples)
    b = V.integer_at_least(1, batch_size=batch_size)
    if b > n:
        raise ValueError(f"batch_size must be <= num_examples ({n}), got {b}")
    return n, b


def batch_table(
    *,
    num_examples: int,
    epochs: float,
    target_epsilon: float,
    target_delta: float,
    lot_sizes: Sequence[int],
    accountant: Accountant = "rdp",
) -> list[dict]:
    """Noise per example versus lot size (Three Tools paper's table).

    For each lot size L: q = L / N, steps = :func:`steps_for_epochs` (E · ceil(N / L)), σ = the smallest
    noise multiplier spending (ε, δ) in those steps, and noise_per_example =
    σ / L (the standard deviation of the noise on the averaged gradient, in
    units of the clip norm).

    Returns:
      Rows with keys lot_size, sampling_rate, steps, noise_multiplier,
      noise_per_example, in the order of `lot_sizes`.
    """
    n = V.integer_at_least(1, num_examples=num_examples)
    V.positive(epochs=epochs)
    target_epsilon = V.positive(target_epsilon=target_epsilon)
    target_delta = V.in_range(0, 1, "()", target_delta=target_delta)
    lot_sizes = list(lot_sizes)
    if not lot_sizes:
        raise ValueError("lot_sizes must be a non-empty sequence of integers in [1, num_examples], got []")
    rows = []
    for lot in lot_sizes:
        lot = V.integer_at_least(1, lot_size=lot)
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


DEFAULT_DELTA_RULE = "min(1/N^1.1, 1/(10·N))"


def default_delta(num_examples: int) -> float:
    """δ = min(1/N^1.1, 1/(10·N)): well below 1/N for every N (δ·N <= 0.1).

    δ must be much smaller than 1/N (Dwork & Roth 2014, §2.3: δ near 1/N allows
    publishing one example in the clear). 1/N^1.1 (van der Veen et al. 2018)
    alone gives δ·N = N^-0.1, 0.54 at N = 455, not much smaller than 1 for the
    sizes of small tables; the 1/(10·N) cap keeps δ·N <= 0.1 (1/N^1.1 is the
    smaller one only beyond N = 10^10).
    """
    n = V.integer_at_least(1, num_examples=num_examples)
    return min(1.0 / n**1.1, 1.0 / (10 * n))


def check_delta(delta: float, num_examples: int) -> float:
    """Returns δ if it is in (0, 1/N); raises ValueError otherwise.

    δ >= 1/N allows mechanisms that publish one example in the clear.
    """
    delta = V.in_range(0, 1, "()", delta=delta)
    n = V.integer_at_least(1, num_examples=num_examples)
    if delta >= 1.0 / n:
        raise refuse(
            "delta-above-one-over-n", f"delta must be < 1/num_examples = {1.0 / n:.3g} (N = {n}), got {delta!r}"
        )
    return delta


def effective_noise_multiplier(noise_multipliers: Sequence[float]) -> float:
    """σ_eff = (Σ_l 1/σ_l²)^(-1/2): one Gaussian step with per-part noise σ_l.

    Used for per-layer clipping where part l has its own σ_l and clip share
    (the composed mechanism has the privacy of one Gaussian with σ_eff).
    0 if any σ_l is 0. Computed by :func:`keras_dpsgd.accounting.composed_noise_multiplier`.
    """
    return composed_noise_multiplier(noise_multipliers)

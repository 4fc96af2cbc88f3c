"""Adaptive clipping bounds, written once for every backend: settings, bound rules, the state machine, σ_eff.

Three Tools (van der Veen et al. 2018, Sec. 3) rule "mean" and Andrew et al. 2021 rule "quantile". The bounds
are per clipping group g (one per trainable variable: per-layer; or one for the whole gradient: flat). Per lot,
the gradient is clipped to the bounds in force C_g and released as usual; in the same step each group's bound
query is released and sets the next bound (the derivation and the privacy accounting are in
:mod:`keras_dpsgd.tools.adaptive_clipping`):

* rule "mean": Σ_i min(‖g_i^g‖, β C_g) + N(0, σ_q² β² C_g²) (sensitivity β C_g),
  C_g ← max(α · query / L, min_clip_bound);
* rule "quantile": Σ_i 1[‖g_i^g‖ <= C_g] + N(0, σ_q²) (a count, sensitivity 1), b̃ = query / L,
  C_g ← max(C_g · exp(-η (b̃ - target_quantile)), min_clip_bound).

The state machine of the queries: every batch adds its terms to the lot's sums (:func:`query_terms`); a
discarded partial lot zeroes them; at the lot's release, after the gradient's, the sums are noised and the
next bounds follow (:func:`next_bounds_from_sums`), then the sums are zeroed. The array math runs over the
backend's :class:`keras_dpsgd.dp.ops.ArrayOps`; the backend keeps the state (TensorFlow: the adaptive
optimizer's variables and hooks, ``keras_dpsgd.step.adaptive``; JAX: the values of the stateless train step).
Nothing here imports an array library.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np

from keras_dpsgd import _validate
from keras_dpsgd.dp.ops import ArrayOps

__all__ = [
    "NORM_NOISE_INDEX",
    "RULES",
    "PUBLIC_SETTINGS",
    "MIN_BOUND",
    "AdaptiveSettings",
    "check_settings",
    "query_terms",
    "example_query_terms",
    "query_sensitivity",
    "next_bounds",
    "next_bounds_from_sums",
    "composed_noise_multiplier",
    "adaptive_clipping_event",
    "calibrate_adaptive_noise_multiplier",
    "initial_bounds",
    "initial_flat_bound",
]

# Index folded into the seeded noise stream for the norm queries (the gradient noise uses the
# variable indices 0..V-1).
NORM_NOISE_INDEX = 1 << 30

RULES = ("mean", "quantile")

# The smallest initial bound (a variable whose noise gradients are all 0 gets it): the default min_clip_bound.
MIN_BOUND = 1e-6


@dataclasses.dataclass(frozen=True)
class AdaptiveSettings:
    """The adaptive settings (a plain dataclass: untracked by Keras and TensorFlow)."""

    norm_sigmas: tuple
    norm_noise_multiplier: Any  # as given: one float or a list (get_config)
    alpha: float
    beta: float
    min_clip_bound: float
    rule: str = "mean"
    target_quantile: float = 0.5
    quantile_learning_rate: float = 0.2
    divide_by_bound: bool = False


# The settings an adaptive optimizer shows as read-only attributes and writes in ``get_config`` (its
# ``__init__`` arguments); ``norm_sigmas`` is internal (one σ_q per group).
PUBLIC_SETTINGS = tuple(f.name for f in dataclasses.fields(AdaptiveSettings) if f.name != "norm_sigmas")


def _check_bool(**named: Any) -> bool:
    ((name, value),) = named.items()
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_settings(
    num_bounds: int,
    norm_noise_multiplier: Any,
    alpha: Any,
    beta: Any,
    min_clip_bound: Any,
    rule: Any = "mean",
    target_quantile: Any = 0.5,
    quantile_learning_rate: Any = 0.2,
    divide_by_bound: Any = False,
) -> AdaptiveSettings:
    """The checked settings of `num_bounds` clipping groups (``ValueError``/``TypeError`` naming the argument).

    `norm_noise_multiplier` is one σ_q >= 0 for every group, or a list of one per group."""
    if isinstance(norm_noise_multiplier, (list, tuple)):
        if len(norm_noise_multiplier) != num_bounds:
            raise ValueError(
                f"norm_noise_multiplier must have one entry per clip bound ({num_bounds}), "
                f"got {len(norm_noise_multiplier)}"
            )
        sigmas = [
            _validate.nonnegative(**{f"norm_noise_multiplier[{i}]": s}) for i, s in enumerate(norm_noise_multiplier)
        ]
        given = list(sigmas)
    else:
        sigmas = [_validate.nonnegative(norm_noise_multiplier=norm_noise_multiplier)] * num_bounds
        given = sigmas[0]
    return AdaptiveSettings(
        tuple(sigmas),
        given,
        _validate.positive(alpha=alpha),
        _validate.positive(beta=beta),
        _validate.positive(min_clip_bound=min_clip_bound),
        _validate.one_of(RULES, rule=rule),
        _validate.in_range(0.0, 1.0, target_quantile=target_quantile),
        _validate.positive(quantile_learning_rate=quantile_learning_rate),
        _check_bool(divide_by_bound=divide_by_bound),
    )


def query_terms(settings: AdaptiveSettings, norms: Any, bounds: Any, finite: Any, ops: ArrayOps) -> Any:
    """[B, G] each example's term of each group's bound query, 0 for a non-finite example.

    Rule "mean" (Three Tools, Sec. 3): min(‖g_i^g‖, β C_g); rule "quantile" (Andrew et al. 2021,
    Alg. 1): 1[‖g_i^g‖ <= C_g]. `norms` [B, G], `bounds` [1, G] (in force), `finite` [B, 1].
    """
    if settings.rule == "quantile":
        terms = ops.where(norms <= bounds, ops.ones_like(norms), ops.zeros_like(norms))
    else:
        terms = ops.minimum(norms, settings.beta * bounds)
    return ops.where(finite, terms, ops.zeros_like(terms))


def example_query_terms(
    settings: AdaptiveSettings, sq_norms: Any, bounds: Any, finite: Any, groups: Sequence[int], ops: ArrayOps
) -> Any:
    """[B, G] each example's term of each group's query (:func:`query_terms`) from its [B, V] squared norms.

    `groups`: the clipping group of each variable (static ints; flat: all 0, the group's squares added up);
    `bounds` [G] in force; `finite` [B, 1] (``keras_dpsgd.dp.clip.finite_rows``)."""
    num = max(groups) + 1
    if num != len(groups):
        sq_norms = ops.group_sum(sq_norms, groups, num)
    norms = ops.sqrt(ops.maximum(sq_norms, 0.0))
    return query_terms(settings, norms, bounds[None, :], finite, ops)


def query_sensitivity(settings: AdaptiveSettings, bounds: Any) -> Any:
    """[G] the L2 sensitivity of each group's query sum to one example: β C_g ("mean"), 1 (a count).

    The query is released as Σ_i term_i + N(0, σ_q,g² · sensitivity²)."""
    return 1.0 if settings.rule == "quantile" else settings.beta * bounds


def next_bounds(settings: AdaptiveSettings, bounds: Any, released: Any, ops: ArrayOps) -> Any:
    """[G] the next bounds from the bounds in force and the released query divided by L.

    "mean": C ← α · released; "quantile": C ← C · exp(-η (b̃ - target_quantile)), b̃ = released;
    both floored at ``min_clip_bound``. Post-processing of the released query only."""
    if settings.rule == "quantile":
        new = bounds * ops.exp(-settings.quantile_learning_rate * (released - settings.target_quantile))
    else:
        new = settings.alpha * released
    return ops.maximum(new, settings.min_clip_bound)


def next_bounds_from_sums(
    settings: AdaptiveSettings,
    sums: Any,
    bounds: Any,
    sigmas: Any,
    noise: Any,
    normalize: Callable[[Any], Any],
    ops: ArrayOps,
) -> Any:
    """[G] the release of the lot's bound queries and the next bounds (after the gradient's release).

    Args:
      settings: the adaptive settings.
      sums: [G] Σ_i term_i of the lot (:func:`query_terms` summed over its batches).
      bounds: [G] the bounds in force (those the lot was clipped to).
      sigmas: [G] σ_q,g of each query (times the replica's share of the noise, under replicas).
      noise: [G] standard normal draws under the query's own key (index :data:`NORM_NOISE_INDEX`).
      normalize: the noised sums (Σ_i term_i + N(0, σ_q,g² · sensitivity_g²)) divided by the gradient's L
        (after the sum over replicas, under replicas).
      ops: the backend's array table.

    Returns:
      The next bounds, one per group (the caller zeroes `sums` for the next lot).
    """
    noisy = sums + sigmas * query_sensitivity(settings, bounds) * noise
    return next_bounds(settings, bounds, normalize(noisy), ops)


def _check_sigmas(name: str, values: Sequence[float]) -> list[float]:
    out = [_validate.nonnegative(**{f"{name}[{i}]": s}) for i, s in enumerate(values)]
    if not out:
        raise ValueError(f"{name} must be a non-empty sequence of numbers >= 0, got an empty sequence")
    return out


def composed_noise_multiplier(noise_multipliers: Sequence[float], norm_noise_multipliers: Sequence[float]) -> float:
    """σ_eff = (Σ_l 1/σ_l² + Σ_l 1/σ_l2²)^(-1/2) of one adaptive-clipping step.

    See :mod:`keras_dpsgd.tools.adaptive_clipping` for the derivation. 0 (no privacy) if any σ is 0.

    Args:
      noise_multipliers: σ_l of each layer's gradient release.
      norm_noise_multipliers: σ_l2 of each layer's norm query.

    Returns:
      The effective noise multiplier of the composed step.
    """
    from keras_dpsgd.accounting import composed_noise_multiplier as sigma_eff

    sigmas = _check_sigmas("noise_multipliers", noise_multipliers)
    sigmas += _check_sigmas("norm_noise_multipliers", norm_noise_multipliers)
    return sigma_eff(sigmas)


def adaptive_clipping_event(
    *, noise_multiplier: float, norm_noise_multiplier: float, num_layers: int, sampling_rate: float, steps: int
):
    """The privacy event of `steps` adaptive-clipping steps (one σ, one σ_l2 for all layers).

    Returns:
      PoissonSampledGaussianEvent(sampling_rate, σ_eff, steps) with σ_eff from
      :func:`composed_noise_multiplier`.
    """
    from keras_dpsgd.accounting import PoissonSampledGaussianEvent

    layers = _validate.integer_at_least(1, num_layers=num_layers)
    sigma_eff = composed_noise_multiplier([noise_multiplier] * layers, [norm_noise_multiplier] * layers)
    return PoissonSampledGaussianEvent(sampling_rate, sigma_eff, count=steps, label="dp-sgd adaptive clipping")


def calibrate_adaptive_noise_multiplier(
    *,
    num_layers: int,
    norm_noise_multiplier: float,
    target_epsilon: float,
    target_delta: float,
    sampling_rate: float,
    steps: int,
    accountant: str = "rdp",
) -> float:
    """Per-layer gradient σ that meets (ε, δ) together with the norm queries.

    Uses the accountant's :func:`keras_dpsgd.accounting.calibrate_noise_multiplier`
    on the composed step of :func:`adaptive_clipping_event`: the returned σ is
    never below the exact value, so ε(σ, σ_l2) <= target_epsilon.

    Args:
      num_layers: number of clipped layers (trainable variables) V.
      norm_noise_multiplier: σ_l2 > 0 of each norm query.
      target_epsilon: ε > 0.
      target_delta: δ in (0, 1).
      sampling_rate: q in (0, 1].
      steps: number of steps, >= 1.
      accountant: "rdp", "moments" or "pld".

    Returns:
      σ for every layer's gradient noise.

    Raises:
      ValueError: if the norm queries alone already spend the budget (no
        gradient σ can meet it; raise `norm_noise_multiplier`).
    """
    from keras_dpsgd.accounting import (
        PoissonSampledGaussianEvent,
        calibrate_noise_multiplier,
        compute_noise_multiplier,
    )

    layers = _validate.integer_at_least(1, num_layers=num_layers)
    s2 = _validate.positive(norm_noise_multiplier=norm_noise_multiplier)
    # σ_eff needed by the whole step; the norm queries alone give σ_l2/√V.
    needed = compute_noise_multiplier(
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        sampling_rate=sampling_rate,
        steps=steps,
        accountant=accountant,
    )
    if s2 / math.sqrt(layers) <= needed:
        raise ValueError(
            f"norm_noise_multiplier must be > {needed * math.sqrt(layers):.6g} for {layers} layers: the norm "
            f"queries alone (sigma_eff {s2 / math.sqrt(layers):.6g}) already spend epsilon "
            f"{target_epsilon} at delta {target_delta}; got {norm_noise_multiplier!r}"
        )

    def events(sigma: float):
        eff = composed_noise_multiplier([sigma] * layers, [s2] * layers) if sigma > 0 else 0.0
        return [PoissonSampledGaussianEvent(sampling_rate, eff, count=steps, label="dp-sgd adaptive clipping")]

    return calibrate_noise_multiplier(
        events, target_epsilon=target_epsilon, target_delta=target_delta, accountant=accountant
    )


def initial_bounds(sq_norms: np.ndarray) -> list[float]:
    """Per-variable initial bounds C_0 (Three Tools Sec. 3): the mean per-example norm of each variable.

    `sq_norms` [B, V]: the squared per-example gradient norms of one batch of random noise (public data, no
    privacy cost). Each bound is at least :data:`MIN_BOUND`."""
    return [max(float(m), MIN_BOUND) for m in np.mean(np.sqrt(sq_norms), axis=0)]


def initial_flat_bound(sq_norms: np.ndarray) -> float:
    """The flat initial bound C_0: the mean per-example norm of the whole gradient (at least :data:`MIN_BOUND`)."""
    return max(float(np.mean(np.sqrt(sq_norms.sum(axis=1)))), MIN_BOUND)

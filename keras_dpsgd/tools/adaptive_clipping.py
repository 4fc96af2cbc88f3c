"""Gradient-aware adaptive per-layer clipping (Three Tools, tool 2): its privacy arithmetic.

Van der Veen et al. 2018, Section 3: per-layer gradient norms differ by orders
of magnitude across layers and change during training (their Figure 4), so a
fixed bound clips some layers too hard and adds far too much noise to others.
The bound of layer (trainable variable) l at step t follows a DP estimate of
the previous lot's mean per-example norm of that layer::

    C_l2^l     = β · C_{t-1}^l                          (norm-query bound)
    m̂^l        = (Σ_{i∈lot} min(‖g_i^l‖, C_l2^l) + N(0, σ_l2² (C_l2^l)²)) / L
    C_t^l      = α · m̂^l

with L the expected lot size, α = 1.0 by default (1.1 in the paper's run),
β = 2 and σ_l2 chosen by the user. The first bounds C_0^l come from the mean
per-example norms of one iteration on random noise (public data, no privacy
cost): :func:`keras_dpsgd.tools.initial_clip_bounds`. The optimizer is
:class:`keras_dpsgd.tools.AdaptiveDPSGDOptimizer` (or
:func:`keras_dpsgd.tools.make_adaptive_optimizer` for other descent rules).

Privacy of one step (derivation)
--------------------------------
Step t touches the lot (each example sampled independently with probability
q) through 2V releases, all computed from the same per-example gradients:

* the gradient of layer l: Σ_i clip(g_i^l, C_l) + N(0, σ_l² C_l² I) — a Gaussian
  mechanism with ℓ2 sensitivity C_l (add/remove one example changes the sum
  by a vector of norm <= C_l) and noise σ_l · C_l;
* the norm query of layer l: Σ_i min(‖g_i^l‖, C_l2^l) + N(0, σ_l2² (C_l2^l)²) —
  a Gaussian mechanism with sensitivity C_l2^l and noise σ_l2 · C_l2^l.

Divide each release by its own noise scale (post-processing, invertible): the
2V releases become one vector f(lot) + N(0, I), where one example moves f by a
vector whose squared norm is at most Σ_l (C_l / (σ_l C_l))² + Σ_l
(C_l2^l / (σ_l2 C_l2^l))² = Σ_l 1/σ_l² + Σ_l 1/σ_l2², with equality when every
clip is active (so the bound is tight). A Gaussian mechanism with sensitivity
s and unit noise is exactly a Gaussian mechanism with sensitivity 1 and noise
multiplier 1/s, so each step is one Poisson-sampled Gaussian mechanism with

    σ_eff = (Σ_l 1/σ_l² + Σ_l 1/σ_l2²)^(-1/2),

sampled once for all 2V releases (so the amplification by sampling applies to
the whole step). The bounds C_l and C_l2^l depend on earlier releases only
(adaptive composition of Gaussian mechanisms is covered by RDP composition).
The optimizer's ``effective_noise_multiplier`` reports this σ_eff, so the
ledger charges the norm queries. The paper's statement that σ 0.7225 → 0.725
with σ_l2 = 2.5 keeps the budget is not exact; use
:func:`calibrate_adaptive_noise_multiplier` to find the gradient σ that meets
a target (ε, δ).

Practical caveat (observed on small data): the bounds follow the real
gradient norms, so when the gradient noise is large relative to the signal
(small N, small lots, high learning rate) noise-driven weight growth raises
the norms, which raises the bounds and hence the noise, and training can
diverge (bounds blow up, then collapse to ``min_clip_bound``). Larger lots, a
smaller learning rate or a smaller model avoid the feedback; watch the bounds
with :class:`ClipBoundsLogger`.

This module is pure Python; the optimizers, :func:`initial_clip_bounds` and
:class:`ClipBoundsLogger` are in :mod:`keras_dpsgd.tools` (and
:mod:`keras_dpsgd.tf_keras`), which import TensorFlow. (This module does not
re-export them: the TensorFlow module builds on this one, not the reverse.)
"""

from __future__ import annotations

import math
from typing import Sequence

from keras_dpsgd import _validate

__all__ = ["adaptive_clipping_event", "calibrate_adaptive_noise_multiplier", "composed_noise_multiplier"]


def _check_sigmas(name: str, values: Sequence[float]) -> list[float]:
    out = [_validate.nonnegative(**{f"{name}[{i}]": s}) for i, s in enumerate(values)]
    if not out:
        raise ValueError(f"{name} must be a non-empty sequence of numbers >= 0, got an empty sequence")
    return out


def composed_noise_multiplier(noise_multipliers: Sequence[float], norm_noise_multipliers: Sequence[float]) -> float:
    """σ_eff = (Σ_l 1/σ_l² + Σ_l 1/σ_l2²)^(-1/2) of one adaptive-clipping step.

    See the module docstring for the derivation. 0 (no privacy) if any σ is 0.

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

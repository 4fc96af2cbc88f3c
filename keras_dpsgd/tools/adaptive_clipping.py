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

This module is pure Python: its functions are the backend-neutral core's
(:mod:`keras_dpsgd.dp.adaptive`, which also holds the bound rules and their
release, written once for every backend). The optimizers,
:func:`initial_clip_bounds` and :class:`ClipBoundsLogger` are in
:mod:`keras_dpsgd.tools` (and :mod:`keras_dpsgd.tf_keras`,
:mod:`keras_dpsgd.keras3`), which import TensorFlow. (This module does not
re-export them: the TensorFlow modules build on the core, not the reverse.)
"""

from keras_dpsgd.dp.adaptive import (
    adaptive_clipping_event,
    calibrate_adaptive_noise_multiplier,
    composed_noise_multiplier,
)

__all__ = ["adaptive_clipping_event", "calibrate_adaptive_noise_multiplier", "composed_noise_multiplier"]

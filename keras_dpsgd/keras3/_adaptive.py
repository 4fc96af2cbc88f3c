"""Adaptive per-layer clipping on Keras 3 (Three Tools, tool 2).

The same math and ledger events as on tf_keras (the rules: :mod:`keras_dpsgd.dp.adaptive`; the optimizer
mixin both front ends share: :mod:`keras_dpsgd.step.adaptive`; the derivation:
:mod:`keras_dpsgd.tools.adaptive_clipping`), through the published hooks of
:class:`keras_dpsgd.keras3.DPKeras3Mixin`: ``on_per_example_sq_norms`` sums the norm queries,
``on_noised_step`` releases them (noise from ``standard_normal``, divided like the gradient by
``normalize``) and sets the next bounds. The model needs the private train step
(``keras_dpsgd.keras3.make_private``).
"""

from __future__ import annotations

import keras

from keras_dpsgd.keras3._optimizer import SPLIT_HOOKS, DPKeras3Mixin, DPSGDOptimizer
from keras_dpsgd.step.adaptive import AdaptiveClippingCore, adaptive_optimizer_class
from keras_dpsgd.step.clip_bounds import ClipBoundsLoggerCore

__all__ = ["AdaptiveClippingKeras3Mixin", "AdaptiveDPSGDOptimizer", "make_adaptive_optimizer", "ClipBoundsLogger"]


class AdaptiveClippingKeras3Mixin(AdaptiveClippingCore):
    """Adaptive per-layer clipping for a Keras 3 DP optimizer; put before it in the bases.

    Under R > 1 replicas its norm queries are split like the gradient's noise
    (``AdaptiveClippingCore._update_clip_bounds``); a subclass overriding these hooks again is refused.
    """

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        # Σ_i min(‖g_i^v‖, β C_v) of the current lot (summed over the lot's batches, zeroed after each release and when a partial lot is discarded).
        self._norm_sums = self.add_variable(
            (self._num_bound_groups(len(variables)),), initializer="zeros", dtype="float32", name="adaptive_norm_sums"
        )


# The norm queries' release is split across replicas (``AdaptiveClippingCore._update_clip_bounds``).
# divide_by_bound divides each replica's share of the release by the same public bound (linear).
SPLIT_HOOKS.update(
    add_noise=AdaptiveClippingCore.add_noise,
    on_per_example_sq_norms=AdaptiveClippingCore.on_per_example_sq_norms,
    on_noised_step=AdaptiveClippingCore.on_noised_step,
)

_ADAPTIVE_CLASSES: dict[type, type] = {}


def make_adaptive_optimizer(dp_optimizer_cls: type) -> type:
    """Adds adaptive per-layer clipping to a Keras 3 DP optimizer class (e.g. ``DPAdamOptimizer``).

    Args:
      dp_optimizer_cls: a class from ``keras_dpsgd.keras3.make_dp_optimizer`` or ``DPSGDOptimizer``.

    Returns:
      A class taking (l2_norm_clip, noise_multiplier, norm_noise_multiplier, alpha=1.0, beta=2.0,
      min_clip_bound=1e-6, **the DP class's arguments), registered for Keras 3 serialization under
      package "keras_dpsgd".

    Raises:
      ValueError: `dp_optimizer_cls` is not a Keras 3 DP optimizer class of this package.
    """
    if not (isinstance(dp_optimizer_cls, type) and issubclass(dp_optimizer_cls, DPKeras3Mixin)):
        raise ValueError(
            "dp_optimizer_cls must be a keras_dpsgd Keras 3 DP optimizer class (keras_dpsgd.keras3; for "
            f"tf_keras use keras_dpsgd.tf_keras.make_adaptive_optimizer), got {dp_optimizer_cls!r}"
        )
    return adaptive_optimizer_class(
        dp_optimizer_cls,
        AdaptiveClippingKeras3Mixin,
        keras.saving.register_keras_serializable,
        "keras_dpsgd.keras3",
        _ADAPTIVE_CLASSES,
    )


AdaptiveDPSGDOptimizer = make_adaptive_optimizer(DPSGDOptimizer)


class ClipBoundsLogger(ClipBoundsLoggerCore, keras.callbacks.Callback):
    __doc__ = ClipBoundsLoggerCore.__doc__

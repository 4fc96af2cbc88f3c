"""Adaptive per-layer clipping on tf_keras: the optimizer mode and the logging callback.

The rules are the core's (:mod:`keras_dpsgd.dp.adaptive`), their privacy derivation is in
:mod:`keras_dpsgd.tools.adaptive_clipping`; the part shared with Keras 3 (:mod:`keras_dpsgd.keras3`) is in
:mod:`keras_dpsgd.step.adaptive` (the optimizer mixin) and :mod:`keras_dpsgd.step.clip_bounds`.
"""

from __future__ import annotations

import tensorflow as tf
import tf_keras as keras

from keras_dpsgd.tf_keras._sanitizer import DPSanitizerMixin
from keras_dpsgd.tf_keras._optimizer import DPSGDOptimizer
from keras_dpsgd.step.adaptive import AdaptiveClippingCore, adaptive_optimizer_class
from keras_dpsgd.step.clip_bounds import ClipBoundsLoggerCore, initial_clip_bounds, initial_flat_clip_bound

__all__ = [
    "AdaptiveClippingMixin",
    "AdaptiveDPSGDOptimizer",
    "make_adaptive_optimizer",
    "initial_clip_bounds",
    "initial_flat_clip_bound",
    "ClipBoundsLogger",
]


class AdaptiveClippingMixin(AdaptiveClippingCore):
    """Adaptive per-layer clipping (Three Tools, Sec. 3) for a tf_keras DP optimizer; put before it.

    The shared behaviour is :class:`keras_dpsgd.step.adaptive.AdaptiveClippingCore`. On
    tf_keras it runs inside the traced train step, with any per-example backend (it only needs
    the backend's [B, V] squared norms), and with gradient accumulation (the norm sums are
    accumulated over the lot's physical batches, in a checkpointed optimizer variable).
    """

    # Read by the sanitizer's strategy check (``DPSanitizerMixin._check_distribution``).
    _refused_under_replicas = (
        "adaptive clipping's norm queries would need their noise split and summed across replicas, "
        "and the next clip bounds set identically on every replica, which is not implemented. Use "
        "fixed bounds (keras_dpsgd.tf_keras.DPSGDOptimizer; keras_dpsgd.tools.initial_clip_bounds "
        "can set per-layer bounds once, before training) or train on one device."
    )

    def build(self, var_list):
        if getattr(self, "_built", False):
            return
        super().build(var_list)
        # An optimizer variable (checkpointed): a lot interrupted by a restart keeps its partial norm sums.
        self._norm_sums = self.add_variable(
            [self._num_bound_groups(len(var_list))], tf.float32, name="adaptive_norm_sums"
        )


_ADAPTIVE_CLASSES: dict[type, type] = {}


def make_adaptive_optimizer(dp_optimizer_cls: type) -> type:
    """Adds adaptive per-layer clipping to a tf_keras DP optimizer class (e.g. `DPAdamOptimizer`).

    Args:
      dp_optimizer_cls: a class from `keras_dpsgd.tf_keras.make_dp_optimizer` or `DPSGDOptimizer`.

    Returns:
      A class taking (l2_norm_clip, noise_multiplier, norm_noise_multiplier,
      alpha=1.0, beta=2.0, min_clip_bound=1e-6, **the DP class's arguments),
      registered for serialization under package "keras_dpsgd".
    """
    if not (isinstance(dp_optimizer_cls, type) and issubclass(dp_optimizer_cls, DPSanitizerMixin)):
        raise ValueError(f"dp_optimizer_cls must be a keras_dpsgd DP optimizer class, got {dp_optimizer_cls!r}")
    return adaptive_optimizer_class(
        dp_optimizer_cls, AdaptiveClippingMixin, keras.saving.register_keras_serializable, __name__, _ADAPTIVE_CLASSES
    )


AdaptiveDPSGDOptimizer = make_adaptive_optimizer(DPSGDOptimizer)


class ClipBoundsLogger(ClipBoundsLoggerCore, keras.callbacks.Callback):
    __doc__ = ClipBoundsLoggerCore.__doc__

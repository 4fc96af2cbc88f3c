"""The three tools of "Three Tools for Practical Differential Privacy" (van der Veen et al. 2018).

1. :mod:`~keras_dpsgd.tools.memorization`: the memorization test (random noise
   with random labels, with and without DP; and the real-task comparison).
2. :mod:`~keras_dpsgd.tools.adaptive_clipping`: gradient-aware adaptive
   per-layer clipping, its composed accounting and calibration.
3. :mod:`~keras_dpsgd.tools.large_lots`: large lots with a linearly scaled
   learning rate and gradient accumulation.

And :mod:`~keras_dpsgd.tools.tuning`: a hyperparameter search with one budget for the
whole search (Papernot & Steinke 2022).

Names are imported lazily: the pure-Python parts (large lots, the adaptive
clipping arithmetic) do not import TensorFlow.
"""

from keras_dpsgd import _lazy

_LAZY = {
    # memorization test
    "memorization_test": "keras_dpsgd.tools.memorization",
    "real_task_test": "keras_dpsgd.tools.memorization",
    "DPSettings": "keras_dpsgd.tools.memorization",
    "MemorizationReport": "keras_dpsgd.tools.memorization",
    "mlp_builder": "keras_dpsgd.tools.memorization",
    "convnet_builder": "keras_dpsgd.tools.memorization",
    "clopper_pearson_lower": "keras_dpsgd.tools._stats",
    "binomial_p_value": "keras_dpsgd.tools._stats",
    "random_noise_data": "keras_dpsgd.tools.data",
    "load_digits": "keras_dpsgd.tools.data",
    "load_tfds": "keras_dpsgd.tools.data",
    # adaptive clipping
    "composed_noise_multiplier": "keras_dpsgd.tools.adaptive_clipping",
    "adaptive_clipping_event": "keras_dpsgd.tools.adaptive_clipping",
    "calibrate_adaptive_noise_multiplier": "keras_dpsgd.tools.adaptive_clipping",
    "AdaptiveClippingMixin": "keras_dpsgd.tf_keras",
    "AdaptiveDPSGDOptimizer": "keras_dpsgd.tf_keras",
    "make_adaptive_optimizer": "keras_dpsgd.tf_keras",
    "initial_clip_bounds": "keras_dpsgd.step.clip_bounds",
    "initial_flat_clip_bound": "keras_dpsgd.step.clip_bounds",
    "ClipBoundsLogger": "keras_dpsgd.tf_keras",
    # large lots
    "scale_learning_rate": "keras_dpsgd.tools.large_lots",
    "plan_gradient_accumulation": "keras_dpsgd.tools.large_lots",
    "large_lot_table": "keras_dpsgd.tools.large_lots",
    "plot_noise_per_example": "keras_dpsgd.tools.large_lots",
    # hyperparameter tuning (Papernot & Steinke 2022)
    "tune": "keras_dpsgd.tools.tuning",
    "TuningResult": "keras_dpsgd.tools.tuning",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = _lazy.attach(__name__, _LAZY)

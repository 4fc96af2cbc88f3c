"""keras_dpsgd for tf_keras (Keras 2, ``import tf_keras``): every tf_keras-specific name, explicitly.

Code that names its Keras imports from here or from ``keras_dpsgd.keras3``.
The top-level ``keras_dpsgd.DPSGDOptimizer`` (and every other name listed in
``__all__`` here) is this module's when ``TF_USE_LEGACY_KERAS`` makes tf.keras
the legacy Keras, and ``keras_dpsgd.keras3``'s otherwise.
"""

import tf_keras as _tf_keras

from keras_dpsgd.tf_keras._train_step import make_private
from keras_dpsgd.callbacks import adopt_tf_keras_base
from keras_dpsgd.preprocessing.normalization import DPNormalization
from keras_dpsgd.tf_keras._optimizer import DPAdamOptimizer, DPSGDOptimizer, make_dp_optimizer
from keras_dpsgd.preprocessing.pca import DPPCA
from keras_dpsgd.tf_keras._adaptive import (
    AdaptiveClippingMixin,
    AdaptiveDPSGDOptimizer,
    ClipBoundsLogger,
    initial_clip_bounds,
    initial_flat_clip_bound,
    make_adaptive_optimizer,
)
from keras_dpsgd.preprocessing.vocabulary import accounted_layer_classes as _accounted_layer_classes

adopt_tf_keras_base()  # PrivacyLogger and WithinLimit: tf_keras callbacks too

# Registered for loading; made by DPVocabulary.apply_to, not public names.
_DPStringLookup, _DPTextVectorization = _accounted_layer_classes(_tf_keras)

__all__ = [
    "AdaptiveClippingMixin",
    "AdaptiveDPSGDOptimizer",
    "ClipBoundsLogger",
    "DPAdamOptimizer",
    "DPNormalization",
    "DPPCA",
    "DPSGDOptimizer",
    "initial_clip_bounds",
    "initial_flat_clip_bound",
    "make_adaptive_optimizer",
    "make_dp_optimizer",
    "make_private",
]

"""keras_dpsgd for tf_keras (Keras 2, ``import tf_keras``): every tf_keras-specific name, explicitly.

Code that names its Keras imports from here or from ``keras_dpsgd.keras3``.
The top-level ``keras_dpsgd.DPSGDOptimizer`` (and every other name listed in
``__all__`` here) is this module's when ``TF_USE_LEGACY_KERAS`` makes tf.keras
the legacy Keras, and ``keras_dpsgd.keras3``'s otherwise.
"""

from keras_dpsgd._which_keras import import_tf_keras

_tf_keras = import_tf_keras()  # first: without tf_keras, an ImportError that names the extra to install

from keras_dpsgd.tf_keras._train_step import install_build_before_the_trace, make_private  # noqa: E402

# Not in __all__: the one-call API asks it whether a model needs make_private (weight regularizers).
from keras_dpsgd.tf_keras._train_step import weight_regularization_terms  # noqa: E402, F401
from keras_dpsgd.preprocessing.normalization import DPNormalization  # noqa: E402
from keras_dpsgd.tf_keras._optimizer import DPAdamOptimizer, DPSGDOptimizer, make_dp_optimizer  # noqa: E402
from keras_dpsgd.preprocessing.pca import DPPCA  # noqa: E402
from keras_dpsgd.tf_keras._adaptive import (  # noqa: E402
    AdaptiveClippingMixin,
    AdaptiveDPSGDOptimizer,
    ClipBoundsLogger,
    initial_clip_bounds,
    initial_flat_clip_bound,
    make_adaptive_optimizer,
)
from keras_dpsgd.preprocessing.vocabulary import accounted_layer_classes as _accounted_layer_classes  # noqa: E402

from keras_dpsgd.preprocessing.feature_map import PublicFeatureMap as _PublicFeatureMap  # noqa: E402, F401

install_build_before_the_trace()  # a DP fit's step traced once (keras_dpsgd.step.prebuild)

# Registered for loading; made by DPVocabulary.apply_to (and the CLI's train --data), not public names.
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

"""keras_dpsgd for Keras 3 (``import keras``, TensorFlow backend).

Usage: a DP optimizer and one call that gives the model the private train step::

    model = keras_dpsgd.keras3.make_private(model)
    model.compile(optimizer=keras_dpsgd.keras3.DPSGDOptimizer(
                      l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=256)

The loss may be given reduced or not (the private step takes it unreduced). A model with its own
``train_step`` calls :func:`private_update` (or :func:`sanitized_gradients`) instead.
"""

from keras_dpsgd.keras3._adaptive import AdaptiveDPSGDOptimizer, ClipBoundsLogger, make_adaptive_optimizer
from keras_dpsgd.keras3._backup import BackupAndRestore
from keras_dpsgd.keras3._bandmf import BandMFAdamOptimizer, BandMFSGDOptimizer, make_bandmf_optimizer
from keras_dpsgd.keras3._audit import MembershipInferenceCallback
from keras_dpsgd.keras3._layers import DPNormalization, DPPCA
from keras_dpsgd.keras3._optimizer import DPAdamOptimizer, DPKeras3Mixin, DPSGDOptimizer, make_dp_optimizer
from keras_dpsgd.step.clip_bounds import initial_clip_bounds, initial_flat_clip_bound
from keras_dpsgd.keras3._loss import per_example_loss
from keras_dpsgd.keras3._refusals import refuse_adapted_preprocessing, refuse_example_mixing
from keras_dpsgd.keras3._train_step import is_private, make_private, private_update, sanitized_gradients
from keras_dpsgd.step import user_lots as _user_lots  # noqa: F401 (registers UserMeanLoss for loading)

__all__ = [
    "AdaptiveDPSGDOptimizer",
    "BackupAndRestore",
    "BandMFAdamOptimizer",
    "BandMFSGDOptimizer",
    "ClipBoundsLogger",
    "DPAdamOptimizer",
    "DPKeras3Mixin",
    "DPNormalization",
    "DPPCA",
    "DPSGDOptimizer",
    "initial_clip_bounds",
    "initial_flat_clip_bound",
    "is_private",
    "make_adaptive_optimizer",
    "make_bandmf_optimizer",
    "make_dp_optimizer",
    "make_private",
    "MembershipInferenceCallback",
    "per_example_loss",
    "private_update",
    "refuse_adapted_preprocessing",
    "refuse_example_mixing",
    "sanitized_gradients",
]

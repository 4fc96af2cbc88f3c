"""Weight regularization in tf_keras's own train step: the model-side part of the tf_keras DP step.

tf_keras's ``compile`` adds ``model.losses`` (``kernel_regularizer`` ...) to the compiled loss
inside ``compile_utils.LossesContainer``, which cannot add a scalar to a per-example loss (it
fails with "Shapes must be equal rank" before the optimizer is called). :func:`make_private`
gives a tf_keras model a ``compute_loss`` that keeps them apart: it returns the pair
``(per-example data loss, weight regularization)``, and the DP optimizer adds the
regularization's exact gradient to the sanitized gradient, un-clipped and un-noised (a function
of the weights only: post-processing). ``add_loss`` terms that are tensors (activity
regularizers, losses of the data) are refused, as on Keras 3: their gradient would need clipping
and noise. tf_keras gives a DP optimizer no hook before ``compute_loss`` runs, so a model with
weight regularizers needs this call; other tf_keras models do not.
"""

from __future__ import annotations

import types

import tensorflow as tf
import tf_keras

from keras_dpsgd.step._loss import refuse_data_losses, regularization_sum

__all__ = ["make_private", "weight_regularization_terms"]


def weight_regularization_terms(model: tf_keras.Model) -> list:
    """The zero-argument loss callables of `model`'s layers (weight regularizers, ``add_loss(fn)``)."""
    return [fn for layer in model._flatten_layers(include_self=True, recursive=True) for fn in layer._callable_losses]


class _WeightRegularization:
    """Σ of the weight regularization terms, as a callable the sanitizer differentiates on its own tape."""

    def __init__(self, terms: list):
        self._terms = list(terms)

    def __call__(self) -> tf.Tensor:
        return regularization_sum([v for v in (fn() for fn in self._terms) if v is not None])


def _private_compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
    """The per-example data loss and, apart, the weight regularization (module docstring)."""
    del x
    data_loss = self.compiled_loss(y, y_pred, sample_weight, regularization_losses=None)
    terms = weight_regularization_terms(self)
    refuse_data_losses(len(self.losses), len(terms), own_step="train step")
    if not terms or data_loss is None:
        return data_loss
    return data_loss, _WeightRegularization(terms)


def make_private(model: tf_keras.Model) -> tf_keras.Model:
    """Gives a tf_keras model the private ``compute_loss`` (weight regularizers kept apart).

    Needed only for models with weight regularizers (or ``add_loss`` of a function of the
    weights); the DP settings stay on the tf_keras DP optimizer. The model is changed in place
    (its instance's ``compute_loss``) and returned.

    Raises:
      TypeError: `model` is not a tf_keras model (Keras 3 models: ``keras_dpsgd.keras3.make_private``).
      ValueError: the model overrides ``compute_loss`` itself.
    """
    if not isinstance(model, tf_keras.Model):
        raise TypeError(
            f"this make_private is for tf_keras models, got {type(model).__name__}; a Keras 3 model "
            "needs keras_dpsgd.keras3.make_private"
        )
    if type(model).compute_loss is not tf_keras.Model.compute_loss:
        raise ValueError(
            f"make_private cannot make {type(model).__name__} private: it overrides compute_loss. Return "
            "(per_example_loss, regularization_fn) from it, where regularization_fn() computes the weight "
            "regularization; the DP optimizer adds its gradient un-noised."
        )
    model.compute_loss = types.MethodType(_private_compute_loss, model)
    model.train_function = None  # Retraced with the private compute_loss.
    return model

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

Augmentation multiplicity (``make_private(model, augmentation=..., augmentation_multiplicity=K)``)
also gives the model a ``train_step``: tf_keras's own, on the K views of each example
(``keras_dpsgd.step.augment``), with the per-example loss the mean of the views' losses.

Every tf_keras model's ``make_train_function`` (which ``fit`` calls before its first step) first builds a
DP optimizer, so that the step is traced once (``keras_dpsgd.step.prebuild``): tf_keras gives a DP
optimizer no other hook before the trace. Models with another optimizer are untouched.
"""

from __future__ import annotations

import functools
import types

import tensorflow as tf
import tf_keras

from keras_dpsgd.step import display as _display, distribute as _distribute
from keras_dpsgd.step.augment import Augmentation, check_augmentation
from keras_dpsgd.step.loss import refuse_data_losses, regularization_sum
from keras_dpsgd.step.prebuild import build_before_the_trace
from keras_dpsgd.dp.refusals import refuse

__all__ = ["make_private", "weight_regularization_terms", "install_build_before_the_trace"]

_AUGMENTATION_ATTR = "_keras_dpsgd_augmentation"


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


def _call_in_training(augmentation, x):
    """One view: a tf_keras layer called in training mode (its random transforms on), else `augmentation(x)`."""
    if isinstance(augmentation, tf_keras.layers.Layer):
        return augmentation(x, training=True)
    return augmentation(x)


def _augmented_train_step(self, data):
    """tf_keras's ``train_step`` on the K views of each example (module docstring)."""
    views = vars(self)[_AUGMENTATION_ATTR]
    x, y, sample_weight = tf_keras.utils.unpack_x_y_sample_weight(data)
    x, y, sample_weight = views.views(x), views.repeat(y), views.repeat(sample_weight)
    with tf.GradientTape() as tape:
        y_pred = self(x, training=True)
        loss = self.compute_loss(x, y, y_pred, sample_weight)  # one value per view
        pair = isinstance(loss, tuple)
        view_loss = loss[0] if pair else loss
        example_loss = views.mean_over_views(view_loss)  # ℓ_i = mean_k ℓ_ik
    self._validate_target_and_loss(y, view_loss)
    self.optimizer.minimize((example_loss, loss[1]) if pair else example_loss, self.trainable_variables, tape=tape)
    if _distribute.num_replicas() == 1:  # the logged loss: the mean over the real views (as the DP step's)
        per_view = tf.convert_to_tensor(view_loss)
        if per_view.shape.rank and per_view.shape.rank > 1:
            per_view = tf.reduce_mean(per_view, axis=list(range(1, per_view.shape.rank)))
        _display.install_tf_keras(self, view_loss, per_view)
    return self.compute_metrics(x, y, y_pred, sample_weight)


def make_private(model: tf_keras.Model, *, augmentation=None, augmentation_multiplicity: int = 1) -> tf_keras.Model:
    """Gives a tf_keras model the private ``compute_loss`` (weight regularizers kept apart), and with
    augmentation the ``train_step`` on K views of each example.

    Needed only for models with weight regularizers (or ``add_loss`` of a function of the
    weights) or augmentation multiplicity; the DP settings stay on the tf_keras DP optimizer. The
    model is changed in place (its instance's ``compute_loss``, and ``train_step`` with
    augmentation) and returned.

    Args:
      model: the tf_keras model.
      augmentation: a tf_keras layer (called with ``training=True``) or a callable
        ``x -> augmented x``, called once per view inside the train step; None: each view is the
        batch itself, made to differ by the model's own random layers, if any.
      augmentation_multiplicity: K in [1, 256] views per example (De et al. 2022), averaged into
        one per-example loss, so one gradient per example is clipped: the sensitivity and the
        ledger are those of the step without augmentation (``keras_dpsgd.step.augment``).

    Raises:
      TypeError: `model` is not a tf_keras model (Keras 3 models: ``keras_dpsgd.keras3.make_private``);
        `augmentation` is not callable.
      ValueError: the model overrides ``compute_loss`` itself (or ``train_step``, with augmentation);
        `augmentation_multiplicity` is not an integer in [1, 256].
    """
    if not isinstance(model, tf_keras.Model):
        raise TypeError(
            f"this make_private is for tf_keras models, got {type(model).__name__}; a Keras 3 model "
            "needs keras_dpsgd.keras3.make_private"
        )
    augmentation, multiplicity = check_augmentation(augmentation, augmentation_multiplicity)
    views = Augmentation(augmentation, multiplicity, _call_in_training)
    if type(model).compute_loss is not tf_keras.Model.compute_loss:
        raise refuse(
            "own-loss-hook",
            f"make_private cannot make {type(model).__name__} private: it overrides compute_loss. Return "
            "(per_example_loss, regularization_fn) from it, where regularization_fn() computes the weight "
            "regularization; the DP optimizer adds its gradient un-noised.",
        )
    if views.active and type(model).train_step is not tf_keras.Model.train_step:
        raise refuse(
            "augmentation-not-applied",
            f"make_private cannot give {type(model).__name__} augmentation multiplicity: it overrides train_step, "
            "which would ignore the views. In your own train_step, average the loss of each example's views "
            "into one per-example loss before calling optimizer.minimize.",
        )
    model.compute_loss = types.MethodType(_private_compute_loss, model)
    if views.active:
        object.__setattr__(model, _AUGMENTATION_ATTR, views)  # untracked by tf_keras (never saved)
        model.train_step = types.MethodType(_augmented_train_step, model)
    else:
        vars(model).pop(_AUGMENTATION_ATTR, None)
        if getattr(vars(model).get("train_step"), "__func__", None) is _augmented_train_step:
            del vars(model)["train_step"]  # an earlier make_private's augmentation, undone
    model.train_function = None  # Retraced with the private compute_loss.
    return model


def install_build_before_the_trace() -> None:
    """``tf_keras.Model.make_train_function`` builds a DP optimizer first (module docstring); installed once."""
    make = tf_keras.Model.make_train_function
    if getattr(make, "_keras_dpsgd_builds_first", False):
        return

    @functools.wraps(make)
    def make_train_function(self, force=False):
        if force or self.train_function is None:  # the step is about to be traced
            build_before_the_trace(
                self,
                strategy=self._distribution_strategy,
                own_train_steps=(tf_keras.Model.train_step, _augmented_train_step),
            )
        return make(self, force)

    make_train_function._keras_dpsgd_builds_first = True
    tf_keras.Model.make_train_function = make_train_function

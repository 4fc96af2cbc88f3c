"""What the Keras 3 private step refuses in a model: layers that mix the examples of a batch, and
preprocessing state fitted on the data outside the privacy ledger (TensorFlow and JAX steps alike)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_dpsgd.preprocessing.normalization import refuse_fitted_layers
from keras_dpsgd.backends.tensorflow import mixing as _mixing

__all__ = ["refuse_example_mixing", "refuse_adapted_preprocessing"]


def refuse_example_mixing(model: keras.Model, loss: tf.Tensor | None = None) -> None:
    """Raises ValueError if a layer of `model` mixes the examples of a batch in the step of `loss`.

    With BatchNormalization in training mode one example changes every other example's output
    (batch statistics), so clipping each example's gradient no longer bounds its influence. A frozen
    ``keras.layers.BatchNormalization`` (``trainable = False``: inference mode) or a subclass is
    accepted when the traced step of `loss` (the per-example loss) proves it: no write to its moving
    statistics, no batch statistics upstream of the loss (``keras_dpsgd.backends.tensorflow.mixing``). Without `loss`
    nothing is proven and every BatchNormalization layer is refused; a layer whose
    ``mixes_examples`` attribute is true always is.
    """
    layers = model._flatten_layers(include_self=True, recursive=True)
    _mixing.refuse_example_mixing(layers, loss, lambda layer: isinstance(layer, keras.layers.BatchNormalization))


def _fitted_state(layer: Any) -> str | None:
    """What state fitted on data a Keras 3 preprocessing layer holds ("a vocabulary", ...), or None."""
    from keras.src.layers.preprocessing.index_lookup import IndexLookup

    with tf.init_scope():  # the check runs while Keras traces train_step
        if isinstance(layer, keras.layers.Normalization):
            if layer.input_mean is not None or not layer.built:
                return None  # built from given mean/variance (or nothing yet)
            fitted = np.any(layer.adapt_mean.numpy() != 0) or np.any(layer.adapt_variance.numpy() != 1)
            return "a mean and variance" if fitted else None
        if isinstance(layer, keras.layers.TextVectorization):
            layer = layer._lookup_layer
        if isinstance(layer, IndexLookup):
            if getattr(layer, "_has_input_vocabulary", False):
                return None  # vocabulary given at construction
            return "a vocabulary" if len(layer.get_vocabulary(include_special_tokens=False)) > 0 else None
        if isinstance(layer, keras.layers.Discretization):
            # Boundaries given at construction leave num_bins None; adapt computes them from the data.
            return "bin boundaries" if layer.num_bins is not None and layer.bin_boundaries else None
    return None


def refuse_adapted_preprocessing(model: keras.Model) -> None:
    """Raises ValueError if a Keras 3 preprocessing layer of `model` holds state fitted on data.

    Normalization (mean, variance), StringLookup / IntegerLookup / TextVectorization (vocabulary) and
    Discretization (bin boundaries) adapted on the data would publish those exact statistics with the
    model, outside the privacy ledger. Passes layers built from given statistics, layers marked with
    ``keras_dpsgd.mark_public`` and layers that record their own privacy events.
    """
    refuse_fitted_layers(model._flatten_layers(include_self=False, recursive=True), _fitted_state)

"""The compiled loss per example on JAX (``keras_dpsgd.keras3.per_example_loss``'s rule, on ``jax.numpy``).

The outputs, their losses taken unreduced and their ``loss_weights`` are read by the Keras 3 front
end (``keras3._loss._outputs``); here each output's values are averaged over the example's
non-batch axes, over its unmasked elements only where the output carries a Keras mask
(``Σ_t m_it ℓ_it / max(1, Σ_t m_it)``), and the weighted outputs added.

The loss runs where the model's variables read the step's values (:func:`per_example_loss_at`, as Keras's
``stateless_compute_loss`` does): a compiled loss may read the weights (``lambda yt, yp: ce(yt, yp) +
0.1 * ops.sum(kernel**2)``), and that term is then part of each example's loss, differentiated and clipped
with it, as on TensorFlow (where the tape sees the same read).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.stateless_scope import StatelessScope

__all__ = ["per_example_loss", "per_example_loss_at"]


def _values(identifier: Any, y: Any, y_pred: Any, sample_weight: Any):
    from keras_dpsgd.keras3._loss import _unreduced, per_example_weight, scalar_loss

    mask = get_keras_mask(y_pred)
    if mask is not None:
        y_pred = y_pred * 1  # the same values without the mask: applied once, below
    loss_fn = _unreduced(identifier)
    values = jnp.asarray(loss_fn(y, y_pred))
    if values.ndim == 0:
        raise scalar_loss(loss_fn)
    if sample_weight is not None:
        values = values * per_example_weight(jnp.asarray(sample_weight).astype(values.dtype), values.ndim)
    if values.ndim == 1:
        return values
    axes = tuple(range(1, values.ndim))
    if mask is None:
        return jnp.mean(values, axis=axes)
    mask = jnp.asarray(mask).astype(values.dtype)
    mask = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (values.ndim - mask.ndim)), values.shape)
    return jnp.sum(values * mask, axis=axes) / jnp.maximum(jnp.sum(mask, axis=axes), 1.0)


def per_example_loss(model: Any, y: Any, y_pred: Any, sample_weight: Any = None):
    """[B] the compiled loss of each example (``keras_dpsgd.keras3.per_example_loss``)."""
    from keras_dpsgd.keras3._loss import _outputs

    total = None
    for fn, weight, target, pred, weighting in _outputs(model, y, y_pred, sample_weight):
        values = _values(fn, target, pred, weighting)
        values = values if weight == 1.0 else values * weight
        total = values if total is None else total + values.astype(total.dtype)
    return total


def per_example_loss_at(model: Any, trainable: Any, non_trainable: Any, y: Any, y_pred: Any, sample_weight: Any = None):
    """[B] :func:`per_example_loss` with the model's variables reading `trainable` and `non_trainable`.

    Under JAX's ``fit`` the variables hold no values (the step is stateless), so a loss that reads a
    weight must run in the scope that maps them, and reads the traced values its gradient flows to.
    """
    mapping = list(zip(model.trainable_variables, trainable)) + list(zip(model.non_trainable_variables, non_trainable))
    with StatelessScope(state_mapping=mapping):
        return per_example_loss(model, y, y_pred, sample_weight)


def build_compiled_loss(model: Any, lots: Any) -> None:
    """Builds Keras's compiled loss from the spec of a lots dataset, without its sample weight.

    Keras's JAX ``fit`` builds the compiled loss symbolically on the first batch, sample weight included, and
    Keras broadcasts a ``[B]`` weight against a token-level ``[B, T]`` loss along the token axis (it fails). The
    private step never reads that loss (:func:`per_example_loss` applies the weight example by example), so it is
    built here, before ``fit``, on the lots' ``x`` and ``y`` alone.
    """
    import keras
    from keras.src.backend import compute_output_spec

    compile_loss = getattr(model, "_compile_loss", None)
    spec = getattr(lots, "element_spec", None)
    if compile_loss is None or compile_loss.built or not isinstance(spec, tuple) or len(spec) != 3:
        return

    def symbolic(s):
        return keras.KerasTensor(tuple(s.shape), keras.backend.standardize_dtype(s.dtype.name))

    x, y = keras.tree.map_structure(symbolic, spec[:2])
    y_pred = compute_output_spec(model, x, training=False)
    compute_output_spec(model._compute_loss, x, y, y_pred, sample_weight=None, training=False)

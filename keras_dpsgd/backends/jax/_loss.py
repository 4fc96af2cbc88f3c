"""The compiled loss per example on JAX (``keras_dpsgd.keras3.per_example_loss``'s rule, on ``jax.numpy``).

The outputs, their losses taken unreduced and their ``loss_weights`` are read by the Keras 3 front
end (``keras3._loss._outputs``); here each output's values are averaged over the example's
non-batch axes, over its unmasked elements only where the output carries a Keras mask
(``Σ_t m_it ℓ_it / max(1, Σ_t m_it)``), and the weighted outputs added.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from keras.src.backend.common.masking import get_keras_mask

__all__ = ["per_example_loss"]


def _values(identifier: Any, y: Any, y_pred: Any, sample_weight: Any):
    from keras_dpsgd.keras3._loss import _unreduced

    mask = get_keras_mask(y_pred)
    if mask is not None:
        y_pred = y_pred * 1  # the same values without the mask: applied once, below
    loss_fn = _unreduced(identifier)
    values = jnp.asarray(loss_fn(y, y_pred, sample_weight))
    if values.ndim == 0:
        raise ValueError(f"the loss {loss_fn.name} returned a scalar with reduction=None; it must be per example")
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

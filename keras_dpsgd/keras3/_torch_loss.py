"""The compiled loss per example on torch (``keras_dpsgd.keras3.per_example_loss``'s rule, on ``keras.ops``).

The outputs, their losses taken unreduced and their ``loss_weights`` are read as on the other backends
(``keras3._loss._outputs``); each output's values are averaged over the example's non-batch axes, over its
unmasked elements only where the output carries a Keras mask (``Σ_t m_it ℓ_it / max(1, Σ_t m_it)``), and the
weighted outputs added. The loss runs where the model's variables read the step's values
(:func:`per_example_loss_at`), so a compiled loss that reads a weight is differentiated and clipped with it.
"""

from __future__ import annotations

from typing import Any

from keras import ops
from keras.src.backend.common.masking import get_keras_mask
from keras.src.backend.common.stateless_scope import StatelessScope

from keras_dpsgd.keras3._loss import _outputs, _unreduced, per_example_weight, scalar_loss

__all__ = ["per_example_loss", "per_example_loss_at"]


def _values(identifier: Any, y: Any, y_pred: Any, sample_weight: Any):
    mask = get_keras_mask(y_pred)
    if mask is not None:
        y_pred = y_pred * 1  # the same values without the mask: applied once, below
    loss_fn = _unreduced(identifier)
    values = ops.convert_to_tensor(loss_fn(y, y_pred))
    if len(values.shape) == 0:
        raise scalar_loss(loss_fn)
    if sample_weight is not None:
        values = values * per_example_weight(ops.cast(sample_weight, values.dtype), len(values.shape))
    if len(values.shape) == 1:
        return values
    axes = tuple(range(1, len(values.shape)))
    if mask is None:
        return ops.mean(values, axis=axes)
    mask = ops.cast(mask, values.dtype)
    mask = ops.broadcast_to(
        ops.reshape(mask, tuple(mask.shape) + (1,) * (len(values.shape) - len(mask.shape))), values.shape
    )
    return ops.sum(values * mask, axis=axes) / ops.maximum(ops.sum(mask, axis=axes), 1.0)


def per_example_loss(model: Any, y: Any, y_pred: Any, sample_weight: Any = None):
    """[B] the compiled loss of each example (``keras_dpsgd.keras3.per_example_loss``)."""
    total = None
    for fn, weight, target, pred, weighting in _outputs(model, y, y_pred, sample_weight):
        values = _values(fn, target, pred, weighting)
        values = values if weight == 1.0 else values * weight
        total = values if total is None else total + ops.cast(values, total.dtype)
    return total


def per_example_loss_at(model: Any, trainable: Any, non_trainable: Any, y: Any, y_pred: Any, sample_weight: Any = None):
    """[B] :func:`per_example_loss` with the model's variables reading `trainable` and `non_trainable`."""
    mapping = list(zip(model.trainable_variables, trainable)) + list(zip(model.non_trainable_variables, non_trainable))
    with StatelessScope(state_mapping=mapping):
        return per_example_loss(model, y, y_pred, sample_weight)

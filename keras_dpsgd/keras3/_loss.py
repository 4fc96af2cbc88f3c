"""The compiled loss of a Keras 3 model, one value per example (TensorFlow; JAX: ``keras3._jax_loss``).

Keras 3's compiled loss reduces over the batch. The private train step (``keras_dpsgd.keras3._train_step``)
needs one loss per example: :func:`per_example_loss` reads the model's outputs, their compiled losses
(rebuilt with reduction None) and ``loss_weights`` (:func:`_outputs`, shared with the JAX backend), and
averages each output's values over the example's own (unmasked) elements. :func:`weight_regularization`
is the data-independent part of the loss (the weight regularizers), added un-clipped and un-noised.
"""

from __future__ import annotations

import math
from typing import Any

import keras
import tensorflow as tf

from keras_dpsgd import _validate
from keras_dpsgd.step.loss import regularization_sum
from keras_dpsgd.dp.refusals import refuse

__all__ = ["per_example_loss", "scalar_loss", "weight_regularization"]


class _FunctionLoss(keras.losses.Loss):
    """A loss function as a Keras Loss with reduction None (Keras applies weights and casts)."""

    def __init__(self, fn):
        name = getattr(fn, "__name__", "loss")
        # A lambda's "<lambda>" is no valid name scope on TensorFlow.
        super().__init__(name=name if name.isidentifier() else "loss", reduction=None)
        self._fn = fn

    def call(self, y_true, y_pred):
        return self._fn(y_true, y_pred)


def scalar_loss(loss_fn: Any) -> ValueError:
    """The refusal of a loss that returned one value for the whole batch with reduction=None (every backend)."""
    return refuse(
        "loss-entries", f"the loss {loss_fn.name} returned a scalar with reduction=None; it must be per example"
    )


def _unreduced(identifier: Any) -> keras.losses.Loss:
    """The compiled loss with reduction None (per-element values times the sample weights)."""
    if isinstance(identifier, str) and identifier.lower() in ("crossentropy", "ce"):
        raise refuse(
            "crossentropy-from-data",
            f"loss={identifier!r} is resolved by Keras from the data; name the loss instead, e.g. "
            "loss='sparse_categorical_crossentropy'",
        )
    loss = keras.losses.get(identifier)
    if isinstance(loss, keras.losses.Loss):
        config = dict(loss.get_config(), reduction=None)
        try:
            return type(loss).from_config(config)
        except Exception as err:  # A custom Loss without a faithful config: refuse, never guess.
            raise refuse(
                "per-example-loss-unknown",
                f"cannot rebuild the loss {type(loss).__name__} with reduction=None from its get_config() "
                f"({err}); give the per-example loss as a function loss(y_true, y_pred) -> [batch]",
            ) from err
    if callable(loss):
        return _FunctionLoss(loss)
    raise refuse("per-example-loss-unknown", f"cannot interpret the compiled loss {identifier!r} as a per-example loss")


def _compiled_loss(model: keras.Model) -> Any:
    loss = getattr(model, "loss", None)
    if loss is None:
        raise ValueError("a private train step needs a compiled loss: model.compile(optimizer=..., loss=...)")
    return loss


def _names(model: keras.Model, y_pred: Any, count: int) -> list:
    """The key of each output: its dict key, else its name in ``model.output_names``, else its index."""
    if isinstance(y_pred, dict):
        return list(y_pred)
    names = list(getattr(model, "output_names", None) or [])
    return names if len(names) == count else list(range(count))


def _pick(value: Any, name: Any, index: int, count: int, what: str) -> Any:
    """The part of a per-output argument (loss, loss_weights, y, sample_weight) for one output."""
    if isinstance(value, dict):
        return value.get(name)
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise refuse("multi-output-mismatch", f"{what} has {len(value)} entries for the model's {count} outputs")
        return value[index]
    return value


def _outputs(model: keras.Model, y: Any, y_pred: Any, sample_weight: Any) -> list[tuple]:
    """(loss, weight, y_true, y_pred, sample_weight) of each output that has a loss."""
    if isinstance(y_pred, dict):
        preds = list(y_pred.values())
    elif isinstance(y_pred, (list, tuple)):
        preds = list(y_pred)
    else:
        preds = [y_pred]
    count = len(preds)
    names = _names(model, y_pred, count)
    loss = _compiled_loss(model)
    weights = getattr(getattr(model, "_compile_loss", None), "_user_loss_weights", None)
    if count == 1:  # One output: a one-entry list or dict names it.
        loss, weights = (_only(v) for v in (loss, weights))
        y = _only(y) if tf.nest.is_nested(y) else y
        sample_weight = _only(sample_weight) if isinstance(sample_weight, (list, tuple, dict)) else sample_weight
    outputs = []
    for i, (name, pred) in enumerate(zip(names, preds)):
        fn = _pick(loss, name, i, count, "loss")
        if fn is None:
            continue  # Keras trains an output without a loss on nothing.
        weight = _pick(weights, name, i, count, "loss_weights")
        if weight is not None:
            weight = _validate.in_range(-math.inf, math.inf, "()", **{f"loss_weights[{name!r}]": weight})
        target = y if count == 1 else _pick(y, name, i, count, "y")
        weighting = sample_weight if count == 1 else _pick(sample_weight, name, i, count, "sample_weight")
        outputs.append((fn, 1.0 if weight is None else float(weight), target, pred, weighting))
    if not outputs:
        raise refuse("multi-output-mismatch", f"the compiled loss {loss!r} names none of the model's outputs {names}")
    return outputs


def _only(value: Any) -> Any:
    if isinstance(value, dict):
        return next(iter(value.values())) if len(value) == 1 else value
    if isinstance(value, (list, tuple)):
        return value[0] if len(value) == 1 else value
    return value


def _per_example_values(identifier: Any, y: Any, y_pred: Any, sample_weight: Any) -> tf.Tensor:
    """One output's loss per example [B]: the mean over its non-batch (unmasked) elements."""
    mask = getattr(y_pred, "_keras_mask", None)
    if mask is not None:
        y_pred = tf.identity(y_pred)  # The same values without the mask: it is applied once, below.
    loss_fn = _unreduced(identifier)
    values = tf.convert_to_tensor(loss_fn(y, y_pred))
    if values.shape.rank == 0:
        raise scalar_loss(loss_fn)
    if sample_weight is not None:
        values = values * per_example_weight(tf.cast(sample_weight, values.dtype), values.shape.rank)
    if values.shape.rank == 1:
        return values
    axes = list(range(1, values.shape.rank))
    if mask is None:
        return tf.reduce_mean(values, axis=axes)
    mask = tf.cast(mask, values.dtype)
    while mask.shape.rank < values.shape.rank:
        mask = mask[..., None]
    mask = tf.broadcast_to(mask, tf.shape(values))
    return tf.reduce_sum(values * mask, axis=axes) / tf.maximum(tf.reduce_sum(mask, axis=axes), 1.0)


def per_example_weight(weight: Any, rank: int) -> Any:
    """A sample weight shaped to multiply loss values of rank `rank` example by example.

    A weight of one value per example (``[B]``, as ``PoissonLots`` gives) against token-level values
    (``[B, T]``: a causal LM, seq2seq, tagging) takes trailing axes of size 1 (``[B, 1]``), so it scales
    the example's own tokens; broadcast as is, it would pair example ``j``'s weight with token ``j`` of
    every example. A weight of the values' rank (per token) is used as is. Written over ``.shape`` and
    indexing only, so it serves TensorFlow tensors and JAX arrays alike.
    """
    for _ in range(len(weight.shape), rank):
        weight = weight[..., None]
    return weight


def per_example_loss(model: keras.Model, y: Any, y_pred: Any, sample_weight: Any = None) -> tf.Tensor:
    """The compiled loss of `model`, one value per example ([B]).

    For each output with a loss: the loss of each element (reduction None), times the sample
    weight; averaged over the example's non-batch axes (e.g. time steps), and where the output
    carries a Keras mask (``Embedding(mask_zero=True)`` ...) over the example's unmasked
    elements only: ``Σ_t m_it ℓ_it / max(1, Σ_t m_it)`` (an example with every element masked
    has loss 0). The normalization is per example, never over the batch (Keras's own masked
    reduction divides by the batch's count of unmasked elements, which would make one example's
    loss depend on the others). Several outputs: ``Σ_o w_o ℓ_o(i)`` with the compiled
    ``loss_weights`` w_o (default 1); `loss`, `loss_weights`, `y` and `sample_weight` may be
    lists (output order) or dicts (output names), as in Keras.

    Raises:
      ValueError: a loss or weight that does not match the outputs, or a loss that cannot be
        taken unreduced.
    """
    outputs = _outputs(model, y, y_pred, sample_weight)
    total = None
    for fn, weight, target, pred, weighting in outputs:
        values = _per_example_values(fn, target, pred, weighting)
        values = values if weight == 1.0 else values * tf.cast(weight, values.dtype)
        total = values if total is None else total + tf.cast(values, total.dtype)
    return total


def weight_regularization(model: keras.Model) -> tf.Tensor | None:
    """Σ of the weight regularizers (``variable.regularizer(variable)``): data-independent, or None."""
    terms = [v.regularizer(v) for v in model.trainable_weights if getattr(v, "regularizer", None) is not None]
    return regularization_sum(terms) if terms else None

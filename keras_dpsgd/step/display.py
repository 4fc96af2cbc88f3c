"""What the progress bar, History and TensorBoard show of a DP step: means over the real examples.

Poisson lots (:mod:`keras_dpsgd.step.lots`) are padded to a fixed shape with rows of
``sample_weight`` 0. Keras divides the logged loss by the batch's rows and feeds ``metrics=``
(unweighted) every row, so padding pulled the shown loss and accuracy toward the padding's
values. Here a row is *real* when any of its sample weights is non-zero; the logged loss is
Σ_i w_i ℓ_i over the real rows divided by their number (Keras's own value when no weight is 0),
and the compiled metrics, weighted or not, see the real rows only. None of this touches the
DP gradient, which weights every row by its sample weight as before.

Both front ends use these helpers: the Keras 3 private train step directly, tf_keras through
the ``compute_metrics`` that the DP optimizer gives the model it trains (:func:`install_tf_keras`;
not under several replicas, where tf_keras's own values are logged).
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

__all__ = ["install_tf_keras", "real_mean", "real_rows", "real_rows_only"]


def real_rows(sample_weight: Any) -> Optional[tf.Tensor]:
    """[B] bool: the rows with a non-zero sample weight (in any output), or None without weights."""
    leaves = [w for w in tf.nest.flatten(sample_weight) if w is not None]
    if not leaves:
        return None
    rows = None
    for w in leaves:
        w = tf.convert_to_tensor(w)
        nonzero = tf.not_equal(w, tf.zeros_like(w))
        if w.shape.rank and w.shape.rank > 1:
            nonzero = tf.reduce_any(nonzero, axis=list(range(1, w.shape.rank)))
        rows = nonzero if rows is None else tf.logical_or(rows, nonzero)
    return rows


def real_rows_only(structure: Any, rows: tf.Tensor) -> Any:
    """`structure` (y, y_pred or sample_weight) with the rows of `rows` only; Keras masks kept."""

    def take(value):
        if value is None:
            return None
        value = tf.convert_to_tensor(value)
        out = tf.boolean_mask(value, rows)
        mask = getattr(value, "_keras_mask", None)
        if mask is not None:
            out._keras_mask = tf.boolean_mask(mask, rows)
        return out

    return tf.nest.map_structure(take, structure)


def real_mean(per_example_loss: tf.Tensor, rows: Optional[tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
    """(Σ ℓ_i over the real rows / their number, that number as a float): a batch's logged loss
    and its weight in the epoch's mean (0 for an empty lot, whose value is then 0)."""
    loss = tf.cast(per_example_loss, tf.float32)
    if rows is None:
        count = tf.cast(tf.shape(loss)[0], tf.float32)
    else:
        count = tf.reduce_sum(tf.cast(rows, tf.float32))
        loss = tf.where(rows, loss, tf.zeros_like(loss))
    return tf.math.divide_no_nan(tf.reduce_sum(loss), count), count


class _TfKerasMetrics:
    """The ``compute_metrics`` of a tf_keras model trained by a DP optimizer (module docstring).

    The compiled metrics see the real rows only. The logged ``loss`` is tf_keras's own mean of the
    compiled loss (``compiled_loss.metrics[0]``), which ``compute_loss`` has just updated with every
    row of the batch, each weighted by the batch size B (``Mean.update_state(values,
    sample_weight=B)``): that update is corrected here to the sum over the real rows and their
    number, so the epoch's value is Σ ℓ_i / (number of real rows), while the metric's name, its
    place in ``model.metrics`` and ``evaluate`` stay Keras's.
    """

    def __init__(self, model: Any):
        self._model = model
        self.loss: Optional[tuple] = None  # (loss as compute_loss returned it, per-example loss) of this trace

    def _correct_loss(self, taken: tuple, rows: Optional[tf.Tensor]) -> None:
        compiled = getattr(self._model, "compiled_loss", None)
        tracker = compiled.metrics[0] if compiled is not None and compiled.metrics else None
        if rows is None or tracker is None or not hasattr(tracker, "total") or not hasattr(tracker, "count"):
            return
        raw, per_example = (tf.cast(t, tracker.total.dtype) for t in taken)
        batch = tf.cast(tf.shape(raw)[0], raw.dtype)
        value, count = real_mean(per_example, rows)
        tracker.total.assign_add(value * count - batch * tf.reduce_sum(raw))
        tracker.count.assign_add(tf.cast(count - batch * tf.cast(tf.size(raw), tf.float32), tracker.count.dtype))

    def __call__(self, x=None, y=None, y_pred=None, sample_weight=None):
        model = self._model
        rows = real_rows(sample_weight)
        taken, self.loss = self.loss, None  # this trace's loss, used once (never in another graph)
        if taken is not None:
            self._correct_loss(taken, rows)
        if rows is not None:
            y, y_pred, sample_weight = (real_rows_only(s, rows) for s in (y, y_pred, sample_weight))
        return type(model).compute_metrics(model, x, y, y_pred, sample_weight)


def install_tf_keras(model: Any, loss: tf.Tensor, per_example_loss: tf.Tensor) -> None:
    """At trace time, from the tf_keras DP step: `model`'s logged loss and metrics over real rows.

    `loss`: the data loss as ``compute_loss`` returned it; `per_example_loss`: its value per
    example. tf_keras calls ``compute_metrics`` after the optimizer's step in the same traced train
    step, so the instance attribute set here serves this trace.
    """
    if model is None:
        return
    metrics = vars(model).get("compute_metrics")
    if not isinstance(metrics, _TfKerasMetrics):
        metrics = _TfKerasMetrics(model)
        object.__setattr__(model, "compute_metrics", metrics)
    metrics.loss = (loss, per_example_loss)

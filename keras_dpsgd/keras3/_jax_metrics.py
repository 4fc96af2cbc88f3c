"""The logged loss and Keras's metrics of the JAX private step: the real rows only (Poisson lots' padding excluded).

A row is real where some sample weight is nonzero (``keras_dpsgd.step.display``'s rule, TensorFlow's
side): the padding rows of ``PoissonLots`` batches have weight 0. TensorFlow drops the other rows
before the metrics; JAX's shapes are static, so here the logged loss is the mean over the real rows
and Keras's unweighted compiled metrics get weight 0 on the others (the same means).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import keras

__all__ = ["real_rows", "real_mean", "unweighted_metrics_on_real_rows"]


def real_rows(sample_weight):
    """bool [B]: the rows with a nonzero sample weight, None without weights (``_display.real_rows``'s rule)."""
    rows = None
    for w in keras.tree.flatten(sample_weight):
        if w is None:
            continue
        nonzero = jnp.asarray(w) != 0
        if nonzero.ndim > 1:
            nonzero = jnp.any(nonzero.reshape(nonzero.shape[0], -1), axis=1)
        rows = nonzero if rows is None else rows | nonzero
    return rows


def real_mean(losses, sample_weight):
    """(Σ ℓ_i over the real rows / their number, that number): ``keras_dpsgd.step.display.real_mean``'s rule."""
    rows = real_rows(sample_weight)
    losses = losses.astype(jnp.float32)
    if rows is None:
        count = jnp.float32(losses.shape[0])
        return jnp.where(count > 0, jnp.sum(losses) / jnp.maximum(count, 1.0), 0.0), count
    count = jnp.sum(rows.astype(jnp.float32))
    total = jnp.sum(jnp.where(rows, losses, 0.0))
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0), count


class _OnRealRows:
    """A compiled unweighted metric (``compile(metrics=...)``) updated with weight 1 on the real rows, 0 elsewhere."""

    def __init__(self, metrics: Any, rows: jax.Array):
        self._metrics, self._rows = metrics, rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metrics, name)

    def update_state(self, y_true, y_pred, sample_weight=None):
        return self._metrics.update_state(y_true, y_pred, sample_weight=self._rows)


@contextlib.contextmanager
def unweighted_metrics_on_real_rows(model: keras.Model, y, y_pred, sample_weight):
    """Keras's unweighted compiled metrics count the real rows only (the padding of Poisson lots excluded).

    TensorFlow drops the padding rows before ``compute_metrics`` (``keras3._train_step``); JAX's
    shapes are static, so the unweighted metrics get weight 0 on them instead (the same means).
    """
    rows = real_rows(sample_weight)
    compiled = getattr(model, "_compile_metrics", None)
    if rows is None or compiled is None:
        yield
        return
    if not compiled.built:
        compiled.build(y, y_pred)
    flat = compiled._flat_metrics
    weight = rows.astype(jnp.float32)
    compiled._flat_metrics = [m if not m else _OnRealRows(m, weight) for m in flat]
    try:
        yield
    finally:
        compiled._flat_metrics = flat

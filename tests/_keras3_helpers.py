"""Shared checks for the Keras 3 tests: a one-example-at-a-time DP-SGD step as the oracle."""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def loop_clipped_mean(model, x, y, loss_fn, clip, per_layer=False, sample_weight=None, stability=None):
    """(1/B) Σ_i clip(∇ℓ_i) at the model's current weights, one example at a time.

    `clip` is a float (flat) or one bound per trainable variable (per-layer); with `stability` γ
    (per-example normalization, flat) each gradient is scaled by clip/(||∇ℓ_i|| + γ) instead.
    """
    variables = model.trainable_variables
    total = [np.zeros(v.shape, np.float64) for v in variables]
    batch = len(x)
    for i in range(batch):
        y_i = tf.nest.map_structure(lambda a: a[i : i + 1], y)  # y may be a list or dict (several outputs)
        with tf.GradientTape() as tape:
            pred = model(x[i : i + 1], training=True)
            loss = tf.reduce_mean(loss_fn(y_i, pred))
            if sample_weight is not None:
                loss = loss * float(sample_weight[i])
        grads = [np.asarray(tf.convert_to_tensor(g), np.float64) for g in tape.gradient(loss, variables)]
        if per_layer:
            grads = [g * min(1.0, c / max(np.linalg.norm(g), 1e-30)) for g, c in zip(grads, clip)]
        else:
            norm = np.sqrt(sum(np.sum(g**2) for g in grads))
            factor = clip / (norm + stability) if stability is not None else min(1.0, clip / max(norm, 1e-30))
            grads = [g * factor for g in grads]
        total = [t + g for t, g in zip(total, grads)]
    return [t / batch for t in total]


def one_sgd_step(model, x, y, learning_rate, sample_weight=None):
    """Weights before and after one fit step over the whole (unshuffled) batch."""
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    model.fit(x, y, sample_weight=sample_weight, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    after = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    return before, after

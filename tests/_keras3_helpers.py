"""The one oracle of the DP step: a one-example-at-a-time clipped mean (Keras 3 on TF or JAX, and tf_keras).

Each example's gradient is taken alone, on a batch of one: ``tf.GradientTape`` on TensorFlow
(tf_keras, Keras 3 + TF), ``jax.grad`` of ``model.stateless_call`` on JAX (no ``vmap``), ``torch.autograd.grad``
of the model's call on torch (no ``torch.func``); the clip is numpy.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def loop_clipped_mean(model, x, y, loss_fn, clip, per_layer=False, sample_weight=None, stability=None):
    """(1/B) Σ_i clip(∇ℓ_i) at the model's current weights, one example at a time.

    `clip` is a float (flat) or one bound per trainable variable (per-layer); with `stability` γ
    (per-example normalization, flat) each gradient is scaled by clip/(||∇ℓ_i|| + γ) instead.
    """
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    batch = len(x)
    for grads in example_grads(model, x, y, loss_fn, sample_weight):
        if per_layer:
            grads = [g * min(1.0, c / max(np.linalg.norm(g), 1e-30)) for g, c in zip(grads, clip)]
        else:
            norm = np.sqrt(sum(np.sum(g**2) for g in grads))
            factor = clip / (norm + stability) if stability is not None else min(1.0, clip / max(norm, 1e-30))
            grads = [g * factor for g in grads]
        total = [t + g for t, g in zip(total, grads)]
    return [t / batch for t in total]


def example_grads(model, x, y, loss_fn, sample_weight=None) -> list:
    """[∇ℓ_i per trainable variable (float64) for each example i], one example at a time (a batch of one)."""
    backend = _backend(model)
    gradient = {"jax": _jax_gradient, "torch": _torch_gradient}.get(backend, _tf_gradient)(model, loss_fn)
    out = []
    for i in range(len(x)):
        y_i = tf.nest.map_structure(lambda a: a[i : i + 1], y)  # y may be a list or dict (several outputs)
        weight = 1.0 if sample_weight is None else float(sample_weight[i])
        out.append([np.asarray(g, np.float64) for g in gradient(x[i : i + 1], y_i, weight)])
    return out


def _backend(model) -> str:
    from keras_dpsgd.backends import keras_backend_of

    return keras_backend_of(model)


def _torch_gradient(model, loss_fn):
    import torch

    def gradient(x_i, y_i, weight):
        params = [v.value for v in model.trainable_variables]
        loss = torch.mean(loss_fn(y_i, model(x_i, training=True))) * weight
        return [g.detach().cpu().numpy() for g in torch.autograd.grad(loss, params)]

    return gradient


def _tf_gradient(model, loss_fn):
    def gradient(x_i, y_i, weight):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(y_i, model(x_i, training=True))) * weight
        grads = tape.gradient(loss, model.trainable_variables)  # None: a variable the model never reads
        return [
            tf.zeros(v.shape) if g is None else tf.convert_to_tensor(g)
            for g, v in zip(grads, model.trainable_variables)
        ]

    return gradient


def _jax_gradient(model, loss_fn):
    import jax
    import jax.numpy as jnp

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    kwargs = {"training": True} if model._call_has_training_arg else {}

    def loss(params, x_i, y_i, weight):
        pred, _ = model.stateless_call(params, non_trainable, x_i, **kwargs)
        return jnp.mean(loss_fn(y_i, pred)) * weight

    grad = jax.jit(jax.grad(loss))  # one example per call, compiled once
    return lambda x_i, y_i, weight: grad(trainable, x_i, y_i, weight)


def one_sgd_step(model, x, y, learning_rate, sample_weight=None):
    """Weights before and after one fit step over the whole (unshuffled) batch."""
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    model.fit(x, y, sample_weight=sample_weight, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    after = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    return before, after


PENALTY = 0.1  # λ of :func:`weight_reading_loss_case`


def weight_reading_loss_case(keras):
    """(model, x, y, loss, clip, the clipped mean of its step): a compiled loss that reads the first kernel k.

    ``ℓ_i = ce_i + λ·Σ k²`` (issue 37): each example's gradient is ∇ce_i (the loop of :func:`example_grads`)
    plus 2λk on k, clipped with it, as Keras 3 differentiates the loss on both backends. The penalty is part
    of each example's loss: clipping can shrink it, unlike a weight regularizer. The clip bound is the median
    norm: some examples are clipped, some not.
    """
    rng = np.random.default_rng(3)
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)])
    kernel = model.layers[0].kernel
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    x, y = rng.normal(size=(6, 5)).astype("float32"), rng.integers(0, 3, size=6)
    k = np.asarray(kernel.numpy(), np.float64)
    grads = [[g + 2 * PENALTY * k if j == 0 else g for j, g in enumerate(e)] for e in example_grads(model, x, y, ce)]
    norms = [np.sqrt(sum(np.sum(g**2) for g in e)) for e in grads]
    clip = float(np.median(norms))
    total = [sum(e[j] * min(1.0, clip / n) for e, n in zip(grads, norms)) for j in range(len(grads[0]))]
    loss = lambda yt, yp: ce(yt, yp) + PENALTY * keras.ops.sum(kernel**2)  # noqa: E731 (named "<lambda>")
    return model, x, y, loss, clip, [t / len(x) for t in total]

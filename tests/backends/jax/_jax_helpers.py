"""Oracles of the JAX suite: a one-example-at-a-time clipped step and small models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np

LR = 0.5


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def example_grads(model, x, y, loss=None):
    """∇ℓ_i of each example, one at a time (jax.grad of a batch of one; no vmap): list of lists."""
    loss = loss or loss_fn()
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    kwargs = {"training": True} if model._call_has_training_arg else {}

    def one(params, xi, yi):
        pred, _ = model.stateless_call(params, non_trainable, xi, **kwargs)
        return jnp.mean(loss(yi, pred))

    grad = jax.jit(jax.grad(one))  # one example per call, compiled once
    return [[np.asarray(g, np.float64) for g in grad(trainable, x[i : i + 1], y[i : i + 1])] for i in range(len(x))]


def loop_clipped_mean(model, x, y, clip, per_layer=False, loss=None):
    """(1/B) Σ_i clip(∇ℓ_i): flat (one bound) or per variable (a list of bounds)."""
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    for grads in example_grads(model, x, y, loss):
        if per_layer:
            grads = [g * min(1.0, c / max(np.linalg.norm(g), 1e-30)) for g, c in zip(grads, clip)]
        else:
            norm = np.sqrt(sum(np.sum(g**2) for g in grads))
            grads = [g * min(1.0, clip / max(norm, 1e-30)) for g in grads]
        total = [t + g for t, g in zip(total, grads)]
    return [t / len(x) for t in total]


def one_sgd_step(model, x, y, sample_weight=None):
    before = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
    model.fit(x, y, sample_weight=sample_weight, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    after = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
    return before, after


def assert_step(model, x, y, expected, lr=LR):
    before, after = one_sgd_step(model, x, y)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / lr, g, rtol=2e-4, atol=2e-6)


# ----------------------------------------------------------------------- models
def dense(rng):
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="relu"), keras.layers.Dense(3)])
    return model, rng.normal(size=(7, 5)).astype("float32")


def conv2d(rng):
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(3, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    return model, rng.normal(size=(5, 6, 6, 2)).astype("float32")


def embedding(rng):
    inputs = keras.Input((4,), dtype="int32")
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(keras.layers.Embedding(10, 4)(inputs)))
    return keras.Model(inputs, outputs), rng.integers(0, 10, size=(6, 4)).astype("int32")


def layer_norm(rng):
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4), keras.layers.LayerNormalization(), keras.layers.Dense(3)]
    )
    return model, rng.normal(size=(6, 5)).astype("float32")


def lstm(rng):
    model = keras.Sequential([keras.Input((3, 2)), keras.layers.LSTM(4), keras.layers.Dense(3)])
    return model, rng.normal(size=(4, 3, 2)).astype("float32")


def transformer(rng):
    """A transformer block: self-attention and a feed-forward layer, each with a residual and LayerNorm."""
    inputs = keras.Input((4, 8))
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    h = keras.layers.LayerNormalization()(inputs + h)
    f = keras.layers.Dense(8)(keras.layers.Dense(16, activation="relu")(h))
    h = keras.layers.LayerNormalization()(h + f)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, outputs), rng.normal(size=(5, 4, 8)).astype("float32")


def subclassed(rng):
    class TwoDense(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(6, activation="tanh")
            self.out = keras.layers.Dense(3)

        def call(self, x):
            return self.out(self.hidden(x))

    model = TwoDense()
    x = rng.normal(size=(5, 4)).astype("float32")
    model(x[:1])
    return model, x


MODELS = {f.__name__: f for f in (dense, conv2d, embedding, layer_norm, lstm, transformer, subclassed)}


def built(name: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    keras.utils.set_random_seed(seed)
    model, x = MODELS[name](rng)
    return model, x, rng.integers(0, 3, size=len(x))


def compiled(model, optimizer_cls=None, loss=None, **dp_kwargs):
    import keras_dpsgd.keras3 as k3

    dp_kwargs.setdefault("noise_multiplier", 0.0)
    dp_kwargs.setdefault("seed", 1)
    dp_kwargs.setdefault("learning_rate", LR)
    k3.make_private(model)
    model.compile(optimizer=(optimizer_cls or k3.DPSGDOptimizer)(**dp_kwargs), loss=loss or loss_fn())
    return model

"""The behavioural suite's front ends: one set of checks (tests/test_behaviour.py) for Keras 3 and tf_keras.

A front end builds the same small models with its Keras, a DP SGD optimizer, and the compiled
private model; the oracle is the one-example-at-a-time loop of ``tests._keras3_helpers``. The
Keras 3 front serves the backend of its process: TensorFlow here, JAX in the JAX suite's process
(tests/backends/jax/test_jax_behaviour.py runs the same checks there).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass
class Front:
    name: str
    keras: Any
    optimizer_cls: Callable
    make_private: Callable  # model -> model: the front's make_private
    always_private: bool  # Keras 3 needs make_private for every model; tf_keras only with weight regularizers

    def private(self, model):
        return self.make_private(model) if self.always_private else model

    def loss(self):
        return self.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def compiled(self, model, optimizer_cls=None, assume_poisson=False, **dp_kwargs):
        """`model` compiled with this front's DP SGD, or `optimizer_cls` (σ, C, lr from `dp_kwargs`), and its
        private step. `assume_poisson`: the test feeds fixed batches to an optimizer with a sampling rate and
        states that they stand for Poisson lots (``keras_dpsgd.ledger.assume_poisson``)."""
        from keras_dpsgd.ledger import assume_poisson as assume

        dp_kwargs.setdefault("noise_multiplier", 0.0)
        dp_kwargs.setdefault("seed", 1)
        opt = (optimizer_cls or self.optimizer_cls)(**dp_kwargs)
        if assume_poisson:
            assume(opt)
        self.private(model)
        model.compile(optimizer=opt, loss=self.loss())
        return model


def process_fronts() -> dict[str, Callable[[], Front]]:
    """The front ends a behaviour check runs on in this process, by name: Keras 3 and tf_keras where Keras 3 runs
    on TensorFlow (the main suite), Keras 3 alone in the JAX and torch suites' processes (their conftest sets
    KERAS_BACKEND before any test module is imported; tests/test_backend_suites.py starts them)."""
    if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
        return {"keras3": keras3_front, "tf_keras": tf_keras_front}
    return {"keras3": keras3_front}


def keras3_front() -> Front:
    import keras

    import keras_dpsgd.keras3 as k3

    return Front("keras3", keras, k3.DPSGDOptimizer, k3.make_private, always_private=True)


def tf_keras_front() -> Front:
    import tf_keras

    import keras_dpsgd.tf_keras as tfk

    return Front("tf_keras", tf_keras, tfk.DPSGDOptimizer, tfk.make_private, always_private=False)


# ----------------------------------------------------------------------- models
def dense(K, rng):
    model = K.Sequential([K.Input((5,)), K.layers.Dense(6, activation="relu"), K.layers.Dense(3)])
    return model, rng.normal(size=(7, 5)).astype("float32")


def conv2d(K, rng):
    model = K.Sequential(
        [K.Input((6, 6, 2)), K.layers.Conv2D(3, 3, activation="relu"), K.layers.Flatten(), K.layers.Dense(3)]
    )
    return model, rng.normal(size=(5, 6, 6, 2)).astype("float32")


def embedding(K, rng):
    inputs = K.Input((4,), dtype="int32")
    outputs = K.layers.Dense(3)(K.layers.Flatten()(K.layers.Embedding(10, 4)(inputs)))
    return K.Model(inputs, outputs), rng.integers(0, 10, size=(6, 4)).astype("int32")


def layer_norm(K, rng):
    model = K.Sequential([K.Input((5,)), K.layers.Dense(4), K.layers.LayerNormalization(), K.layers.Dense(3)])
    return model, rng.normal(size=(6, 5)).astype("float32")


def lstm(K, rng):
    model = K.Sequential([K.Input((3, 2)), K.layers.LSTM(4), K.layers.Dense(3)])
    return model, rng.normal(size=(4, 3, 2)).astype("float32")


def transformer(K, rng):
    """A transformer block: self-attention and a feed-forward layer, each with a residual and LayerNorm."""
    inputs = K.Input((4, 8))
    h = K.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    h = K.layers.LayerNormalization()(K.layers.Add()([inputs, h]))
    f = K.layers.Dense(8)(K.layers.Dense(16, activation="relu")(h))
    h = K.layers.LayerNormalization()(K.layers.Add()([h, f]))
    outputs = K.layers.Dense(3)(K.layers.GlobalAveragePooling1D()(h))
    return K.Model(inputs, outputs), rng.normal(size=(5, 4, 8)).astype("float32")


def subclassed(K, rng):
    class TwoDense(K.Model):
        def __init__(self):
            super().__init__()
            self.hidden = K.layers.Dense(6, activation="tanh")
            self.out = K.layers.Dense(3)

        def call(self, x):
            return self.out(self.hidden(x))

    model = TwoDense()
    x = rng.normal(size=(5, 4)).astype("float32")
    model(x[:1])
    return model, x


MODELS = {f.__name__: f for f in (dense, conv2d, embedding, layer_norm, lstm, transformer, subclassed)}


def built(front: Front, name: str, seed: int = 0):
    """(model, x, y) of model `name` for `front`, seeded."""
    rng = np.random.default_rng(seed)
    front.keras.utils.set_random_seed(seed)
    model, x = MODELS[name](front.keras, rng)
    return model, x, rng.integers(0, 3, size=len(x))

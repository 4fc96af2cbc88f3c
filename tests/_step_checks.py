"""The private step's checks that the JAX and torch suites share (beyond the behaviour suite), and their helpers.

tests/backends/jax/test_jax_step.py and tests/backends/torch/test_torch_step.py collect the checks (``__all__``)
with ``import *``, each in its own child process on its own backend; the helpers (``compiled``, ``assert_step``,
the noise-only model) serve those modules and the ghost-norm ones. The oracle is the behaviour suite's
one-example loop (tests/_keras3_helpers.py: a batch of one, no vmap, clipped in numpy); σ = 0 makes the step
exact.
"""

import keras
import numpy as np

import keras_dpsgd.keras3 as k3
from tests._behaviour import built, keras3_front
from tests._keras3_helpers import loop_clipped_mean, one_sgd_step

__all__ = [
    "test_each_example_draws_its_own_dropout_mask",
    "test_nonfinite_example_contributes_exactly_zero",
    "test_per_example_normalization",
]

LR = 0.5
FRONT = keras3_front()


def compiled(model, **dp_kwargs):
    """`model` compiled with the front's DP SGD (σ = 0 unless given) at learning rate LR unless given."""
    dp_kwargs.setdefault("learning_rate", LR)
    return FRONT.compiled(model, **dp_kwargs)


def assert_step(model, x, y, expected):
    """One SGD step at LR over the whole batch moves the weights by LR times `expected`."""
    before, after = one_sgd_step(model, x, y, LR)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)


def assert_clipped_step(model, x, y, clip, per_layer=False):
    """`model` compiled with bound `clip` (flat, or one per variable): its step is the loop's clipped mean."""
    compiled(model, l2_norm_clip=clip)
    assert_step(model, x, y, loop_clipped_mean(model, x, y, FRONT.loss(), clip, per_layer=per_layer))


def noise_only(**dp_kwargs):
    """A model whose every gradient is 0 (mse at y = f(x)), compiled with σ = 1, C = 1, lr 1: (model, x, y), each
    step's update the noise / L."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((40,)), keras.layers.Dense(250, use_bias=False)])
    x = np.random.default_rng(0).normal(size=(8, 40)).astype("float32")
    y = np.asarray(model.predict(x, verbose=0))
    k3.make_private(model)
    model.compile(
        optimizer=k3.DPSGDOptimizer(learning_rate=1.0, l2_norm_clip=1.0, noise_multiplier=1.0, **dp_kwargs),
        loss=keras.losses.MeanSquaredError(reduction="none"),
    )
    return model, x, y


def update(model, x, y):
    """The kernel's update (flat) of one step over the whole batch."""
    before = np.array(model.trainable_variables[0].numpy())
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    return (before - np.asarray(model.trainable_variables[0].numpy())).ravel()


def test_nonfinite_example_contributes_exactly_zero():
    """An example whose gradient is NaN is zeroed (factor 0, NaN not propagated) and counted."""
    model, x, y = built(FRONT, "dense")
    compiled(model, l2_norm_clip=0.3)
    x = x.copy()
    x[2, 0] = np.nan
    keep = np.arange(len(x)) != 2
    expected = [g * (keep.sum() / len(x)) for g in loop_clipped_mean(model, x[keep], y[keep], FRONT.loss(), 0.3)]
    assert_step(model, x, y, expected)
    assert int(model.optimizer.nonfinite_examples.numpy()) == 1


def test_per_example_normalization():
    """clipping='normalize': each gradient scaled by 1/(||g|| + γ), sensitivity 1."""
    model, x, y = built(FRONT, "dense")
    compiled(model, l2_norm_clip=None, clipping="normalize", stability=0.05)
    assert_step(model, x, y, loop_clipped_mean(model, x, y, FRONT.loss(), 1.0, stability=0.05))


def test_each_example_draws_its_own_dropout_mask():
    """8 copies of one example through Dropout(0.5): with one mask for the batch about half the kernel's
    update would be exactly 0; with a mask per example a coordinate is 0 only if all 8 dropped it."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="ones"),
        ]
    )
    k3.make_private(model)
    model.compile(
        optimizer=k3.DPSGDOptimizer(l2_norm_clip=100.0, noise_multiplier=0.0, learning_rate=0.01),
        loss=keras.losses.MeanSquaredError(reduction="none"),
    )
    before = np.array(model.trainable_variables[0].numpy())
    model.fit(np.ones((8, 64), "float32"), np.zeros((8, 1), "float32"), batch_size=8, epochs=1, verbose=0)
    moved = before - np.asarray(model.trainable_variables[0].numpy())
    assert np.mean(moved == 0) < 0.2

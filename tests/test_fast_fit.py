"""End to end: DPSGDOptimizer in model.fit gives the same update with the fast and reference backends."""

import numpy as np
import pytest
import tf_keras as keras

from keras_dpsgd.tf_keras import DPSGDOptimizer
from keras_dpsgd._fast import FastBackend

L = keras.layers


def _mlp():
    return keras.Sequential([keras.Input((6,)), L.Dense(8, activation="relu"), L.Dense(3)])


def _convnet():
    return keras.Sequential(
        [
            keras.Input((8, 8, 2)),
            L.Conv2D(4, 3, padding="same", activation="relu"),
            L.MaxPooling2D(3, 2),
            L.Conv2D(3, 3, activation="relu"),
            L.Flatten(),
            L.Dense(3),
        ]
    )


def _fit(make_model, x, y, backend, l2_norm_clip, run_eagerly=False):
    model = make_model()
    model.set_weights(_initial_weights(make_model))
    opt = DPSGDOptimizer(
        l2_norm_clip=l2_norm_clip,
        noise_multiplier=0.0,
        learning_rate=0.5,
        per_example_backend=backend,
        seed=1,
    )
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"),
        run_eagerly=run_eagerly,
    )
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    assert isinstance(opt._backend, FastBackend) == (backend == "fast")
    return [w.numpy() for w in model.trainable_variables], opt


@pytest.mark.parametrize(
    "make_model,x_shape,clip",
    [(_mlp, (10, 6), 0.3), (_mlp, (10, 6), [0.2, 0.1, 0.3, 0.05]), (_convnet, (10, 8, 8, 2), 0.3)],
)
def test_fit_fast_equals_reference(make_model, x_shape, clip):
    gen = np.random.default_rng(0)
    x = gen.normal(size=x_shape).astype("float32")
    y = gen.integers(0, 3, size=(x_shape[0],))
    fast, opt = _fit(make_model, x, y, "fast", clip)
    assert opt._backend.last_fallback == []
    reference, _ = _fit(make_model, x, y, "reference", clip)
    initial = _initial_weights(make_model)
    moved = False
    for f, r, w0 in zip(fast, reference, initial):
        np.testing.assert_allclose(f, r, rtol=1e-4, atol=1e-5)
        moved = moved or not np.allclose(f, w0)
    assert moved


_INITIAL = {}


def _initial_weights(make_model):
    """One fixed initialization per architecture, shared by every run."""
    if make_model not in _INITIAL:
        _INITIAL[make_model] = make_model().get_weights()
    return _INITIAL[make_model]


def test_fit_run_eagerly_falls_back_with_same_result():
    gen = np.random.default_rng(1)
    x = gen.normal(size=(10, 6)).astype("float32")
    y = gen.integers(0, 3, size=(10,))
    graph, _ = _fit(_mlp, x, y, "fast", 0.3)
    eager, opt = _fit(_mlp, x, y, "fast", 0.3, run_eagerly=True)
    assert len(opt._backend.last_fallback) == 4
    for a, b in zip(graph, eager):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_auto_resolves_to_fast():
    opt = DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0)
    assert isinstance(opt._backend, FastBackend)

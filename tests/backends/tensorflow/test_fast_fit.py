"""End to end: DPSGDOptimizer in model.fit gives the same update with the fast and reference backends."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import keras_dpsgd.tf_keras
from keras_dpsgd.tf_keras import DPSGDOptimizer
from keras_dpsgd.backends.tensorflow import FastBackend

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


def _fit(make_model, x, y, backend, l2_norm_clip):
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


def test_auto_resolves_to_fast():
    opt = DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0)
    assert isinstance(opt._backend, FastBackend)


def _linear():
    return keras.Sequential([keras.Input((6,)), L.Dense(3)])


def _fit_dataset(strategy, dataset, *layers):
    """A σ = 0 fit of Dense(3) after `layers` on `dataset` under `strategy`: (weights, optimizer)."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), *layers, L.Dense(3)])
        model.set_weights(_initial_weights(_linear))
        opt = keras_dpsgd.tf_keras.DPSGDOptimizer(l2_norm_clip=0.3, noise_multiplier=0.0, learning_rate=0.5)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        model.compile(optimizer=opt, loss=loss)
    model.fit(dataset, epochs=1, verbose=0)
    return [w.numpy() for w in model.trainable_variables], opt


@pytest.fixture(scope="module")
def mirrored():
    return tf.distribute.MirroredStrategy(["/cpu:0"])


def _unknown_batch_dataset():
    """7 examples in batches of 3 (batch size None in the element spec), example 1 NaN."""
    gen = np.random.default_rng(3)
    x = gen.normal(size=(7, 6)).astype("float32")
    x[1] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, gen.integers(0, 3, size=(7,)))).batch(3)


def test_fit_under_a_strategy_reading_partial_batches_is_fast_and_exact(mirrored):
    # A strategy's iterator returns cond(data left, value or an empty dummy, get_next) when the batch
    # size is unknown (MultiWorkerMirroredStrategy always): the data comes out of an If op. Before,
    # the analysis saw no input there: every variable took the jacobian fallback, whose 0·NaN made
    # the whole batch of the NaN example non-finite (3 examples dropped, not 1).
    distributed, opt = _fit_dataset(mirrored, _unknown_batch_dataset())
    assert opt._backend.last_fallback == []
    assert int(opt.nonfinite_examples.numpy()) == 1
    one_device, _ = _fit_dataset(tf.distribute.get_strategy(), _unknown_batch_dataset())
    for d, o in zip(distributed, one_device):
        np.testing.assert_allclose(d, o, rtol=1e-5, atol=1e-6)


def test_a_layer_mixing_the_examples_is_refused_under_a_strategy_reading_partial_batches(mirrored):
    # Privacy: before, no input was seen there, so the batch mean went unnoticed and the step was
    # accounted as if each example's influence were clipped.
    shift = L.Lambda(lambda t: t - tf.reduce_mean(t, axis=0, keepdims=True), name="batch_shift")
    with pytest.raises(ValueError, match="batch_shift.*reduces over the batch axis"):
        _fit_dataset(mirrored, _unknown_batch_dataset(), shift)


class _FakeGPU:
    device_type = "GPU"
    name = "/physical_device:GPU:0"


def test_keras3_make_private_resolves_jit_compile_auto_to_false(monkeypatch):
    # Keras's "auto" turns XLA on where a GPU is present; under XLA the backends' run-time checks
    # are verdicts (a failing batch silently adds noise only) rather than errors: only an explicit
    # jit_compile=True compiles the private step so.
    import keras

    import keras_dpsgd.keras3

    real = tf.config.list_physical_devices
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda *kind: real(*kind) + [_FakeGPU()])

    def build():
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])

    plain = build()
    plain.compile(optimizer="sgd", loss="mse", jit_compile="auto")
    assert plain.jit_compile is True  # Keras's own resolution with a GPU present
    private = keras_dpsgd.keras3.make_private(build())
    optimizer = keras_dpsgd.keras3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, expected_lot_size=4.0)
    private.compile(optimizer=optimizer, loss="mse", jit_compile="auto")
    assert private.jit_compile is False
    private.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    assert private.jit_compile is True

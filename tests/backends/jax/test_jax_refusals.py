"""What is not built on JAX is refused by name, before any weight changes."""

import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from tests._behaviour import built, keras3_front

FRONT = keras3_front()
NOT_YET = "is not supported on the JAX backend yet; use KERAS_BACKEND=tensorflow"


def _weights(model):
    return [np.array(v.numpy()) for v in model.trainable_variables]


def _assert_refused_unchanged(model, x, y, match):
    before = _weights(model)
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    for b, a in zip(before, _weights(model)):
        np.testing.assert_array_equal(b, a)


def test_batch_normalization_in_training_mode_is_refused():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4), keras.layers.BatchNormalization(), keras.layers.Dense(3)]
    )
    x, y = np.random.default_rng(0).normal(size=(6, 5)).astype("float32"), np.arange(6) % 3
    FRONT.compiled(model, l2_norm_clip=1.0)
    _assert_refused_unchanged(model, x, y, "writes a non-trainable variable from an example's data")


def test_frozen_batch_normalization_trains():
    keras.utils.set_random_seed(0)
    bn = keras.layers.BatchNormalization()
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), bn, keras.layers.Dense(3)])
    bn.trainable = False
    x, y = np.random.default_rng(0).normal(size=(6, 5)).astype("float32"), np.arange(6) % 3
    FRONT.compiled(model, l2_norm_clip=1.0)
    model.fit(x, y, batch_size=6, epochs=1, verbose=0)
    assert int(model.optimizer.noised_steps.numpy()) == 1


def test_gradient_canaries_and_own_step_are_refused():
    from keras_dpsgd.audit import with_gradient_canaries

    model, x, y = built(FRONT, "dense")
    FRONT.compiled(model, with_gradient_canaries(k3.DPSGDOptimizer), l2_norm_clip=1.0)
    _assert_refused_unchanged(model, x, y, rf"overrides \w+ .*{NOT_YET}")
    with pytest.raises(ValueError, match=f"private_update .*{NOT_YET}"):
        k3.private_update(None, None, [], None)
    with pytest.raises(ValueError, match=f"sanitized_gradients .*{NOT_YET}"):
        k3.sanitized_gradients(None, None, [], None)

    class Own(keras.Model):
        def train_step(self, state, data):
            raise AssertionError

    with pytest.raises(ValueError, match="overrides train_step, which Keras's train step on the jax backend"):
        k3.make_private(Own())  # the hooks of Keras's step: tests/backends/jax/test_jax_hooks.py


def test_explicit_per_example_backend_is_refused():
    """TensorFlow's fast per-example backend names a graph analysis JAX does not have: refused when the
    optimizer is made (the seam's PER_EXAMPLE_CHOICES), before any fit."""
    with pytest.raises(ValueError, match=r"per_example_backend must be one of \('auto', 'reference'\), got 'fast'"):
        k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1, per_example_backend="fast")

"""The refusals that the JAX and torch suites share: what is not built on their backend, and a training-mode
BatchNormalization, is refused by name before any weight changes.

tests/backends/jax/test_jax_refusals.py and tests/backends/torch/test_torch_refusals.py collect the checks
(``__all__``) with ``import *``, each in its own child process; ``NOT_YET`` is the refusal's words on the backend of
that process.
"""

import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from tests._behaviour import built, keras3_front

__all__ = [
    "test_batch_normalization_in_training_mode_is_refused",
    "test_a_model_refused_for_its_batch_normalization_trains_once_it_is_frozen",
    "test_frozen_batch_normalization_trains",
    "test_gradient_canaries_and_the_custom_step_functions_are_refused",
    "test_the_fast_per_example_backend_is_refused",
]

FRONT = keras3_front()
NOT_YET = {
    "jax": "is not supported on the JAX backend yet; use KERAS_BACKEND=tensorflow",
    "torch": "is not supported on the torch backend yet",
}[keras.config.backend()]


def weights(model):
    return [np.array(v.numpy()) for v in model.trainable_variables]


def assert_refused_unchanged(model, x, y, match):
    """`model.fit` raises a ValueError matching `match`, and no weight nor the ledger's step count changed."""
    before = weights(model)
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    for b, a in zip(before, weights(model)):
        np.testing.assert_array_equal(b, a)
    assert int(model.optimizer.noised_steps.numpy()) == 0


def data():
    return np.random.default_rng(0).normal(size=(6, 5)).astype("float32"), np.arange(6) % 3


def bn_model():
    """Dense -> BatchNormalization -> Dense, seeded: (model, its BatchNormalization layer)."""
    keras.utils.set_random_seed(0)
    bn = keras.layers.BatchNormalization()
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), bn, keras.layers.Dense(3)]), bn


def test_batch_normalization_in_training_mode_is_refused():
    model, _ = bn_model()
    x, y = data()
    FRONT.compiled(model, l2_norm_clip=1.0)
    assert_refused_unchanged(model, x, y, "writes a non-trainable variable from an example's data")


def test_frozen_batch_normalization_trains():
    model, bn = bn_model()
    bn.trainable = False
    x, y = data()
    FRONT.compiled(model, l2_norm_clip=1.0)
    model.fit(x, y, batch_size=6, epochs=1, verbose=0)
    assert int(model.optimizer.noised_steps.numpy()) == 1


def test_a_model_refused_for_its_batch_normalization_trains_once_it_is_frozen():
    """The refusal's way out, on the same model: freeze the layer, compile again, train. (On JAX the refused fit
    left the optimizer's variables emptied, and compiling again failed reading them.)"""
    model, bn = bn_model()
    x, y = data()
    FRONT.compiled(model, l2_norm_clip=1.0)
    assert_refused_unchanged(model, x, y, "writes a non-trainable variable from an example's data")
    bn.trainable = False
    FRONT.compiled(model, l2_norm_clip=1.0)
    model.fit(x, y, batch_size=6, epochs=1, verbose=0)
    assert int(model.optimizer.noised_steps.numpy()) == 1


def test_gradient_canaries_and_the_custom_step_functions_are_refused():
    from keras_dpsgd.audit import with_gradient_canaries

    model, x, y = built(FRONT, "dense")
    FRONT.compiled(model, with_gradient_canaries(k3.DPSGDOptimizer), l2_norm_clip=1.0)
    assert_refused_unchanged(model, x, y, rf"overrides \w+ .*{NOT_YET}")
    with pytest.raises(ValueError, match=f"private_update .*{NOT_YET}"):
        k3.private_update(None, None, [], None)
    with pytest.raises(ValueError, match=f"sanitized_gradients .*{NOT_YET}"):
        k3.sanitized_gradients(None, None, [], None)


def test_the_fast_per_example_backend_is_refused():
    """TensorFlow's fast per-example backend names a graph analysis this backend does not have: refused when the
    optimizer is made (the seam's PER_EXAMPLE_CHOICES), before any fit."""
    with pytest.raises(ValueError, match=r"per_example_backend must be one of \('auto', 'reference'\), got 'fast'"):
        k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1, per_example_backend="fast")

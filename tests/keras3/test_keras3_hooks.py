"""Keras 3 on TensorFlow runs the user's model as Keras would, or refuses it by name (issue 37, class 6).

The same contract as on JAX (``tests/backends/jax/test_jax_hooks.py``): a trainer hook through which Keras's
TensorFlow train step computes the loss (``train_step``, ``compute_loss``, ``_compute_loss``) is refused at
``make_private`` with a way out true on every backend; a compiled loss that reads the weights (a lambda)
trains, its weight term part of each example's loss and clipped with it (σ = 0, against the one-example loop).
"""

import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from tests._behaviour import keras3_front
from tests._keras3_helpers import loop_clipped_mean, one_sgd_step, weight_reading_loss_case

FRONT = keras3_front()
LR = 0.5


def _step_matches(model, x, y, expected):
    before, after = one_sgd_step(model, x, y, LR)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)
    assert max(np.abs(g).max() for g in expected) > 1e-3  # the step moved the weights


def _optimizer(clip):
    return k3.DPSGDOptimizer(l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=LR, seed=1)


@pytest.mark.parametrize("method", ["train_step", "compute_loss", "_compute_loss"])
def test_loss_hooks_are_refused_by_name_with_a_way_out_true_on_every_backend(method):
    class Hooked(keras.Sequential):
        pass

    setattr(Hooked, method, lambda self, *a, **k: None)  # never runs: refused before
    with pytest.raises(ValueError, match=f"overrides {method}, which Keras's train step on the tensorflow") as err:
        k3.make_private(Hooked([keras.Input((4,)), keras.layers.Dense(3)]))
    assert "compile(loss=...)" in str(err.value) and "On the TensorFlow backend only" in str(err.value)


def test_a_jax_only_hook_is_not_run_by_keras_on_tensorflow_and_the_model_trains():
    """The control: Keras's TensorFlow step never calls compute_loss_and_updates (JAX's hook): nor does the
    private step, which trains the compiled loss exactly."""

    class JaxHooked(keras.Sequential):
        def compute_loss_and_updates(self, *args, **kwargs):
            raise AssertionError("not a hook of the TensorFlow trainer")

    keras.utils.set_random_seed(0)
    model = k3.make_private(JaxHooked([keras.Input((5,)), keras.layers.Dense(3)]))
    x, y = np.random.default_rng(0).normal(size=(6, 5)).astype("float32"), np.arange(6) % 3
    model.compile(optimizer=_optimizer(0.5), loss=FRONT.loss())
    _step_matches(model, x, y, loop_clipped_mean(model, x, y, FRONT.loss(), 0.5))


def test_a_compiled_loss_reading_the_weights_is_exact():
    """ℓ_i = ce_i + 0.1·Σ k² given as a lambda: before, "'<lambda>' is not a valid root scope name". The kernel's
    read in the loss takes the weight-region rule on TensorFlow (per-example jacobians before it); the step equals
    the one-example loop."""
    model, x, y, loss, clip, expected = weight_reading_loss_case(keras)
    k3.make_private(model)
    model.compile(optimizer=_optimizer(clip), loss=loss)
    _step_matches(model, x, y, expected)

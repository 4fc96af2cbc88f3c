"""What is not built on torch, and what would mix the examples, is refused by name before any weight changes.

The refusals JAX and torch share are tests/_backend_refusals.py's (collected here); below, torch's own.
"""

import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from tests._backend_refusals import *  # noqa: F403 (the refusals JAX and torch share, collected here)
from tests._backend_refusals import FRONT, NOT_YET, assert_refused_unchanged, data
from tests._behaviour import built


def test_an_op_over_the_batch_axis_sees_one_example():
    """A layer that normalizes over the batch axis (mixing, where no check could see it on a tape) runs on a
    batch of one under vmap: it sees its own example only, so the step equals the one-example loop."""
    from tests._keras3_helpers import loop_clipped_mean, one_sgd_step

    class BatchCentre(keras.layers.Layer):
        def call(self, x):
            return x - keras.ops.mean(x, axis=0, keepdims=True) + 0.5 * x

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), BatchCentre(), keras.layers.Dense(3)])
    x, y = data()
    FRONT.compiled(model, l2_norm_clip=0.3, learning_rate=0.5)
    expected = loop_clipped_mean(model, x, y, FRONT.loss(), 0.3)
    before, after = one_sgd_step(model, x, y, 0.5)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / 0.5, g, rtol=2e-4, atol=2e-6)


def test_augmentation_and_own_steps_are_refused():
    with pytest.raises(ValueError, match=f"augmentation multiplicity .*{NOT_YET}"):
        k3.make_private(built(FRONT, "dense")[0], augmentation_multiplicity=2)

    for hook in ("train_step", "compute_loss", "_compute_loss"):
        own = type("Own", (keras.Sequential,), {hook: lambda self, *a, **k: None})
        with pytest.raises(ValueError, match=f"overrides {hook}.*torch"):
            k3.make_private(own([keras.Input((5,)), keras.layers.Dense(3)]))


def test_torch_compile_is_refused():
    model, x, y = built(FRONT, "dense")
    k3.make_private(model)
    model.compile(optimizer=k3.DPSGDOptimizer(1.0, 0.0), loss=FRONT.loss(), jit_compile=True)
    assert_refused_unchanged(model, x, y, f"jit_compile=True.*{NOT_YET}")


def test_a_dp_optimizer_without_make_private_is_refused():
    model, x, y = built(FRONT, "dense")
    model.compile(optimizer=k3.DPSGDOptimizer(1.0, 0.0), loss=keras.losses.SparseCategoricalCrossentropy(True))
    assert_refused_unchanged(model, x, y, "did not come from its sanitizer")


def test_a_batch_statistic_is_refused_where_every_trainable_layer_has_a_rule():
    """BatchNormalization without weights (center=False, scale=False) between Dense layers: every trainable variable
    takes a norm rule (the ghost path's autograd backward pass, ``perturbation_grads``), and the moving statistics
    written from the batch are still refused before any weight changes."""
    keras.utils.set_random_seed(0)
    bn = keras.layers.BatchNormalization(center=False, scale=False)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), bn, keras.layers.Dense(3)])
    x, y = data()
    FRONT.compiled(model, l2_norm_clip=1.0)
    assert_refused_unchanged(model, x, y, "writes a non-trainable variable from an example's data")

"""The models of 2026 on Keras 3 TensorFlow (issue 41), and PReLU (issue 40): silu/swish (a ``tf.custom_gradient``), grouped-query
attention's repeated K/V heads (``keras.ops.repeat``) and token-level losses with the lots' ``[B]`` sample weight.

Each trains one step on the documented path (``make_private`` + ``PoissonLots(...).dataset()``, σ = 0, every example
in the lot) and moves the weights by exactly the clipped per-example gradients of a one-example-at-a-time loop.
Controls that genuinely mix the examples stay refused, with advice that fits what was found (no BatchNormalization
advice for an op that is not batch norm).
"""

import logging

import numpy as np

import pytest
import tensorflow as tf
import tf_keras
from _fast_helpers import check, data, flat_factors

from keras_dpsgd.backends.tensorflow import graph as _graph
from tests._models_2026 import TF_MODELS, VISION, check_one_private_step, efficientnet


@pytest.mark.parametrize("name", sorted(TF_MODELS) + sorted(VISION))
def test_one_private_step_equals_the_loop(name, caplog):
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        opt = check_one_private_step(name)
    assert "fast rules" in str(opt.per_example_report)  # no variable fell back to jacobians
    assert not [r for r in caplog.records if "per-example jacobians" in r.getMessage()]


@pytest.mark.parametrize("shared_axes", [None, [1]])
def test_tf_keras_prelu_equals_the_loop_and_the_reference_path(shared_axes):
    """PReLU's alpha (``-alpha · relu(-x)``: a Neg, then the elementwise rule) on tf_keras: the fast backend, with
    no variable on per-example jacobians, == the loop == per-example jacobians (issue 40)."""
    x, y = data((5, 3, 4), (5, 2), seed=6)
    alpha = tf_keras.initializers.RandomUniform(0.1, 0.4, seed=6)
    model = tf_keras.Sequential(
        [
            tf_keras.layers.Dense(5),
            tf_keras.layers.PReLU(alpha_initializer=alpha, shared_axes=shared_axes),
            tf_keras.layers.Flatten(),
            tf_keras.layers.Dense(2),
        ]
    )
    check(model, x, y, factors=flat_factors(0.1), first_rows=(2,))


def test_tf_keras_swish_equals_the_loop_and_the_reference_path():
    """tf_keras runs the same tf.nn.silu: the fast backend == the loop == per-example jacobians."""
    x, y = data((5, 4), (5, 2), seed=5)
    model = tf_keras.Sequential([tf_keras.layers.Dense(8, activation="swish"), tf_keras.layers.Dense(2)])
    check(model, x, y, factors=flat_factors(0.1), first_rows=(1,))


def _refusal(fn, shape=(None, 3, 4)):
    """The refusal of ``_graph.analyze`` for the per-example loss ``fn(x)`` traced on a batch of unknown size."""

    @tf.function(input_signature=[tf.TensorSpec(shape, tf.float32)], autograph=False)
    def step(x):
        _graph.analyze(fn(x))
        return x

    with pytest.raises(ValueError) as err:
        step.get_concrete_function()
    message = str(err.value)
    assert "BatchNormalization" not in message
    return message


def test_a_custom_gradient_that_mixes_the_examples_is_refused():
    @tf.custom_gradient
    def batch_summed_gradient(x):
        def grad(dy):
            return tf.broadcast_to(tf.reduce_sum(dy, axis=0, keepdims=True), tf.shape(dy))

        return tf.identity(x), grad

    message = _refusal(lambda x: tf.reduce_sum(batch_summed_gradient(x), axis=[1, 2]))
    assert "custom gradient that mixes the examples" in message and "reduces over the batch axis" in message


def test_a_custom_gradient_that_reads_a_batch_statistic_is_refused():
    """The forward is per example; the gradient reads back a mean over the batch."""

    @tf.custom_gradient
    def batch_scaled_gradient(x):
        m = tf.reduce_mean(x, axis=0)

        def grad(dy):
            return dy * m

        return tf.identity(x), grad

    message = _refusal(lambda x: tf.reduce_sum(batch_scaled_gradient(x), axis=[1, 2]))
    assert "custom gradient that mixes the examples" in message and "reduces over the batch axis" in message


def test_tiling_the_batch_axis_by_a_data_dependent_multiple_is_refused():
    def loss(x):
        tiled = tf.tile(x, tf.stack([tf.shape(x)[0], 1, 1]))
        return tf.reduce_sum(tiled[: tf.shape(x)[0]], axis=[1, 2])

    assert "tiles the batch axis by a multiple unknown at trace time" in _refusal(loss)


def test_a_batch_sized_vector_on_a_token_axis_is_refused():
    """[B, T] values times a [B] vector of data broadcast along the token axis pair example j with token j."""
    message = _refusal(lambda x: tf.reduce_sum(x * tf.reduce_sum(x, axis=[1, 2]), axis=[1, 2]), shape=(None, 3, 3))
    assert "broadcasts input" in message and "non-batch axes" in message


def test_batch_normalization_keeps_its_advice():
    """Batch statistics (a BatchNormalization layer named "bn", in a custom loop) still get the freeze advice."""
    import keras

    from keras_dpsgd.keras3 import DPSGDOptimizer

    layers = keras.layers
    model = keras.Sequential(
        [keras.Input((5,)), layers.Dense(4), layers.BatchNormalization(name="bn"), layers.Dense(3)]
    )
    opt = DPSGDOptimizer(1.0, 0.0)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2, axis=1)
        opt.minimize(loss, model.trainable_variables, tape=tape)

    with pytest.raises(ValueError, match=r"reduces over the batch axis.*layer.trainable = False"):
        step(tf.zeros((4, 5)), tf.zeros((4, 3)))


def test_copies_of_a_tiled_weight_mixed_over_the_batch_are_refused():
    """The class-token rule reads the tiled weight's rows as the examples': an op mixing them over the batch is
    seen by the row analysis and refused, never given to the rule (whose per-example gradient would be wrong)."""
    token = tf.Variable(tf.ones([1, 4]))

    def fn(x):
        copies = tf.tile(token, tf.stack([tf.shape(x)[0], 1]))  # [B, 4]: one copy per example
        mixed = copies * tf.reduce_mean(copies, axis=0, keepdims=True)  # every row reads every copy
        return tf.reduce_sum(x, axis=[1, 2]) + tf.reduce_sum(mixed, axis=1)

    assert "Mean" in _refusal(fn)


def test_efficientnet_with_a_batch_normalization_in_training_mode_is_refused():
    """The top block with its BatchNormalization trainable (training mode: batch statistics mix the examples) is
    refused before any weight changes, with the freeze advice."""
    import keras_dpsgd
    from keras_dpsgd import keras3 as k3

    model, loss, x, y = efficientnet(top_block=True)
    model.layers[1].get_layer("top_bn").trainable = True
    before = [v.numpy() for v in model.trainable_variables]
    lots = keras_dpsgd.PoissonLots(x, y, sampling_rate=1.0, seed=0)
    private = k3.make_private(model)
    private.compile(optimizer=lots.configure(k3.DPSGDOptimizer(1.0, 0.0, learning_rate=1.0)), loss=loss)
    with pytest.raises(ValueError, match=r"(?s)BatchNormalization.*trainable = False"):
        private.fit(lots.dataset(), steps_per_epoch=1, epochs=1, verbose=0)
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())

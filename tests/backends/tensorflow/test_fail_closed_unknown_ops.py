"""Fail closed on ops the per-example analysis does not know (keras_dpsgd.backends.tensorflow.graph.analyze).

An op outside the analysis's allowlist, or a function call it could not read, used to send the
step to the per-example jacobians, which are exact only if the loss is per example: an unknown
op that mixed the examples was trained through, unbounded. Now a call's body is analyzed with
the same rules, and a loss the analysis cannot prove per example is refused (with either backend),
except for a static batch of one example.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import keras_dpsgd.keras3
import keras_dpsgd.tf_keras
from _fast_helpers import check, data, dense_mlp, flat_factors, per_example_loss, run_traced
from keras_dpsgd.backends.tensorflow import FastBackend
from keras_dpsgd.backends.tensorflow._backend import _reference_backend


@tf.function
def _centered(x):
    return x - tf.reduce_mean(x, axis=0, keepdims=True)  # mixes the examples


@tf.function
def _affine(x):
    return 2.0 * tf.tanh(x) + 1.0  # per example


def _pair_sums(x):
    """Rows 2j and 2j + 1 summed into row j (an op outside the allowlist that mixes)."""
    ids = tf.range(tf.shape(x)[0]) // 2
    return tf.math.unsorted_segment_sum(x, ids, num_segments=tf.shape(x)[0])


class _Between(tf_keras.Model):
    """Dense(6, tanh) -> fn -> Dense(3)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.first = tf_keras.layers.Dense(6, activation="tanh")
        self.second = tf_keras.layers.Dense(3)

    def call(self, x):
        return self.second(self.fn(self.first(x)))


_REFUSED = {
    "batch_mean_inside_a_called_function": (_centered, r"mixes the examples.*inside the function called by op"),
    "unknown_op_rather_than_trusted": (_pair_sums, r"cannot prove that the per-example loss.*UnsortedSegmentSum"),
}


@pytest.mark.parametrize("backend", [FastBackend, _reference_backend], ids=["fast", "reference"])
@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_is_refused(case, backend):
    fn, message = _REFUSED[case]
    x, y = data((4, 5), (4, 3))
    model = _Between(fn)
    model(x[:1])
    with pytest.raises(ValueError, match=message):
        run_traced(backend(), model, x, y, flat_factors(1.0))


def test_a_static_batch_of_one_example_may_use_an_unknown_op():
    x, y = data((1, 5), (1, 3))
    model = _Between(_pair_sums)
    model(x)

    @tf.function(input_signature=[tf.TensorSpec(x.shape), tf.TensorSpec(y.shape)])
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = per_example_loss(model, x, y)
        return FastBackend().clipped_sum(loss, model.trainable_variables, tape, flat_factors(1.0))

    summed, _ = step(x, y)
    with tf.GradientTape() as tape:
        loss = per_example_loss(model, x, y)[0]
    grads = tape.gradient(loss, model.trainable_variables)
    norm = np.sqrt(sum(np.sum(np.square(g)) for g in grads))
    for s, g in zip(summed, grads):
        np.testing.assert_allclose(s, g * min(1.0, 1.0 / norm), rtol=2e-4, atol=2e-6)


def test_a_function_called_in_a_layer_is_analyzed_and_fast():
    x, y = data((4, 5), (4, 3))
    check(_Between(_affine), x, y)  # fast (no fallback) == one-example loop == jacobians


def test_a_loss_without_a_known_input_is_refused():
    x, y = data((4, 5), (4, 3))
    model = dense_mlp()
    model(x[:1])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = per_example_loss(model, tf.constant(x), tf.constant(y))
        return FastBackend().clipped_sum(loss, model.trainable_variables, tape, flat_factors(1.0))

    with pytest.raises(ValueError, match="cannot find the batch"):
        step()


@pytest.mark.parametrize("front", ["tf_keras", "keras3"])
def test_fit_refuses_a_layer_calling_a_mixing_function(front):
    if front == "tf_keras":
        K, kd, loss = tf_keras, keras_dpsgd.tf_keras, {"reduction": "none"}
    else:
        import keras as K

        kd, loss = keras_dpsgd.keras3, {}

    class Centered(K.layers.Layer):
        def call(self, x):
            return _centered(x)

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.integers(0, 2, size=16)
    model = K.Sequential([K.Input((4,)), K.layers.Dense(3), Centered(), K.layers.Dense(2)])
    if front == "keras3":
        kd.make_private(model)
    optimizer = kd.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1)
    model.compile(optimizer, K.losses.SparseCategoricalCrossentropy(from_logits=True, **loss))
    with pytest.raises(ValueError, match="mixes the examples"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)

"""The models of 2026 on Keras 3 TensorFlow (issue 41): silu/swish (a ``tf.custom_gradient``), grouped-query
attention's repeated K/V heads (``keras.ops.repeat``) and token-level losses with the lots' ``[B]`` sample weight.

Each trains one step on the documented path (``make_private`` + ``PoissonLots(...).dataset()``, σ = 0, every example
in the lot) and moves the weights by exactly the clipped per-example gradients of a one-example-at-a-time loop.
Controls that genuinely mix the examples stay refused, with advice that fits what was found (no BatchNormalization
advice for an op that is not batch norm).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dpsgd
from keras_dpsgd import keras3 as k3
from keras_dpsgd.backends.tensorflow import _graph

L = keras.layers
N, CLIP = 6, 0.05


def _silu():
    x = np.random.default_rng(0).normal(size=(N, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(N, 2)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), L.Dense(8, activation="silu"), L.Dense(2, activation="swish")])
    return model, "mse", x, y


def _grouped_query():
    """K/V heads repeated along the heads axis, as Llama and Mistral do."""
    x = np.random.default_rng(2).normal(size=(N, 3, 4)).astype("float32")
    y = np.random.default_rng(3).normal(size=(N, 2)).astype("float32")
    inp = keras.Input((3, 4))
    kv = L.Reshape((3, 2, 2))(L.Dense(4)(inp))  # 2 K/V heads of width 2
    heads = L.Lambda(lambda t: keras.ops.repeat(t, 2, axis=2))(kv)  # 4 query heads
    model = keras.Model(inp, L.Dense(2)(L.Flatten()(heads)))
    return model, "mse", x, y


def _token_level():
    """A causal-LM-like [B, T] loss: the per-example loss is the mean over the example's tokens."""
    gen = np.random.default_rng(4)
    x, y = gen.integers(0, 5, size=(N, 3)), gen.integers(0, 5, size=(N, 3))
    model = keras.Sequential(
        [keras.Input((3,), dtype="int32"), L.Embedding(5, 4), L.Dense(8, activation="silu"), L.Dense(5)]
    )
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y


@pytest.mark.parametrize("make", [_silu, _grouped_query, _token_level], ids=["silu", "gqa-repeat", "token-loss"])
def test_one_private_step_equals_the_loop(make):
    model, loss, x, y = make()
    loss_fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    variables = model.trainable_variables
    before = [v.numpy() for v in variables]
    clipped = [np.zeros_like(b) for b in before]
    for i in range(N):  # One example at a time: its loss is the mean over its own elements (tokens).
        with tf.GradientTape() as tape:
            value = loss_fn(y[i : i + 1], model(x[i : i + 1]))
        grads = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(value, variables)]
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads))
        for c, g in zip(clipped, grads):
            c += min(1.0, CLIP / norm) * g
    lots = keras_dpsgd.PoissonLots(x, y, sampling_rate=1.0, seed=0)
    opt = lots.configure(k3.DPSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=0.0, learning_rate=1.0))
    private = k3.make_private(model)
    private.compile(optimizer=opt, loss=loss)
    private.fit(lots.dataset(), steps_per_epoch=1, epochs=1, verbose=0)
    assert "fast rules" in str(opt.per_example_report)
    for b, c, v in zip(before, clipped, variables):
        np.testing.assert_allclose(b - v.numpy(), c / N, rtol=2e-4, atol=1e-6)


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


def test_tiling_the_batch_axis_by_a_data_dependent_multiple_is_refused():
    def loss(x):
        tiled = tf.tile(x, tf.stack([tf.shape(x)[0], 1, 1]))
        return tf.reduce_sum(tiled[: tf.shape(x)[0]], axis=[1, 2])

    assert "tiles the batch axis by a multiple unknown at trace time" in _refusal(loss)


def test_a_batch_sized_vector_on_a_token_axis_is_refused():
    """[B, T] values times a [B] vector of data broadcast along the token axis pair example j with token j."""
    message = _refusal(lambda x: tf.reduce_sum(x * tf.reduce_sum(x, axis=[1, 2]), axis=[1, 2]), shape=(None, 3, 3))
    assert "broadcasts input" in message and "non-batch axes" in message

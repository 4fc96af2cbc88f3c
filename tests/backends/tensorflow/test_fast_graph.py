"""Fast backend: weight sharing, fallbacks, padding, NaN rows, eager mode (vs loop and reference)."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
from _fast_helpers import (
    Wrap,
    check,
    data,
    dense_mlp,
    flat_factors,
    per_example_loss,
    rng,
    run_traced,
)

from keras_dpsgd.backends.tensorflow import FastBackend
from keras_dpsgd.backends.tensorflow._backend import _reference_backend

L = keras.layers


class ScaledCumsum(L.Layer):
    """A layer using an op the fast path does not know (Cumsum of the weight, which no weight region may hold):
    must fall back."""

    def build(self, input_shape):
        self.w = self.add_weight("w", shape=(int(input_shape[-1]),), initializer="random_normal")

    def call(self, x):
        return x * tf.math.cumsum(self.w)


class Reparam(L.Layer):
    """Kernel reparametrized without data (2·w): the MatMul sees a data-free weight (pulled back
    through the scaling, ``_fast._derived``)."""

    def build(self, input_shape):
        self.k = self.add_weight("k", shape=(int(input_shape[-1]), 3), initializer="random_normal")

    def call(self, x):
        return tf.matmul(x, 2.0 * self.k)


class TiedTranspose(L.Layer):
    """Uses one kernel twice, once transposed (y = tanh(x W) Wᵀ): weight sharing via MatMul."""

    def build(self, input_shape):
        self.k = self.add_weight("k", shape=(int(input_shape[-1]), 5), initializer="random_normal")

    def call(self, x):
        return tf.matmul(tf.tanh(tf.matmul(x, self.k)), self.k, transpose_b=True)


def test_weight_sharing_same_layer_twice():
    shared = L.Dense(5, activation="tanh")
    inp = keras.Input((5,))
    out = L.Dense(2)(shared(shared(inp)))
    x, y = data((4, 5), (4, 2), seed=8)
    check(keras.Model(inp, out), x, y)


def test_weight_sharing_transposed_kernel():
    x, y = data((4, 6), (4, 6), seed=9)
    check(keras.Sequential([TiedTranspose()]), x, y)


def test_shared_embedding_over_two_inputs():
    emb = L.Embedding(7, 3)
    a, b = keras.Input((4,), dtype="int32"), keras.Input((2,), dtype="int32")
    merged = L.Concatenate(axis=1)([emb(a), emb(b)])
    model = keras.Model([a, b], L.Dense(2)(L.Flatten()(merged)))
    gen = rng(10)
    xa = gen.integers(0, 7, size=(3, 6)).astype("int32")
    y = gen.normal(size=(3, 2)).astype("float32")

    check(Wrap(model, lambda m, x: m([x[:, :4], x[:, 4:]])), xa, y)


def test_unknown_op_falls_back_for_that_variable_only():
    x, y = data((4, 5), (4, 3), seed=12)
    model = keras.Sequential([ScaledCumsum(), L.Dense(3)])
    model(x[:1])
    check(model, x, y, fallback=[model.layers[0].w])


def test_data_free_reparametrization_is_exact():
    x, y = data((4, 5), (4, 3), seed=13)
    model = keras.Sequential([Reparam()])
    model(x[:1])
    check(model, x, y)


def test_padded_examples_contribute_nothing():
    x, y = data((5, 7), (5, 3), seed=14)
    model = dense_mlp()
    model(x[:1])
    weights = np.array([1, 0, 1, 0, 1], np.float32)
    factors = flat_factors(0.5)
    summed, sq = run_traced(FastBackend(), model, x, y, factors, weights=weights)
    assert np.all(sq[[1, 3]] == 0)
    kept = run_traced(FastBackend(), model, x[[0, 2, 4]], y[[0, 2, 4]], factors)
    for a, b in zip(summed, kept[0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_zero_factor_rows_with_nan_add_exactly_zero():
    x, y = data((4, 7), (4, 3), seed=15)
    x[2, 0] = np.nan
    model = dense_mlp()
    model(x[:1])

    def zero_non_finite(sq):
        ok = tf.math.is_finite(tf.reduce_sum(sq, axis=1, keepdims=True))
        return tf.where(ok, tf.ones_like(sq), tf.zeros_like(sq))

    summed, sq = run_traced(FastBackend(), model, x, y, zero_non_finite)
    assert np.all(np.isfinite([np.sum(s) for s in summed]))
    clean = run_traced(FastBackend(), model, x[[0, 1, 3]], y[[0, 1, 3]], zero_non_finite)
    for a, b in zip(summed, clean[0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_unused_variable_has_zero_norm_and_sum():
    inp = keras.Input((4,))
    used = L.Dense(2)(inp)
    unused = L.Dense(3)(inp)
    model = keras.Model(inp, [used, unused])

    wrapper = Wrap(model, lambda m, x: m(x)[0])
    x, y = data((3, 4), (3, 2), seed=16)
    summed, sq = check(wrapper, x, y)
    assert np.all(sq[:, 2:] == 0) and all(np.all(s == 0) for s in summed[2:])


@pytest.mark.parametrize("backend", [FastBackend, _reference_backend], ids=["fast", "reference"])
def test_eager_mode_is_refused(backend):
    """No graph to check (mixing, batch statistics in variables): an eager step is refused."""
    x, y = data((3, 7), (3, 3), seed=17)
    model = dense_mlp()
    model(x[:1])
    with tf.GradientTape() as tape:
        loss = per_example_loss(model, x, y)
    with pytest.raises(ValueError, match="refuses to run a DP-SGD step eagerly"):
        backend().clipped_sum(loss, model.trainable_variables, tape, flat_factors(0.3))


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="var_list"):
        FastBackend().clipped_sum(tf.zeros([2]), [], None, flat_factors(1.0))


def test_tiny_transformer_block_has_no_fallback():
    tokens = keras.Input((6,), dtype="int32")
    h = L.Embedding(9, 8)(tokens)
    h = L.LayerNormalization()(h + L.MultiHeadAttention(num_heads=2, key_dim=4)(h, h))
    out = L.Dense(2)(L.GlobalAveragePooling1D()(h))
    gen = rng(20)
    x = gen.integers(0, 9, size=(3, 6)).astype("int32")
    y = gen.normal(size=(3, 2)).astype("float32")
    check(keras.Model(tokens, out), x, y)


class BatchMeanShift(L.Layer):
    """Mixes examples (x minus the batch mean): layers after it must not use ghost norms."""

    def call(self, x):
        return x - tf.reduce_mean(x, axis=0, keepdims=True)


def test_cross_example_mixing_is_refused_naming_the_layer():
    # No backend can make a model private when one example moves the others' losses.
    x, y = data((4, 5), (4, 2), seed=21)
    model = keras.Sequential([keras.Input((5,)), L.Dense(3), BatchMeanShift(), L.Dense(2)])
    model(x[:1])
    for backend in (FastBackend(), _reference_backend()):
        with pytest.raises(ValueError, match="batch_mean_shift.*reduces over the batch axis"):
            run_traced(backend, model, x, y, flat_factors(1.0))


class GatheredReshape(L.Layer):
    """Reshapes [B, 3, 2] to [B/2, 3, 2, 2] with the shape taken from tf.shape(x) (GatherV2): two
    examples share each row (then sums them to [B/2, 1])."""

    def call(self, x):
        rows = tf.reshape(x, tf.concat([[-1], tf.gather(tf.shape(x), [1, 2, 2])], 0))
        return tf.reduce_sum(rows, axis=[1, 2, 3])[:, None]


def test_a_reshape_whose_shape_comes_from_gathered_dims_is_checked_at_trace_time():
    # TensorFlow's shape inference leaves [?, ?, ?, ?] here; the analysis reads the gathered dims
    # (as in tf.tensordot) and finds rows of two examples: refused before the step runs.
    x, y = data((4, 3, 2), (2, 2), seed=22)
    model = keras.Sequential([keras.Input((3, 2)), GatheredReshape(name="gathered"), L.Dense(2)])
    with pytest.raises(ValueError, match="gathered.*puts values of several examples into one row"):
        run_traced(FastBackend(), model, x, y, flat_factors(1.0))


def test_an_empty_batch_adds_zeros_of_the_variables_shapes():
    # A replica without data gets tf.distribute's empty dummy batch (MultiWorkerMirroredStrategy):
    # its sums must have the variables' shapes for the cross-replica SUM (pfor's had other shapes).
    x, y = data((3, 5), (3, 3), seed=23)
    model = dense_mlp()
    model(x[:1])
    for backend in (FastBackend(), _reference_backend()):
        summed, sq = run_traced(backend, model, x[:0], y[:0], flat_factors(1.0))
        assert sq.shape == (0, 4), backend
        assert [s.shape for s in summed] == [tuple(v.shape) for v in model.trainable_variables], backend
        assert all(np.all(s == 0) for s in summed), backend

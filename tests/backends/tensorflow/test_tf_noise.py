"""The TensorFlow backend's noise source over the core's sampler: shapes (static and traced), dtypes, the scale."""

import numpy as np
import pytest
import tensorflow as tf

from keras_dpsgd.backends.tensorflow import ops


@pytest.mark.parametrize("shape", [[], [0], [1], [3, 5, 2]])
def test_shapes_and_dtypes(shape):
    seed = tf.constant([5, 6], tf.int64)
    z = ops.standard_normal(shape, seed, tf.float64)
    assert z.shape == tuple(shape) and z.dtype == tf.float64
    traced = tf.function(lambda s: ops.standard_normal(tf.constant(shape, tf.int32), s))
    np.testing.assert_allclose(traced(seed).numpy(), z.numpy(), rtol=1e-6)


def test_add_gaussian_is_the_standard_normal_times_stddev():
    x = tf.fill([30, 50], 2.0)
    key = tf.constant([1, 9], tf.int64)
    out = ops.add_gaussian(x, tf.constant(3.0), key).numpy()
    same = ops.standard_normal([30 * 50], key).numpy()
    np.testing.assert_allclose((out.ravel() - 2.0) / 3.0, same, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ops.add_gaussian(x, 0.0, key).numpy(), x.numpy())

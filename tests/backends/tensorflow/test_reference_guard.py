"""The reference path's run-time checks: pfor jacobians against a plain backward pass, and every
run-time check under XLA (which ignores ``Assert`` ops: there a failed check drops the batch).

A grouped convolution built in a custom layer (no ``groups`` attribute, run as an XLA call the way
Keras runs ``Conv2D(groups=G)``) passes both grouped-convolution refusals; pfor gets its
per-example gradients wrong, and the jacobian check must trip.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
from _fast_helpers import data, per_example_loss

from keras_dpsgd.backends.tensorflow import ReferenceBackend
from keras_dpsgd.backends.tensorflow.ops import TF_OPS
from keras_dpsgd.dp.clip import clip_factors, clip_groups


class _HiddenGroupedConv(keras.layers.Layer):
    """A 3x3 convolution of 4 channels in 2 groups, compiled with XLA (CPU has no grouped kernel)."""

    def build(self, input_shape):
        self.kernel = self.add_weight("kernel", shape=(3, 3, 2, 4))
        self._conv = tf.function(lambda x, k: tf.nn.conv2d(x, k, 1, "VALID"), jit_compile=True)

    def call(self, x):
        return self._conv(x, self.kernel)


def _grouped_model():
    return keras.Sequential(
        [keras.Input((5, 5, 4)), _HiddenGroupedConv(), keras.layers.Flatten(), keras.layers.Dense(2)]
    )


def _sanitizer_factors(sq_norms):
    """The sanitizer's flat clipping (C = 1): factor 0 for an example with a non-finite norm."""
    return clip_factors(TF_OPS, sq_norms, tf.constant([1.0]), clip_groups(sq_norms.shape[1], per_layer=False))


def _step(backend, model, jit_compile=False, x_spec=None):
    @tf.function(jit_compile=jit_compile, input_signature=x_spec)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = per_example_loss(model, x, y)
        return backend.clipped_sum(loss, model.trainable_variables, tape, _sanitizer_factors)

    return step


def test_the_jacobian_check_trips_on_a_hidden_grouped_convolution():
    x, y = data((3, 5, 5, 4), (3, 2), seed=8)
    model = _grouped_model()
    model(x[:1])
    # The step stops either at our run-time check or, on machines where pfor fails outright on the grouped
    # kernel, at pfor's own error; never with a result (both stop the step before any update).
    pattern = r"pfor jacobian\) of variable .*kernel|filter_size does not have enough elements"
    with pytest.raises(tf.errors.InvalidArgumentError, match=pattern):
        _step(ReferenceBackend(), model)(x, y)


def test_the_jacobian_check_passes_on_a_plain_model():
    """Dense and Conv2D: the check holds and the reference path equals the one-example loop."""
    from _fast_helpers import loop_oracle

    model = keras.Sequential(
        [keras.Input((5, 5, 2)), keras.layers.Conv2D(3, 3), keras.layers.Flatten(), keras.layers.Dense(2)]
    )
    x, y = data((3, 5, 5, 2), (3, 2), seed=3)
    model(x[:1])
    summed, sq_norms = _step(ReferenceBackend(), model)(x, y)
    want_summed, want_sq = loop_oracle(model, x, y, _sanitizer_factors)
    np.testing.assert_allclose(sq_norms.numpy(), want_sq, rtol=2e-4, atol=2e-5)
    for s, w in zip(summed, want_summed):
        np.testing.assert_allclose(s.numpy(), w, rtol=2e-4, atol=2e-5)


def test_under_xla_a_failed_jacobian_check_drops_the_batch():
    x, y = data((3, 5, 5, 4), (3, 2), seed=8)
    model = _grouped_model()
    model(x[:1])
    summed, sq_norms = _step(ReferenceBackend(), model, jit_compile=True)(x, y)
    assert np.all(np.isnan(sq_norms.numpy()))
    assert all(np.all(s.numpy() == 0) for s in summed)

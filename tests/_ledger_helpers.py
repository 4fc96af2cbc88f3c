"""Stand-ins shared by the ledger and callback tests: they exercise the ledger without the sanitizer."""

import tensorflow as tf
import tf_keras as keras

from keras_dpsgd.ledger import assume_poisson


class FakeDPOptimizer(keras.optimizers.SGD):
    """SGD with the DP optimizer's ledger-facing attributes (contracts.md), to test the ledger alone."""

    def __init__(self, noise_multiplier=1.0, sampling_rate=None, expected_lot_size=None, **kwargs):
        super().__init__(learning_rate=0.01, **kwargs)
        self.effective_noise_multiplier = noise_multiplier
        self.sampling_rate = sampling_rate
        self.expected_lot_size = expected_lot_size
        self.gradient_accumulation_steps = 1
        with tf.init_scope():
            self.noised_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="noised_steps")
        if sampling_rate is not None:  # the ledger's tests feed fixed batches that stand for Poisson lots at q
            assume_poisson(self)

    def apply_gradients(self, grads_and_vars, **kwargs):
        result = super().apply_gradients(grads_and_vars, **kwargs)
        self.noised_steps.assign_add(1)
        return result


class EventLayer(keras.layers.Layer):
    """A layer that declares a data access, like DP-PCA after adapt."""

    def __init__(self, events=(), **kwargs):
        super().__init__(**kwargs)
        self._events = tuple(events)

    @property
    def privacy_events(self):
        return self._events

    def call(self, x):
        return x

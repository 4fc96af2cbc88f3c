"""What is not built on JAX is refused by name, before any weight changes.

The refusals JAX and torch share are tests/_backend_refusals.py's (collected here); below, JAX's own.
"""

import keras
import pytest

import keras_dpsgd.keras3 as k3
from tests._backend_refusals import *  # noqa: F403 (the refusals JAX and torch share, collected here)


def test_own_train_step_is_refused():
    class Own(keras.Model):
        def train_step(self, state, data):
            raise AssertionError

    with pytest.raises(ValueError, match="overrides train_step, which Keras's train step on the jax backend"):
        k3.make_private(Own())  # the hooks of Keras's step: tests/backends/jax/test_jax_hooks.py

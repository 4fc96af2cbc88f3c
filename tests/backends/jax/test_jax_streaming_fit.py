"""Issue 40, item 5 on Keras 3 with the JAX backend: the checks of tests/step/test_streaming_fit.py, the JAX front.

Streamed Poisson lots (a tf.data stream, memory-mapped .npy shards) feed the stateless JAX step; the ledger's ε
after k lots is the in-memory sampler's.
"""

import keras
import pytest

from tests._behaviour import keras3_front
from tests.step.test_streaming_fit import *  # noqa: F403 (the checks, collected here)


@pytest.fixture(scope="module")
def front():
    assert keras.config.backend() == "jax"
    return keras3_front()

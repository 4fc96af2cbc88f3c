"""The behavioural suite (tests/test_behaviour.py) on Keras 3 with the JAX backend: the same checks, the JAX front.

Every check of tests/test_behaviour.py is imported and collected here, in the JAX suite's one
process, with the ``front`` fixture replaced by the Keras 3 front of this process (JAX); the oracle
is the same one-example loop (tests/_keras3_helpers.py, ``jax.grad`` of a batch of one on JAX).
"""

import keras
import pytest

from tests._behaviour import keras3_front
from tests.test_behaviour import *  # noqa: F403 (the checks, collected here)


@pytest.fixture(scope="module")
def front():
    assert keras.config.backend() == "jax"
    return keras3_front()

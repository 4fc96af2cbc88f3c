"""ε of a DP-trained model whose DP optimizer is out of sight (tests/ledger/test_lost_dp_optimizer.py) on Keras 3
with the JAX backend: the same checks (its ``__all__``), the JAX front."""

import keras
import pytest

from tests._behaviour import keras3_front
from tests.ledger.test_lost_dp_optimizer import *  # noqa: F403 (the checks, collected here)


@pytest.fixture(scope="module")
def front():
    assert keras.config.backend() == "jax"
    return keras3_front()

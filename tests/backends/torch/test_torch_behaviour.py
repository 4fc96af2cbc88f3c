"""The behavioural suite (tests/test_behaviour.py) on Keras 3 with the torch backend: the same checks, the torch front.

Every check of tests/test_behaviour.py is imported and collected here, in the torch suite's one process, with
the ``front`` fixture replaced by the Keras 3 front of this process (torch); the oracle is the same one-example
loop (tests/_keras3_helpers.py, ``torch.autograd.grad`` of a batch of one on torch).
"""

import keras
import pytest

from tests._behaviour import keras3_front
from tests.test_behaviour import *  # noqa: F403 (the checks, collected here)


@pytest.fixture(scope="module")
def front():
    assert keras.config.backend() == "torch"
    return keras3_front()

"""ε of a DP-trained model whose DP optimizer is out of sight (tests/ledger/test_lost_dp_optimizer.py) on Keras 3
with the torch backend: the same checks, the torch front."""

import keras
import pytest

from tests._behaviour import keras3_front
from tests.ledger.test_lost_dp_optimizer import (  # noqa: F401 (the checks, collected here)
    test_a_fresh_model_without_a_dp_optimizer_is_refused_unless_untrained,
    test_compiled_again_with_a_plain_optimizer_keeps_the_dp_history_then_infinity,
    test_load_then_compiled_again_before_any_read_keeps_the_history,
    test_loaded_with_compile_false_is_refused_not_zero,
)


@pytest.fixture(scope="module")
def front():
    assert keras.config.backend() == "torch"
    return keras3_front()

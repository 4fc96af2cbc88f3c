"""The models of 2026 (issue 41) on Keras 3 JAX: silu/swish, ``keras.ops.repeat`` K/V heads and a token-level
``[B, T]`` loss with the lots' ``[B]`` sample weight (Keras's own build of the compiled loss paired that weight with
the tokens and failed) train on ``PoissonLots`` and equal the one-example loop (``tests/_models_2026.py``)."""

import pytest

from tests._models_2026 import MODELS, check_one_private_step


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_private_step_equals_the_loop(name):
    check_one_private_step(name)

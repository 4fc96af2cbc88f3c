"""The models of 2026 (issue 41) on Keras 3 JAX: silu/swish, ``keras.ops.repeat`` K/V heads and a token-level
``[B, T]`` loss with the lots' ``[B]`` sample weight (Keras's own build of the compiled loss paired that weight with
the tokens and failed) train on ``PoissonLots`` and equal the one-example loop (``tests/_models_2026.py``); so does PReLU (issue 40), by its
own norm rule."""

import pytest

from keras_dpsgd.backends.jax import ghost as _ghost

from tests._models_2026 import MODELS, check_one_private_step


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_private_step_equals_the_loop(name):
    check_one_private_step(name)


@pytest.mark.parametrize("name", ["prelu", "prelu-shared"])
def test_prelu_takes_its_norm_rule(name):
    """PReLU is covered by a rule of its own (its alpha's gradient from the layer's input and output gradient),
    not left to the exact ``jax.vmap`` path of the uncovered variables."""
    model, _, x, _ = MODELS[name]()
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    plan = _ghost.plan(model, trainable, non_trainable, x, {})
    assert plan is not None and plan.uncovered == []
    assert "PReLU" in {type(layer).__name__ for layer in plan.covered}

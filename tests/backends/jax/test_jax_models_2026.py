"""The models of 2026 (issue 41) on Keras 3 JAX: silu/swish, ``keras.ops.repeat`` K/V heads and a token-level
``[B, T]`` loss with the lots' ``[B]`` sample weight (Keras's own build of the compiled loss paired that weight with
the tokens and failed) train on ``PoissonLots`` and equal the one-example loop (``tests/_models_2026.py``); so does PReLU (issue 40), by its
own norm rule."""

import pytest

from keras_dpsgd.backends.jax import ghost as _ghost

from tests._models_2026 import MODELS, VISION, check_one_private_step, efficientnet


@pytest.mark.parametrize("name", sorted(MODELS) + sorted(VISION))
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


def test_efficientnet_with_a_batch_normalization_in_training_mode_is_refused():
    """The top block with its BatchNormalization trainable (training mode: its moving statistics written from the
    batch) is refused when the step is traced, before any weight changes."""
    import numpy as np

    import keras_dpsgd
    from keras_dpsgd import keras3 as k3

    model, loss, x, y = efficientnet(top_block=True)
    model.layers[1].get_layer("top_bn").trainable = True
    before = [np.asarray(v.numpy()) for v in model.trainable_variables]
    lots = keras_dpsgd.PoissonLots(x, y, sampling_rate=1.0, seed=0)
    private = k3.make_private(model)
    private.compile(optimizer=lots.configure(k3.DPSGDOptimizer(1.0, 0.0, learning_rate=1.0)), loss=loss)
    with pytest.raises(ValueError, match=r"(?s)BatchNormalization.*trainable = False"):
        private.fit(lots.dataset(), steps_per_epoch=1, epochs=1, verbose=0)
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, np.asarray(v.numpy()))


@pytest.mark.parametrize(
    "name, covered, uncovered",
    [
        ("vit", {"Conv2D", "Dense", "EinsumDense", "Embedding", "LayerNormalization"}, ["class_token"]),
        ("efficientnet-top-block", {"Conv2D", "DepthwiseConv2D", "Dense"}, []),
    ],
)
def test_vision_models_take_the_norm_rules(name, covered, uncovered):
    """Every trainable layer of the vision models has a norm rule (DepthwiseConv2D included): only ViT's class
    token (a [1, 1, D] weight in keras_hub's own layer) is left to ``jax.vmap``, B·D numbers."""
    model, _, x, _ = VISION[name]()
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    plan = _ghost.plan(model, trainable, non_trainable, x, {"training": True})
    assert {type(layer).__name__ for layer in plan.covered} == covered
    assert [model.trainable_variables[j].path.split("/")[-1] for j in plan.uncovered] == uncovered

"""Ghost norms on torch (``keras_dpsgd.backends.torch.ghost``): which layers take them, and exact steps.

Every step is checked against the one-example loop of ``tests._keras3_helpers`` (torch.autograd on a batch of
one, clipped in numpy; σ = 0). The models are the JAX ghost tests' (tests/_ghost_models.py).
"""

import logging

import keras
import numpy as np
import pytest

from keras_dpsgd.backends.torch import ghost
from keras_dpsgd.keras3 import _torch_train_step
from tests._behaviour import built
from tests._ghost_models import assert_layer_norm_taps, ghost_model, per_layer_clip
from tests._keras3_helpers import loop_clipped_mean, weight_reading_loss_case
from tests._step_checks import FRONT, LR, assert_clipped_step, assert_step, compiled


def _covered(model):
    plan = model.__dict__.get(_torch_train_step._PLAN_ATTR, (None, ghost.plan(model, per_example=True)))[1]
    return set() if plan is None else {type(layer).__name__ for layer, _ in plan.layers}


def test_plan_covers_the_layers_with_rules_and_names_the_rest(caplog, monkeypatch):
    monkeypatch.setattr(ghost, "_ANNOUNCED", set())  # announced once per process: maybe by an earlier test
    model, _, _ = built(FRONT, "transformer")
    assert _covered(model) == {"EinsumDense", "Dense", "LayerNormalization"}
    model, _, _ = built(FRONT, "lstm")
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        assert _covered(model) == {"Dense"}
    assert "(LSTMCell)" in caplog.text and "torch.func.vmap" in caplog.text


def test_sequence_model_per_layer_clipped_step_matches_loop():
    model, x, y = ghost_model("sequence")
    assert _covered(model) == {"Embedding", "Conv1D", "Dense"}
    assert_clipped_step(model, x, y, per_layer_clip(model), per_layer=True)
    assert _covered(model) == {"Embedding", "Conv1D", "Dense"}  # the step's read watch uncovered none


def test_layer_normalization_in_each_form_per_layer_clipped_step_matches_loop():
    """gamma and beta, RMS scaling, no centering, no scale (the normalized rows tapped once in the forward pass), and
    an axis other than the last (the layer's own call): each variable clipped to its own bound, as the loop."""
    model, x, y = ghost_model("layer_norm")
    assert_layer_norm_taps(model, x)
    assert _covered(model) == {"Dense", "LayerNormalization"}
    assert_clipped_step(model, x, y, per_layer_clip(model), per_layer=True)


def test_lora_dense_and_einsum_dense_flat_clipped_step_matches_loop():
    model, x, y = ghost_model("lora")
    assert _covered(model) == {"Dense", "EinsumDense"}
    assert_clipped_step(model, x, y, 0.3)


@pytest.mark.parametrize("case", ["tied", "weight_reading_loss"])
def test_a_variable_read_outside_its_layer_is_uncovered_by_name_and_the_step_stays_exact(case, caplog, monkeypatch):
    """A tied kernel, or a compiled loss that reads a kernel: a rule on the Dense's call alone would miss that
    use; the step sees it (∂ℓ/∂s ≠ 0), recomputes with that layer on the vmap path (named), and is exact."""
    monkeypatch.setattr(ghost, "_ANNOUNCED", set())
    if case == "tied":
        model, x, y = ghost_model("tied")
        compiled(model, l2_norm_clip=0.3)
        expected = loop_clipped_mean(model, x, y, FRONT.loss(), 0.3)
        read = model.layers[1]
    else:
        model, x, y, loss, clip, expected = weight_reading_loss_case(keras)
        FRONT.private(model)
        model.compile(
            optimizer=FRONT.optimizer_cls(l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=LR), loss=loss
        )
        read = model.layers[0]
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        assert_step(model, x, y, expected)
    assert f"{read.name} (Dense)" in caplog.text and "read outside its own call" in caplog.text
    plan = model.__dict__[_torch_train_step._PLAN_ATTR][1]
    assert read not in [layer for layer, _ in plan.layers] and len(plan.layers) >= 1


def test_normalization_and_a_nonfinite_example_on_a_convolution():
    model, x, y = built(FRONT, "conv2d")
    compiled(model, l2_norm_clip=None, clipping="normalize", stability=0.05)
    x = x.copy()
    x[1, 0, 0, 0] = np.inf
    keep = np.arange(len(x)) != 1
    expected = loop_clipped_mean(model, x[keep], y[keep], FRONT.loss(), 1.0, stability=0.05)
    assert_step(model, x, y, [g * (keep.sum() / len(x)) for g in expected])
    assert int(model.optimizer.nonfinite_examples.numpy()) == 1


def test_auto_equals_reference_with_accumulation():
    """k = 2 batches of the transformer block: the released lot is the same on the ghost and the vmap path."""
    updates = []
    for backend in ("auto", "reference"):
        model, x, y = built(FRONT, "transformer")
        compiled(model, l2_norm_clip=0.2, gradient_accumulation_steps=2, per_example_backend=backend)
        x, y = np.concatenate([x, x[::-1]]), np.concatenate([y, y[::-1]])
        before = [v.numpy().copy() for v in model.trainable_variables]
        model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
        updates.append([b - v.numpy() for b, v in zip(before, model.trainable_variables)])
        assert int(model.optimizer.noised_steps.numpy()) == 1
    for a, r in zip(*updates):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-7)


def test_perturbation_grads_are_each_examples_own():
    """The ghost path's backward pass (autograd over the vmapped forward, ``perturbation_grads``) gives
    ``torch.func.grad``'s per-example gradients under vmap (``per_example_grads``); an example whose loss is NaN
    keeps its NaN to itself (no operation of the backward pass sums over the batch)."""
    import torch

    from keras_dpsgd.backends.torch import per_example_grads, perturbation_grads

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, generator=gen)
    x = torch.randn(7, 5, generator=gen)
    x[2, 0] = float("nan")

    def loss_of_one(zs, xi):
        pre = xi @ w + zs[0]
        return torch.sum(torch.tanh(pre) ** 2) + torch.sum(zs[1] * pre[:2]), ((pre,), ())

    zeros = [torch.zeros(3), torch.zeros(2)]
    want, (want_aux, _) = per_example_grads(loss_of_one, zeros, x)
    got, (got_aux, _) = perturbation_grads(loss_of_one, zeros, x)
    for g, e in zip(got, want):
        assert g.shape == (7,) + e.shape[1:]
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6, atol=1e-7)
        assert np.isnan(g[2].numpy()).all() and np.isfinite(np.delete(g.numpy(), 2, axis=0)).all()
    np.testing.assert_array_equal(got_aux[0].numpy(), want_aux[0].numpy())
    assert not got_aux[0].requires_grad

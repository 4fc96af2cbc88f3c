"""Convolutions' per-example gradients and norms on JAX from the unfolded input (``keras_dpsgd.backends.jax._conv``).

Each layer's closed forms (the materialized gradients of ``Rule.grads``, the Gram norm of ``Rule.sq_norms``) are
checked against the vector-Jacobian product of each example (``jax.vmap`` of ``jax.vjp`` of the layer's own
pre-activation: the rules' fallback) over strides, dilations, SAME/VALID padding, ranks 1-3, depthwise multipliers
and a layer called twice; a model of them takes one step equal to the one-example loop (σ = 0).
"""

import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_dpsgd.backends import _layer_forms as _forms
from keras_dpsgd.backends.jax import _rules, ghost as _ghost
from tests._behaviour import keras3_front
from tests._keras3_helpers import loop_clipped_mean, one_sgd_step

L = keras.layers
B = 3

# (layer, input shape of one example)
CASES = {
    "conv2d-same-stride2": (lambda: L.Conv2D(4, 3, strides=2, padding="same"), (7, 6, 2)),
    "conv2d-valid-dilated": (lambda: L.Conv2D(3, (2, 3), dilation_rate=2, padding="valid"), (7, 8, 2)),
    "conv2d-same-stride-odd": (lambda: L.Conv2D(2, (3, 2), strides=(3, 2), padding="same", use_bias=False), (8, 7, 3)),
    "conv1d-same": (lambda: L.Conv1D(3, 4, strides=2, padding="same"), (9, 2)),
    "conv3d-valid": (lambda: L.Conv3D(2, 2, strides=(1, 2, 1), padding="valid"), (3, 5, 4, 2)),
    "depthwise2d-same-stride2": (
        lambda: L.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2),
        (7, 6, 3),
    ),
    "depthwise2d-valid-dilated": (lambda: L.DepthwiseConv2D((3, 2), dilation_rate=(1, 2), use_bias=False), (6, 7, 2)),
    "depthwise1d-same": (lambda: L.DepthwiseConv1D(3, padding="same", depth_multiplier=3), (6, 2)),
}


def _calls(layer, shape, times, rng):
    """(input [B, 1, ...], output gradient [B, 1, ...]) for `times` calls of `layer` (float32 data)."""
    calls = []
    for _ in range(times):
        a = rng.normal(size=(B, 1) + shape).astype("float32")
        out = layer.compute_output_shape((1,) + shape)
        calls.append((jnp.asarray(a), jnp.asarray(rng.normal(size=(B,) + tuple(out)).astype("float32"))))
    return calls


@pytest.mark.parametrize("times", [1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_unfolded_gradients_equal_each_examples_vector_jacobian_product(name, times):
    make, shape = CASES[name]
    layer = make()
    layer.build((None,) + shape)
    calls = _calls(layer, shape, times, np.random.default_rng(len(name) + times))
    rule, variables = _rules.rule_for(layer), layer.trainable_variables
    values = {id(v): v.value for v in layer.variables}
    closed = rule.grads(layer, calls, variables)
    assert closed is not None
    vjp_only = _forms.DepthwiseConvForm() if name.startswith("depthwise") else _forms.ConvForm()  # grads(): None
    fallback = _rules.per_example_grads(layer, vjp_only, calls, values, variables)
    for got, want in zip(closed, fallback):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _numpy_conv2d_grads(a, d, stride, pads, kernel):
    """float64 per-example kernel gradients of a Conv2D from its definition: Σ_t x[t·stride + (r, s)]ᵀ δ_t."""
    x = np.pad(a.astype(np.float64), [(0, 0), pads[0], pads[1], (0, 0)])
    out = np.zeros((a.shape[0], kernel[0], kernel[1], a.shape[3], d.shape[3]))
    for r in range(kernel[0]):
        for s in range(kernel[1]):
            window = x[:, r : r + stride * d.shape[1] : stride, s : s + stride * d.shape[2] : stride]
            out[:, r, s] = np.einsum("bhwc,bhwo->bco", window, d.astype(np.float64))
    return out


def test_a_conv_with_few_positions_takes_the_gram_norm_a_certified_upper_bound():
    """A 2x2 output of a 3x3x3 -> 16 kernel (T(K + O) = 172 < K·O = 432): the Gram norm over the patches, an upper
    bound of the float64 norm of each example's gradient (from the convolution's definition), within its rounding
    margin; the bias's too."""
    layer = L.Conv2D(16, 3, strides=2, padding="same")
    layer.build((None, 4, 4, 3))
    calls = _calls(layer, (4, 4, 3), 1, np.random.default_rng(0))
    sq = _rules.rule_for(layer).sq_norms(layer, calls, layer.trainable_variables)
    assert sq is not None
    a, d = (np.asarray(t)[:, 0] for t in calls[0])
    kernel = _numpy_conv2d_grads(a, d, 2, [(0, 1), (0, 1)], (3, 3))  # SAME: 4 -> 2, the extra row after
    bias = np.sum(d.astype(np.float64), axis=(1, 2))
    for v, g in ((layer._kernel, kernel), (layer.bias, bias)):
        true = np.sum(g.reshape(B, -1) ** 2, axis=1)
        got = np.asarray(sq[id(v)], np.float64)
        assert (got >= true).all() and (got <= true * (1 + 1e-4) + 1e-6).all()


def test_the_plan_covers_depthwise_convolutions():
    """DepthwiseConv2D (EfficientNet, MobileNet) takes its rule instead of jax.vmap of the whole model."""
    model = keras.Sequential([keras.Input((6, 6, 2)), L.DepthwiseConv2D(3), L.Flatten(), L.Dense(2)])
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    plan = _ghost.plan(model, trainable, non_trainable, np.zeros((2, 6, 6, 2), "float32"), {})
    assert plan is not None and plan.uncovered == []
    assert {type(layer).__name__ for layer in plan.covered} == {"DepthwiseConv2D", "Dense"}


def test_a_convolutional_step_equals_the_loop():
    """Conv2D (dilated, SAME), DepthwiseConv2D (stride 2, multiplier 2), a 1x1 Conv2D called twice (one gradient
    of two calls): one private step (σ = 0) moves the weights by the loop's clipped mean."""
    keras.utils.set_random_seed(3)
    shared = L.Conv2D(4, 1, activation="relu")
    images = keras.Input((8, 8, 2))
    h = L.Conv2D(4, 3, dilation_rate=2, padding="same", activation="swish")(images)
    h = L.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2, activation="relu")(h)
    h = shared(L.Conv2D(4, 1)(h)) + shared(h[..., :4])
    model = keras.Model(images, L.Dense(3)(L.GlobalAveragePooling2D()(h)))
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(5, 8, 8, 2)).astype("float32"), rng.integers(0, 3, size=5)
    front = keras3_front()
    front.compiled(model, l2_norm_clip=0.2, learning_rate=0.5)
    expected = loop_clipped_mean(model, x, y, front.loss(), 0.2)
    before, after = one_sgd_step(model, x, y, 0.5)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / 0.5, g, rtol=2e-4, atol=2e-6)

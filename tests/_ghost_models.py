"""The small models of the ghost-norm tests that the JAX and torch suites share (tests/backends/*/test_*_ghost.py).

Each is built with seeds fixed, from ``ghost_model(name)``: (model, x, y). The models are small so that the suites
stay fast.
"""

import keras
import numpy as np


def _sequence(rng):
    """Embedding with repeated ids (Gram form: T² < V), a causal Conv1D (the vector-Jacobian product: causal, no
    patch form), a Dense on the sequence in the Gram form (16 -> 16, T = 6) and one in the direct form (16 -> 2),
    called twice (a shared layer: two calls, one gradient)."""
    ids = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(50, 16)(ids)
    h = keras.layers.Conv1D(16, 2, padding="causal")(h)
    h = keras.layers.Dense(16, activation="tanh")(h)
    shared = keras.layers.Dense(2)
    h = keras.layers.Concatenate()([shared(h), shared(h * 0.5)])
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(h))
    return keras.Model(ids, outputs), rng.integers(0, 4, size=(5, 6)).astype("int32")  # few ids: repeats


def _lora(rng):
    """A Dense and an EinsumDense, both with LoRA (B drawn: it is 0 at init), and a plain Dense."""
    dense = keras.layers.Dense(6, activation="relu")
    einsum = keras.layers.EinsumDense("ab,bc->ac", output_shape=4, bias_axes="c")
    model = keras.Sequential([keras.Input((5,)), dense, einsum, keras.layers.Dense(3)])
    for layer in (dense, einsum):
        layer.enable_lora(2)
        layer.lora_kernel_b.assign(rng.normal(size=layer.lora_kernel_b.shape).astype("float32"))
    return model, rng.normal(size=(6, 5)).astype("float32")


class _TiedOutput(keras.layers.Layer):
    """Reads another layer's kernel (weight tying): that use's gradient is outside the Dense's call."""

    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.dense.kernel))


def _tied(rng):
    """Dense (no bias) -> Dense -> the first Dense's kernel transposed (model.layers[1] is the tied Dense)."""
    dense = keras.layers.Dense(4, use_bias=False)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh")(dense(inputs))
    return keras.Model(inputs, _TiedOutput(dense)(h)), rng.normal(size=(5, 3)).astype("float32")


LAYER_NORMS = (
    {},  # gamma and beta
    {"rms_scaling": True},  # gamma only, no centering
    {"center": False},
    {"scale": False},
    {"axis": [1, 2]},  # not the last axis alone: the layer's own call, affine in gamma and beta given its input
)


def _layer_norm(rng):
    """LayerNormalization in each form of LAYER_NORMS on rows [B, 4, 6] between Dense layers, gamma and beta drawn
    (not 1 and 0), a row of one example large (its normalized rows are not its input)."""
    inputs = keras.Input((4, 6))
    h = keras.layers.Dense(6)(inputs)
    for kwargs in LAYER_NORMS:
        h = keras.layers.LayerNormalization(**kwargs)(keras.layers.Dense(6, activation="tanh")(h))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    for layer in model.layers:
        if isinstance(layer, keras.layers.LayerNormalization):
            for v in layer.trainable_variables:
                v.assign(rng.normal(1.0 if v is layer.gamma else 0.0, 0.5, size=v.shape).astype("float32"))
    x = rng.normal(size=(5, 4, 6)).astype("float32")
    x[2, 1] *= 40.0
    return model, x


def assert_layer_norm_taps(model, x):
    """Each LayerNormalization of a "layer_norm" model: the rule's ``pre(tap(h))`` is the layer's own output on its
    input h (float32 rounding), and the tap is the normalized rows except where the axis is not the last."""
    from keras_dpsgd.backends._layer_forms import LayerNormForm

    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.LayerNormalization)]
    inputs = keras.Model(model.inputs, [layer.input for layer in norms])(x)
    rule = LayerNormForm()
    for layer, h, kwargs in zip(norms, inputs, LAYER_NORMS):
        tapped = rule.tap(layer, h)
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(rule.pre(layer, tapped)),
            keras.ops.convert_to_numpy(layer(h)),
            rtol=1e-5,
            atol=1e-5,
        )
        assert (tapped is h) == ("axis" in kwargs), kwargs


def ghost_model(name: str):
    """(model, x, y) of "sequence", "lora", "tied" or "layer_norm", 3 classes."""
    rng = np.random.default_rng(1)
    keras.utils.set_random_seed(1)
    model, x = {"sequence": _sequence, "lora": _lora, "tied": _tied, "layer_norm": _layer_norm}[name](rng)
    return model, x, rng.integers(0, 3, size=len(x))


def per_layer_clip(model) -> list[float]:
    """One bound per trainable variable, drawn in [0.05, 0.5] with a fixed seed."""
    return [float(c) for c in np.random.default_rng(5).uniform(0.05, 0.5, size=len(model.trainable_variables))]

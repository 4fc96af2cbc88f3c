"""The models of 2026 (issue 41), tiny, for both Keras 3 backends: PReLU (issue 40), silu/swish, grouped-query attention's repeated
K/V heads (``keras.ops.repeat``), a token-level ``[B, T]`` loss, and the vision models (``VISION``: keras_hub's ViT,
EfficientNetB0 frozen and with its top block trainable), each trained one private step on the
documented path (``make_private`` + ``PoissonLots(...).dataset()``, σ = 0, every example in the lot) and
compared with the clipped mean of a one-example-at-a-time loop (``tests/_keras3_helpers.loop_clipped_mean``).
"""

import keras
import numpy as np

import keras_dpsgd
from keras_dpsgd import keras3 as k3
from tests._keras3_helpers import loop_clipped_mean

L = keras.layers
N, CLIP = 6, 0.05


def silu():
    gen = np.random.default_rng(0)
    x, y = gen.normal(size=(N, 4)).astype("float32"), gen.normal(size=(N, 2)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), L.Dense(8, activation="silu"), L.Dense(2, activation="swish")])
    return model, keras.losses.MeanSquaredError(), x, y


def grouped_query():
    """K/V heads repeated along the heads axis, as Llama and Mistral do."""
    gen = np.random.default_rng(1)
    x, y = gen.normal(size=(N, 3, 4)).astype("float32"), gen.normal(size=(N, 2)).astype("float32")
    inp = keras.Input((3, 4))
    kv = L.Reshape((3, 2, 2))(L.Dense(4)(inp))  # 2 K/V heads of width 2
    heads = L.Lambda(lambda t: keras.ops.repeat(t, 2, axis=2))(kv)  # 4 query heads
    return keras.Model(inp, L.Dense(2)(L.Flatten()(heads))), keras.losses.MeanSquaredError(), x, y


def token_level():
    """A causal-LM-like [B, T] loss: each example's loss is the mean over its own tokens."""
    gen = np.random.default_rng(2)
    x, y = gen.integers(0, 5, size=(N, 3)), gen.integers(0, 5, size=(N, 3))
    model = keras.Sequential(
        [keras.Input((3,), dtype="int32"), L.Embedding(5, 4), L.Dense(8, activation="silu"), L.Dense(5)]
    )
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y


def _soft_plus(t):
    """softplus with the gradient written by hand, reading back a forward intermediate (``e``)."""
    import tensorflow as tf

    @tf.custom_gradient
    def fn(x):
        e = tf.exp(x)

        def grad(dy):
            return dy * e / (1.0 + e)

        return tf.math.log1p(e), grad

    return fn(t)


def custom_gradient():
    """A layer of the user's own ``tf.custom_gradient`` (TensorFlow only)."""
    gen = np.random.default_rng(3)
    x, y = gen.normal(size=(N, 4)).astype("float32"), gen.normal(size=(N, 2)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), L.Dense(8), L.Lambda(_soft_plus), L.Dense(2)])
    return model, keras.losses.MeanSquaredError(), x, y


class _ClassToken(L.Layer):
    """ViT's class token: a trainable [1, 1, D] weight tiled over the batch and prepended to the sequence."""

    def build(self, input_shape):
        self.token = self.add_weight(shape=(1, 1, input_shape[-1]), initializer="random_normal", name="token")

    def call(self, x):
        batch = keras.ops.shape(x)[0]
        return keras.ops.concatenate([keras.ops.tile(self.token, (batch, 1, 1)), x], axis=1)


def class_token():
    """A weight broadcast over the batch (``keras.ops.tile(token, (B, 1, 1))``), read through a mixing of the
    positions (TensorFlow: the Tile rule; JAX: the layer's variable under ``jax.vmap``, one example per batch)."""
    gen = np.random.default_rng(4)
    x, y = gen.normal(size=(N, 3, 4)).astype("float32"), gen.normal(size=(N, 2)).astype("float32")
    inp = keras.Input((3, 4))
    h = _ClassToken()(L.Dense(4)(inp))
    h = L.Dense(4, activation="tanh")(h + L.GlobalAveragePooling1D(keepdims=True)(h))  # positions mixed per example
    return keras.Model(inp, L.Dense(2)(h[:, 0])), keras.losses.MeanSquaredError(), x, y


def prelu(shared_axes=None):
    """Dense → PReLU: alpha (one per feature, or shared along ``shared_axes``) enters as ``alpha · min(x, 0)``."""
    gen = np.random.default_rng(5)
    x, y = gen.normal(size=(N, 3, 4)).astype("float32"), gen.normal(size=(N, 2)).astype("float32")
    inp = keras.Input((3, 4))
    alpha = keras.initializers.RandomUniform(0.1, 0.4, seed=5)
    h = L.PReLU(alpha_initializer=alpha, shared_axes=shared_axes)(L.Dense(5)(inp))
    return keras.Model(inp, L.Dense(2)(L.Flatten()(h))), keras.losses.MeanSquaredError(), x, y


MODELS = {
    "prelu": prelu,
    "prelu-shared": lambda: prelu(shared_axes=[1]),
    "silu": silu,
    "gqa-repeat": grouped_query,
    "token-loss": token_level,
    "class-token": class_token,
}
TF_MODELS = {**MODELS, "custom-gradient": custom_gradient}


def vit():
    """keras_hub's ViTBackbone, tiny (8x8x3 images, 4x4 patches, one encoder block of width 8): the patches by a
    strided Conv2D, the class token (a weight tiled over the batch), position embeddings, attention, a gelu MLP."""
    import keras_hub

    gen = np.random.default_rng(7)
    x, y = gen.normal(size=(N, 8, 8, 3)).astype("float32"), gen.integers(0, 3, size=(N,))
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16
    )
    images = keras.Input((8, 8, 3))
    model = keras.Model(images, L.Dense(3)(backbone(images)[:, 0]))
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y


_EFFICIENTNET_B0 = []  # (the base, its first weights): built once per process


def _efficientnet_b0():
    """``EfficientNetB0(weights=None)`` on 32x32x3 at its first weights, every layer trainable: built once per process
    and reset from a snapshot of its weights for each caller (on JAX its build compiles one random initializer per
    weight shape, most of the build's 6 s of CPU; a reset is a copy)."""
    if not _EFFICIENTNET_B0:
        keras.utils.set_random_seed(8)
        base = keras.applications.EfficientNetB0(
            weights=None, input_shape=(32, 32, 3), include_top=False, pooling="avg"
        )
        _EFFICIENTNET_B0.append((base, [np.array(v.numpy()) for v in base.weights]))
    base, first = _EFFICIENTNET_B0[0]
    for v, value in zip(base.weights, first):
        v.assign(value)
    base.trainable = True  # every layer's flag, as built
    return base


def efficientnet(top_block: bool):
    """``keras.applications.EfficientNetB0(weights=None)`` on 32x32x3 (DepthwiseConv2D, squeeze-and-excitation's
    broadcast multiply, swish, BatchNormalization) with a Dense head. Frozen (``trainable = False``, called with
    ``training=False``), or with its top block (block7a and the top convolution) trainable and every
    BatchNormalization frozen (``trainable = False``: inference mode, whatever the call's ``training``)."""
    gen = np.random.default_rng(8)
    x, y = gen.normal(size=(N, 32, 32, 3)).astype("float32"), gen.integers(0, 3, size=(N,))
    base = _efficientnet_b0()
    keras.utils.set_random_seed(8)
    images = keras.Input((32, 32, 3))
    if top_block:
        for layer in base.layers:
            top = layer.name.startswith(("block7a_", "top_"))
            layer.trainable = top and not isinstance(layer, L.BatchNormalization)
        features = base(images)
    else:
        base.trainable = False
        features = base(images, training=False)
    model = keras.Model(images, L.Dense(3)(features))
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y


VISION = {
    "vit": vit,
    "efficientnet-frozen": lambda: efficientnet(top_block=False),
    "efficientnet-top-block": lambda: efficientnet(top_block=True),
}


def check_one_private_step(name):
    """One private step of the model `name` moves the weights by the loop's clipped mean (learning rate 1)."""
    return check_private_step(*{**TF_MODELS, **VISION}[name]())


def check_private_step(model, loss, x, y):
    """One private step of `model` on ``PoissonLots`` (σ = 0, every example) moves the weights by the loop's clipped
    mean (learning rate 1); returns the optimizer."""
    expected = loop_clipped_mean(model, x, y, loss, CLIP)
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    lots = keras_dpsgd.PoissonLots(x, y, sampling_rate=1.0, seed=0)
    opt = lots.configure(k3.DPSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=0.0, learning_rate=1.0))
    private = k3.make_private(model)
    private.compile(optimizer=opt, loss=loss)
    private.fit(lots.dataset(), steps_per_epoch=1, epochs=1, verbose=0)
    for b, v, g in zip(before, model.trainable_variables, expected):
        np.testing.assert_allclose(b - v.numpy().astype(np.float64), g, rtol=2e-4, atol=1e-6)
    return opt

"""A frozen BatchNormalization backbone (``trainable = False``: inference mode) trains a DP head, on
both Kerases; BatchNormalization in training mode is still refused (``keras_dpsgd.backends.tensorflow.mixing``).

The backbone is a MobileNetV2-style block (BN after every convolution, DepthwiseConv2D, ReLU6, a
residual add; ``benchmarks/overhead.py --models frozen-mobilenet`` and ``examples/frozen_backbone.py``
run the whole ``applications.MobileNetV2``) with random moving statistics, so that inference mode
differs from batch statistics. Oracle: one example at a time, eagerly.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import keras_dpsgd.keras3 as k3
import keras_dpsgd.tf_keras as tk

B, CLASSES = 6, 3
KERASES = {"keras3": (keras, k3), "tf_keras": (tf_keras, tk)}


def _backbone(lib, seed=0):
    """A MobileNetV2-style block: convolution, BN, ReLU6, depthwise convolution, BN, residual add."""
    L = lib.layers
    inp = lib.Input((16, 16, 3))
    h = L.ReLU(6.0)(L.BatchNormalization()(L.Conv2D(4, 3, strides=2, padding="same")(inp)))
    d = L.ReLU(6.0)(L.BatchNormalization()(L.DepthwiseConv2D(3, padding="same")(h)))
    h = L.Add()([h, L.BatchNormalization()(L.Conv2D(4, 1)(d))])
    base = lib.Model(inp, h, name="backbone")
    gen = np.random.default_rng(seed)
    for layer in base.layers:
        if isinstance(layer, L.BatchNormalization):
            gamma, beta, mean, var = layer.get_weights()
            layer.set_weights([gamma, beta, gen.normal(0, 0.5, mean.shape), gen.uniform(0.5, 1.5, var.shape)])
    return base


def _model(lib, frozen=True):
    lib.utils.set_random_seed(3)
    base = _backbone(lib)
    inp = lib.Input((16, 16, 3))
    if frozen:
        base.trainable = False
        h = base(inp, training=False)
    else:
        h = base(inp)
    out = lib.layers.Dense(CLASSES, name="head")(lib.layers.GlobalAveragePooling2D()(h))
    return lib.Model(inp, out)


def _data(n=B, seed=1):
    gen = np.random.default_rng(seed)
    return gen.uniform(0, 1, (n, 16, 16, 3)).astype("float32"), gen.integers(0, CLASSES, n)


def _loss(lib):
    return lib.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _per_example_grads(model, lib, x, y):
    """Each example's gradient of the trainable variables (the head), one example at a time."""
    grads = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = _loss(lib)(y[i : i + 1], model(x[i : i + 1], training=False))[0]
        grads.append([np.asarray(g) for g in tape.gradient(loss, model.trainable_variables)])
    return grads


def _clipped_sum(grads, clip):
    norms = [np.sqrt(sum(np.sum(g**2) for g in row)) for row in grads]
    factors = [min(1.0, clip / n) for n in norms]
    return [sum(f * row[v] for f, row in zip(factors, grads)) for v in range(len(grads[0]))], norms


def _dp_step(name, model, x, y, clip, backend="auto"):
    """One DP-SGD step (σ = 0, lr = 1, lot size B) on (x, y); returns the clipped sum it applied."""
    lib, front = KERASES[name]
    opt = front.DPSGDOptimizer(clip, 0.0, learning_rate=1.0, expected_lot_size=B, per_example_backend=backend)
    model.compile(optimizer=opt, loss=_loss(lib))
    if name == "keras3":
        front.make_private(model)
    before = [v.numpy() for v in model.trainable_variables]
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    assert getattr(opt._backend, "last_fallback", []) == []
    return [(b - v.numpy()) * B for b, v in zip(before, model.trainable_variables)]


@pytest.mark.parametrize("name", sorted(KERASES))
def test_frozen_batch_norm_backbone_trains_a_dp_head_exactly(name):
    """fit's clipped sum == the one-example loop; removing one example moves it by <= C (σ = 0)."""
    lib = KERASES[name][0]
    x, y = _data()
    model = _model(lib)
    assert len(model.trainable_variables) == 2  # The head only.
    weights = model.get_weights()
    grads = _per_example_grads(model, lib, x, y)
    clip = float(np.median(_clipped_sum(grads, 1.0)[1]))  # Some examples clipped, some not.
    want, _ = _clipped_sum(grads, clip)
    got = _dp_step(name, model, x, y, clip)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    without_one = _dp_step(name, _clone(model, lib, weights), x[1:], y[1:], clip)
    moved = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(got, without_one)))
    assert 0 < moved <= clip * (1 + 1e-5)


def _clone(model, lib, weights):
    fresh = _model(lib)
    fresh.set_weights(weights)
    return fresh


@pytest.mark.parametrize("name", sorted(KERASES))
def test_frozen_batch_norm_on_the_reference_backend_matches_the_fast_one(name):
    lib = KERASES[name][0]
    x, y = _data()
    model = _model(lib)
    weights = model.get_weights()
    fast = _dp_step(name, model, x, y, 0.5)
    reference = _dp_step(name, _clone(model, lib, weights), x, y, 0.5, backend="reference")
    for a, b in zip(fast, reference):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _small(lib, bn):
    return lib.Sequential(
        [lib.Input((16, 16, 3)), lib.layers.Conv2D(2, 3), bn, lib.layers.Flatten(), lib.layers.Dense(2)]
    )


@pytest.mark.parametrize("name", sorted(KERASES))
def test_batch_norm_in_training_mode_is_refused_before_any_update(name):
    lib, front = KERASES[name]

    class MyNorm(lib.layers.BatchNormalization):
        pass

    x, y = _data(4)
    for bn in (lib.layers.BatchNormalization(name="bn"), MyNorm(name="bn")):
        model = _small(lib, bn)
        opt = front.DPSGDOptimizer(1.0, 0.0)
        model.compile(optimizer=opt, loss=_loss(lib))
        if name == "keras3":
            front.make_private(model)
        before = [v.numpy() for v in model.weights]
        with pytest.raises(ValueError, match=r"'bn' \(.*\) runs in training mode.*moving_mean.*trainable = False"):
            model.fit(x, y % 2, batch_size=4, verbose=0)
        for b, v in zip(before, model.weights):
            np.testing.assert_array_equal(b, v.numpy())


def test_keras3_frozen_batch_norm_in_an_eager_step_is_refused():
    """run_eagerly=True: no graph proves inference mode."""
    model = k3.make_private(_small(keras, keras.layers.BatchNormalization(name="bn", trainable=False)))
    model.compile(optimizer=k3.DPSGDOptimizer(1.0, 0.0), loss=_loss(keras), run_eagerly=True)
    x, y = _data(4)
    with pytest.raises(ValueError, match="'bn'.*runs eagerly.*prove"):
        model.fit(x, y % 2, batch_size=4, verbose=0)


@pytest.mark.parametrize("name", sorted(KERASES))
def test_a_layer_declaring_mixes_examples_is_refused(name):
    lib, front = KERASES[name]

    class Mixer(lib.layers.Layer):
        mixes_examples = True

        def call(self, x):
            return x

    model = _small(lib, Mixer(name="mixer"))
    model.compile(optimizer=front.DPSGDOptimizer(1.0, 0.0), loss=_loss(lib))
    if name == "keras3":
        front.make_private(model)
    x, y = _data(4)
    with pytest.raises(ValueError, match="'mixer'.*mixes_examples"):
        model.fit(x, y % 2, batch_size=4, verbose=0)

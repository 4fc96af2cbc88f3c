"""Mixed precision: loss scaling (mixed_float16) is refused with the fix; mixed_bfloat16 trains."""

import numpy as np
import pytest
import tf_keras as keras

from keras_dpsgd.tf_keras._optimizer import DPSGDOptimizer

X = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
Y = np.arange(8) % 3


def _fit(policy, optimizer, reduction):
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Activation("linear", dtype="float32")]
        )
        model.compile(
            optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
        )
        start = [w.numpy().astype("float32") for w in model.trainable_weights]
        model.fit(X, Y, batch_size=4, epochs=1, verbose=0, shuffle=False)
        return start, [w.numpy().astype("float32") for w in model.trainable_weights]
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_mixed_float16_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="mixed_bfloat16"):
        _fit("mixed_float16", DPSGDOptimizer(1.0, 0.0, learning_rate=0.1), "none")


def test_mixed_bfloat16_trains_as_plain_sgd_without_noise_and_clipping():
    # σ = 0 and a clip bound no gradient reaches: the DP step is the plain mean-gradient step.
    opt = DPSGDOptimizer(1e6, 0.0, learning_rate=0.5)
    start, private = _fit("mixed_bfloat16", opt, "none")
    _, plain = _fit("mixed_bfloat16", keras.optimizers.SGD(learning_rate=0.5), "sum_over_batch_size")
    assert int(opt.noised_steps.numpy()) == 2
    for s, p, q in zip(start, private, plain):
        assert np.abs(p - s).max() > 1e-2  # it moved
        np.testing.assert_allclose(p, q, atol=2e-2)  # as plain SGD does, within bfloat16's precision

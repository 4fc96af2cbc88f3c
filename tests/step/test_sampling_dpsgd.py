"""PoissonLots with the DP optimizer: empty lots, padding adds nothing, accumulation, WithinLimit."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.callbacks import PrivacyLogger, WithinLimit
from keras_dpsgd.ledger import model_privacy_ledger
from keras_dpsgd.tf_keras._optimizer import DPSGDOptimizer
from keras_dpsgd.step.lots import PoissonLots

N = 48
RNG = np.random.default_rng(0)
X = RNG.normal(size=(N, 3)).astype(np.float32)
Y = RNG.normal(size=(N, 1)).astype(np.float32)


def _model(optimizer):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, kernel_initializer="ones")])
    model.compile(optimizer=optimizer, loss=keras.losses.MeanSquaredError(reduction="none"))
    return model


def test_empty_lots_train_without_error():
    lots = PoissonLots(X, Y, expected_lot_size=0.5)  # P(empty) = (1 - 1/96)^48 ~ 0.6
    opt = lots.configure(DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1))
    model = _model(opt)
    sizes = [int(w.sum()) for _, _, w in PoissonLots(X, Y, expected_lot_size=0.5, seed=4).lots(20)]
    assert 0 in sizes
    model.fit(lots.dataset(), steps_per_epoch=20, epochs=1, verbose=0)
    assert int(opt.noised_steps.numpy()) == 20
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


@pytest.mark.parametrize("physical_batch_size, multiple", [(None, None), (4, None), (None, 5), (4, 3)])
def test_padding_adds_nothing_to_the_step(physical_batch_size, multiple):
    """σ = 0 and a huge clip: the update is -lr Σ_{i in lot} ∇ℓ_i / L, padding excluded (padded to the capacity
    or to a multiple of `multiple` rows: every example of the lot is in the step)."""
    lr, lot_size = 0.1, 12.0
    lots = PoissonLots(
        X, Y, expected_lot_size=lot_size, physical_batch_size=physical_batch_size, pad_to_multiple_of=multiple, seed=9
    )
    indices = PoissonLots(X, Y, expected_lot_size=lot_size, seed=9).sample_indices()
    assert len(indices) > 0
    k = lots.gradient_accumulation_steps
    opt = DPSGDOptimizer(l2_norm_clip=1e6, noise_multiplier=0.0, learning_rate=lr, gradient_accumulation_steps=k)
    model = _model(lots.configure(opt))
    before = [w.numpy().copy() for w in model.trainable_variables]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(X[indices]) - Y[indices]))
    expected_grads = tape.gradient(loss, model.trainable_variables)
    model.fit(lots.dataset(), steps_per_epoch=k, epochs=1, verbose=0)
    assert int(opt.noised_steps.numpy()) == 1
    for w0, w, g in zip(before, model.trainable_variables, expected_grads):
        np.testing.assert_allclose(w.numpy(), w0 - lr * g.numpy() / lot_size, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("lot_size,physical,target", [(6, None, 1.5), (8, 4, 1.3)], ids=["one-batch", "accumulated"])
def test_within_limit_with_poisson_lots_and_the_real_optimizer(lot_size, physical, target):
    """WithinLimit stops at the last step within the target; with gradient accumulation at a lot boundary."""
    lots = PoissonLots(X, Y, expected_lot_size=lot_size, physical_batch_size=physical)
    k = lots.gradient_accumulation_steps
    assert (k > 1) == (physical is not None)
    opt = lots.configure(
        DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.5, learning_rate=0.05, gradient_accumulation_steps=k)
    )
    model = _model(opt)
    q, delta = lot_size / N, 1e-3
    model.fit(
        lots.dataset(),
        steps_per_epoch=lots.steps_per_epoch,
        epochs=100,
        verbose=0,
        callbacks=[WithinLimit(target, delta, verbose=0), PrivacyLogger(delta)],
    )
    steps = int(opt.noised_steps.numpy())
    assert model_privacy_ledger(model).events == (PoissonSampledGaussianEvent(q, 1.5, steps, "dp-sgd"),)
    eps = [compute_epsilon(PoissonSampledGaussianEvent(q, 1.5, s), delta) for s in (steps, steps + 1)]
    assert steps > 0 and eps[0] <= target < eps[1]

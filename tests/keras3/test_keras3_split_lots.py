"""PoissonLots(max_physical_batch_size=M) on Keras 3: a lot split into k physical batches of at most M rows,
accumulated and released once, is the whole lot's release (issue 41 item 7).

Backend-neutral (keras.ops): collected on TensorFlow here, on JAX by tests/backends/jax/test_jax_split_lots.py and
on torch by tests/backends/torch/test_torch_split_lots.py.
"""

import math

import keras
import numpy as np
import pytest

import keras_dpsgd
import keras_dpsgd.keras3 as k3
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon

N, L, M, DELTA = 64, 8, 8, 1e-5


def _numpy(values):
    return [keras.ops.convert_to_numpy(v) for v in values]


def _lots(max_physical_batch_size=None):
    gen = np.random.default_rng(0)
    x, y = gen.normal(size=(N, 3)).astype("float32"), gen.integers(0, 2, N).astype("int32")
    return keras_dpsgd.PoissonLots(x, y, expected_lot_size=L, seed=3, max_physical_batch_size=max_physical_batch_size)


def _compiled(lots, sigma, units=2):
    keras.utils.set_random_seed(0)
    model = k3.make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(units)]))
    optimizer = k3.DPSGDOptimizer(
        l2_norm_clip=1.0,
        noise_multiplier=sigma,
        learning_rate=1.0,
        seed=1,
        gradient_accumulation_steps=lots.gradient_accumulation_steps,
    )
    model.compile(optimizer=lots.configure(optimizer), loss=keras.losses.SparseCategoricalCrossentropy(True))
    return model


def _fit(lots, num_lots, sigma, units=2):
    """`num_lots` epochs of one lot each: Keras on torch reads a dataset ahead before training (drawing lots it
    never trains on, more of them where a lot is one batch), so a longer dataset would train on other lots split
    and unsplit; one lot per pass draws the same ones."""
    model = _compiled(lots, sigma, units)
    model.fit(lots.dataset(1), epochs=num_lots, verbose=0)
    return model


def test_the_split_lot_releases_what_the_whole_lot_releases():
    """σ = 0, the same lots: k batches of P <= M rows accumulated give the weights of the lot in one batch, one
    release per lot (noised_steps), up to float32 rounding of sums taken in another order."""
    whole, split = _lots(), _lots(M)
    k = math.ceil(whole.max_lot_size / M)
    assert whole.gradient_accumulation_steps == 1 and split.gradient_accumulation_steps == k > 1
    assert split.physical_batch_size == math.ceil(whole.max_lot_size / k) <= M
    initial = _numpy(_compiled(whole, 0.0).trainable_weights)
    models = [_fit(lots, 4, 0.0) for lots in (whole, split)]
    assert [int(keras.ops.convert_to_numpy(m.optimizer.noised_steps)) for m in models] == [4, 4]
    whole_weights, split_weights = (_numpy(m.trainable_weights) for m in models)
    for a, b in zip(whole_weights, split_weights):
        # 4 updates of lr·(at most ~3L clipped unit-norm terms)/L: float32 rounding of each sum <= 1e-6.
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert max(np.max(np.abs(a - w0)) for a, w0 in zip(split_weights, initial)) > 0.05  # the lots moved them


def test_the_split_lot_is_noised_once_and_its_epsilon_is_the_whole_lots():
    """σ = 1, C = 1, one lot: the noise on each of 2 000 coordinates is N(0, (σC/L)²) once per lot (k draws
    would give √k times the std, k >= 2 here), and the ledger's ε is that of the unsplit lots."""
    split = _lots(M)
    k = split.gradient_accumulation_steps
    assert k >= 2
    clean, noisy = (_fit(_lots(M), 1, sigma, units=500) for sigma in (0.0, 1.0))
    noise = np.concatenate([(a - b).ravel() for a, b in zip(*(_numpy(m.trainable_weights) for m in (noisy, clean)))])
    assert noise.size == 2000
    std = float(np.std(noise * L))  # lr = 1: the update's noise times L is N(0, σ²C²) per coordinate
    assert abs(std - 1.0) < 6 / math.sqrt(2 * noise.size)  # 6 standard errors of a std: 0.095; √2 - 1 = 0.41
    whole = _fit(_lots(), 1, 1.0, units=500)
    expected = compute_epsilon([PoissonSampledGaussianEvent(L / N, 1.0, 1)], DELTA)
    for model in (noisy, whole):
        assert keras_dpsgd.model_epsilon(model, target_delta=DELTA)[0] == pytest.approx(expected, rel=1e-12)


class _StopAfterFirstBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.model.stop_training = True


def test_a_partial_split_lot_is_never_released():
    """A fit that stops inside a lot discards it (no release, no update, nothing charged); a fit whose epochs
    would end inside lots is refused before any weight changes."""
    lots = _lots(M)
    model = _compiled(lots, 1.0)
    initial = _numpy(model.trainable_weights)
    model.fit(lots.dataset(2), epochs=1, verbose=0, callbacks=[_StopAfterFirstBatch()])
    assert int(keras.ops.convert_to_numpy(model.optimizer.noised_steps)) == 0
    assert model.optimizer.discarded_lots == 1
    for a, w0 in zip(_numpy(model.trainable_weights), initial):
        np.testing.assert_array_equal(a, w0)
    with pytest.raises(ValueError, match=r"lot-steps-per-epoch"):
        model.fit(lots.dataset(), steps_per_epoch=lots.gradient_accumulation_steps + 1, epochs=1, verbose=0)
    assert int(keras.ops.convert_to_numpy(model.optimizer.noised_steps)) == 0
    for a, w0 in zip(_numpy(model.trainable_weights), initial):
        np.testing.assert_array_equal(a, w0)

"""PoissonLots with Keras 3 fit: as tf.data and as a keras.utils.PyDataset (statistics, padding, the ledger)."""

import keras
import numpy as np
import pytest
from scipy import stats

import keras_dpsgd.keras3 as k3
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.callbacks import PrivacyLogger
from keras_dpsgd.step.lots import PoissonLots

SIGMA, DELTA = 1.2, 1e-5


def _data(n):
    x = np.arange(n, dtype=np.float32)[:, None] + 1.0  # ids 1..n, so 0 marks padding
    return x, (np.arange(n) % 2).astype(np.int32)


def _private_model(lots, sigma=SIGMA):
    keras.utils.set_random_seed(0)
    model = k3.make_private(keras.Sequential([keras.Input((1,)), keras.layers.Dense(2)]))
    optimizer = lots.configure(k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=sigma, learning_rate=0.1, seed=0))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("source", ["tf.data", "PyDataset"])
def test_keras3_fit_on_lots_counts_every_lot_in_the_ledger(source):
    n, q = 40, 0.05  # P(empty lot) = 0.95^40 ~ 0.13: empty lots go through fit too
    lots = PoissonLots(*_data(n), sampling_rate=q, max_lot_size=3, seed=11)  # overflow buckets too
    model = _private_model(lots)
    data = lots.dataset(lots.lots_per_epoch) if source == "tf.data" else lots.as_py_dataset(lots.lots_per_epoch)
    history = model.fit(data, epochs=2, callbacks=[PrivacyLogger(DELTA)], verbose=0)
    steps = int(model.optimizer.noised_steps.numpy())
    assert steps == 2 * lots.lots_per_epoch == 40
    expected = compute_epsilon([PoissonSampledGaussianEvent(q, SIGMA, steps)], DELTA)
    assert history.history["epsilon"][-1] == pytest.approx(expected, rel=1e-12)
    assert lots.overflow_count > 0 and np.all(np.isfinite(history.history["loss"]))


def test_empty_lots_take_a_counted_step_that_moves_nothing():
    lots = PoissonLots(*_data(20), sampling_rate=1e-7, seed=0)  # P(any lot non-empty) ~ 1e-5
    model = _private_model(lots, sigma=0.0)
    before = [w.numpy().copy() for w in model.trainable_weights]
    model.fit(lots.as_py_dataset(3), epochs=1, verbose=0)
    assert int(model.optimizer.noised_steps.numpy()) == 3
    for b, a in zip(before, model.trainable_weights):
        np.testing.assert_array_equal(b, a.numpy())  # weight-0 padding: zero gradient, σ = 0


def test_py_dataset_batches_are_the_lots_padded_like_the_dataset():
    x, y = _data(30)
    reference = PoissonLots(x, y, sampling_rate=0.3, seed=4)
    py_dataset = PoissonLots(x, y, sampling_rate=0.3, seed=4).as_py_dataset(25)
    assert isinstance(py_dataset, keras.utils.PyDataset) and py_dataset.num_batches == len(py_dataset) == 25
    for i, (rx, ry, rw) in zip(range(25), reference.lots(25)):
        bx, by, bw = py_dataset[i]
        for got, want in ((bx, rx), (by, ry), (bw, rw)):
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
        assert np.all(bx[bw == 0] == 0) and bx.shape[0] == reference.max_lot_size
    with pytest.raises(IndexError, match=r"index must be in \[0, 25\), got 25"):
        py_dataset[25]
    endless = reference.as_py_dataset()
    assert endless.num_batches is None and endless[10**6][0].shape == (reference.max_lot_size, 1)


def test_py_dataset_lot_sizes_are_binomial():
    n, q, m = 50, 0.2, 4000
    py_dataset = PoissonLots(*_data(n), sampling_rate=q, seed=2).as_py_dataset()
    sizes = np.array([int(np.sum(py_dataset[i][2] > 0)) for i in range(m)])
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 6 * np.sqrt(var / m)
    assert abs(sizes.var(ddof=1) - var) < 6 * var * np.sqrt(2 / m)
    # Chi-square goodness of fit to Binomial(50, 0.2), tails pooled (expected count >= 5 per bin).
    edges = np.arange(3, 18)  # bins: <= 3, 4, ..., 17, >= 18
    observed = np.array([np.sum(sizes <= 3)] + [np.sum(sizes == k) for k in edges[1:]] + [np.sum(sizes >= 18)])
    pmf = stats.binom(n, q)
    expected = m * np.array([pmf.cdf(3)] + [pmf.pmf(k) for k in edges[1:]] + [pmf.sf(17)])
    assert expected.min() >= 5 and observed.sum() == m
    assert stats.chisquare(observed, expected).pvalue > 1e-4


def test_py_dataset_refusals():
    x, y = _data(30)
    py_dataset = PoissonLots(x, y, sampling_rate=0.3).as_py_dataset(2)
    with pytest.raises(ValueError, match="workers must be 1 for Poisson lots, got 4"):
        py_dataset.workers = 4
    with pytest.raises(ValueError, match="use_multiprocessing must be False"):
        py_dataset.use_multiprocessing = True
    assert py_dataset.workers == 1 and py_dataset.use_multiprocessing is False
    with pytest.raises(
        ValueError,
        match="as_py_dataset needs one physical batch per lot, got gradient_accumulation_steps=2 "
        r"\(physical_batch_size=8\): Keras reads batches ahead .* use lots.dataset\(\)",
    ):
        PoissonLots(x, y, sampling_rate=0.3, max_lot_size=16, physical_batch_size=8).as_py_dataset()
    with pytest.raises(ValueError, match="num_lots must be an integer >= 0, got -1"):
        PoissonLots(x, y, sampling_rate=0.3).as_py_dataset(-1)


def test_a_lot_split_into_physical_batches_trains_as_the_whole_lot():
    """physical_batch_size=ceil(R/k) (what max_physical_batch_size picks): the padded lot of R rows as k batches
    of ceil(R/k) rows, accumulated, takes the same steps as the lot in one batch (σ = 0, same seed: the same lots)."""
    x, y = _data(64)
    whole = PoissonLots(x, y, expected_lot_size=8, seed=3)
    k = -(-whole.max_lot_size // 8)
    split = PoissonLots(x, y, expected_lot_size=8, seed=3, physical_batch_size=-(-whole.max_lot_size // k))
    assert k > 1 and split.gradient_accumulation_steps == k and split.physical_batch_size <= 8
    weights, initial = [], None
    for lots in (whole, split):
        keras.utils.set_random_seed(0)
        model = k3.make_private(keras.Sequential([keras.Input((1,)), keras.layers.Dense(2)]))
        initial = [w.numpy() for w in model.trainable_weights]
        optimizer = k3.DPSGDOptimizer(
            l2_norm_clip=1.0,
            noise_multiplier=0.0,
            learning_rate=0.1,
            gradient_accumulation_steps=lots.gradient_accumulation_steps,
        )
        model.compile(optimizer=lots.configure(optimizer), loss=keras.losses.SparseCategoricalCrossentropy(True))
        model.fit(lots.dataset(4), epochs=1, verbose=0)
        assert int(model.optimizer.noised_steps.numpy()) == 4
        weights.append([w.numpy() for w in model.trainable_weights])
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # sums in another order: float32 rounding only
    assert any(np.any(a != w0) for a, w0 in zip(weights[1], initial))  # the lots moved the weights

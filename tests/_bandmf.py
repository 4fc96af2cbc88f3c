"""BandMF's checks on every Keras 3 backend: collected by tests/keras3/test_keras3_bandmf.py (TensorFlow, with
its own further checks), tests/backends/jax/test_jax_bandmf.py and tests/backends/torch/test_torch_bandmf.py
(``__all__``).

b = 1 is DP-SGD bit for bit with the same seed and lots; the noise across steps has covariance σ²C⁻¹C⁻ᵀ (the
recursion runs in the train step, its history carried in the optimizer's variables); the ledger's BandMFEvent and
ε; a run saved to a ``.keras`` file and resumed with lots of another seed equals the straight run (the history and
the split are restored, never drawn again); other lots are refused before any weight changes.
"""

import contextlib

import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from keras_dpsgd import CyclicPoissonLots, PoissonLots, model_epsilon, model_privacy_ledger
from keras_dpsgd.accounting import BandMFEvent, compute_epsilon
from keras_dpsgd.dp.bandmf import BandedToeplitzStrategy, optimize_banded_toeplitz

__all__ = [
    "test_a_run_resumed_from_a_keras_file_continues_its_noise_and_split",
    "test_ledger_records_bandmf_events_and_epsilon",
    "test_noise_covariance_across_steps_is_sigma2_cinv_cinvt",
    "test_one_band_is_dpsgd_bit_for_bit",
    "test_refuses_lots_without_the_bands_before_any_update",
]


def _data(n, d=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), (np.arange(n) % 2).astype(np.int32)


def _model(d=3, units=2, use_bias=True, seed=0):
    keras.utils.set_random_seed(seed)
    return k3.make_private(keras.Sequential([keras.Input((d,)), keras.layers.Dense(units, use_bias=use_bias)]))


def _compile(model, optimizer, loss=None):
    model.compile(optimizer=optimizer, loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@contextlib.contextmanager
def _fixed_threads():
    """torch: one intra-op thread for both runs while the test runs (its parallel matmuls may split a sum
    differently from one run to the next on a loaded machine: a rounding difference this test is not about)."""
    if keras.backend.backend() != "torch":
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_one_band_is_dpsgd_bit_for_bit():
    x, y = _data(40)
    with _fixed_threads():
        runs = _one_band_and_dpsgd(x, y)
    for a, b in zip(*runs):
        assert np.array_equal(a, b)
    assert not np.array_equal(runs[0][0], np.asarray(_model().trainable_weights[0].numpy()))  # it trained


def _one_band_and_dpsgd(x, y):
    runs = []
    for bandmf in (False, True):
        if bandmf:
            lots = CyclicPoissonLots(x, y, bands=1, sampling_rate=0.3, seed=5)
            opt = k3.BandMFSGDOptimizer(
                1.0, 1.3, strategy=BandedToeplitzStrategy.identity(6), learning_rate=0.5, seed=7
            )
        else:
            lots = PoissonLots(x, y, sampling_rate=0.3, seed=5)
            opt = k3.DPSGDOptimizer(1.0, 1.3, learning_rate=0.5, seed=7)
        model = _compile(_model(), lots.configure(opt))
        model.fit(lots.dataset(6), epochs=1, verbose=0)
        runs.append([np.asarray(w.numpy()) for w in model.trainable_weights])
    return runs


def _noise_steps(strategy, steps, dim=20000, sigma=1.0):
    """Weight changes of `steps` steps on empty lots (q tiny): −lr·w_t/L with lr = L = 1, per coordinate."""
    x = np.zeros((4, dim), np.float32)
    lots = CyclicPoissonLots(x, np.zeros(4, np.int32), bands=strategy.bands, sampling_rate=1e-12, seed=0)
    opt = lots.configure(k3.BandMFSGDOptimizer(1.0, sigma, strategy=strategy, learning_rate=1.0, seed=3))
    opt.expected_lot_size = 1.0  # the normalizer (post-processing): noise in units of σ·clip
    model = _compile(_model(d=dim, units=1, use_bias=False), opt, loss="mse")
    before = np.asarray(model.trainable_weights[0].numpy())[:, 0].copy()
    deltas = []
    for _ in range(steps):  # one fit per step: the history crosses fits in the optimizer's variables
        model.fit(lots.dataset(1), epochs=1, verbose=0)
        after = np.asarray(model.trainable_weights[0].numpy())[:, 0].copy()
        deltas.append(before - after)
        before = after
    return np.array(deltas), opt


def test_noise_covariance_across_steps_is_sigma2_cinv_cinvt():
    n, sigma = 6, 1.5
    strategy = optimize_banded_toeplitz(n, 3, cache_dir=None)
    w, opt = _noise_steps(strategy, n, sigma=sigma)
    assert sum("bandmf_noise" in v.name for v in opt.variables) == 2  # b − 1 = 2 past draws, saved
    cinv = np.linalg.inv(strategy.matrix())
    expected = sigma**2 * cinv @ cinv.T
    empirical = np.cov(w)  # rows: steps, columns: 20,000 independent coordinates
    scale = np.sqrt(np.outer(np.diag(expected), np.diag(expected)))
    # Entry (i, j) of a sample covariance of m = 20,000 draws has sd <= sqrt(2/m) * scale: 6 sd.
    np.testing.assert_allclose(empirical, expected, atol=6 * np.sqrt(2 / w.shape[1]) * scale.max())
    assert np.abs(expected - sigma**2 * np.eye(n)).max() > 5 * 6 * np.sqrt(2 / w.shape[1]) * scale.max()  # not i.i.d.
    z = strategy.matrix() @ w / sigma  # C w: the fresh draws, i.i.d. N(0, 1)
    np.testing.assert_allclose(np.cov(z), np.eye(n), atol=6 * np.sqrt(2 / w.shape[1]))


def test_ledger_records_bandmf_events_and_epsilon():
    x, y = _data(60)
    strategy = optimize_banded_toeplitz(8, 4, cache_dir=None)
    lots = CyclicPoissonLots(x, y, bands=4, expected_lot_size=3.0, seed=1)
    opt = lots.configure(k3.BandMFSGDOptimizer(1.0, 1.1, strategy=strategy, learning_rate=0.1, seed=2))
    model = _compile(_model(), opt)
    model.fit(lots.dataset(4), epochs=2, verbose=0)
    expected = BandMFEvent(0.2, 1.1, steps=8, bands=4, column_norm=strategy.column_norm)
    assert model_privacy_ledger(model).events == (expected,)
    assert model_epsilon(model, target_delta=1e-5)[0] == compute_epsilon(expected, 1e-5)


def test_a_run_resumed_from_a_keras_file_continues_its_noise_and_split(tmp_path):
    """Saved after 3 of 6 steps and resumed with lots of another seed: the restored history continues the same
    noise (seeded: keyed by the ledger position, never drawn again) and the lots adopt the saved split."""
    x, y = _data(12)
    strategy = optimize_banded_toeplitz(6, 3, cache_dir=None)

    def make(seed=0):
        lots = CyclicPoissonLots(x, y, bands=3, sampling_rate=1.0, seed=seed)
        opt = lots.configure(k3.BandMFSGDOptimizer(1.0, 2.0, strategy=strategy, learning_rate=0.1, seed=4))
        return lots, _compile(_model(), opt)

    lots, straight = make()
    straight.fit(lots.dataset(6), epochs=1, verbose=0)
    first_lots, first = make()
    first.fit(first_lots.dataset(3), epochs=1, verbose=0)
    first.save(tmp_path / "m.keras")
    resumed = k3.make_private(keras.models.load_model(tmp_path / "m.keras"))
    history = [v for v in resumed.optimizer.variables if "bandmf_noise" in v.name]
    assert len(history) == 2 * 2 and any(np.abs(np.asarray(v.numpy())).max() > 0 for v in history)
    lots = CyclicPoissonLots(x, y, bands=3, sampling_rate=1.0, seed=99)
    assert not np.array_equal(lots.parts, first_lots.parts)
    lots.configure(resumed.optimizer)
    np.testing.assert_array_equal(lots.parts, first_lots.parts)  # the optimizer's split
    resumed.fit(lots.dataset(3), epochs=1, verbose=0)
    for a, b in zip(straight.trainable_weights, resumed.trainable_weights):
        np.testing.assert_allclose(np.asarray(a.numpy()), np.asarray(b.numpy()), rtol=1e-5, atol=1e-6)


def test_refuses_lots_without_the_bands_before_any_update():
    x, y = _data(20)
    strategy = optimize_banded_toeplitz(6, 2, cache_dir=None)
    for data in (PoissonLots(x, y, sampling_rate=0.2, seed=0), CyclicPoissonLots(x, y, bands=3, sampling_rate=0.5)):
        opt = k3.BandMFSGDOptimizer(1.0, 1.0, strategy=strategy, learning_rate=0.1, sampling_rate=0.2)
        model = _compile(_model(), opt)
        before = [np.asarray(w.numpy()).copy() for w in model.trainable_weights]
        with pytest.raises(ValueError, match="strategy of 2 bands"):
            model.fit(data.dataset(2), epochs=1, verbose=0)
        for a, w in zip(before, model.trainable_weights):
            np.testing.assert_array_equal(a, np.asarray(w.numpy()))
    with pytest.raises(ValueError, match="strategy of 2 bands"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="cannot feed a BandMF optimizer of 2 bands"):
        CyclicPoissonLots(x, y, bands=3, sampling_rate=0.5).configure(opt)

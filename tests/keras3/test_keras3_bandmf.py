"""BandMF on Keras 3 (TensorFlow): the checks of every backend (tests/_bandmf.py: b = 1 is DP-SGD bit for bit, the
noise across steps has covariance σ²C⁻¹C⁻ᵀ, the ledger's BandMFEvent, a resumed run, other lots refused), and
TensorFlow's own: one example moves C·(releases) by its column norm per participation, b steps apart; the split of
the examples; the refusals."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dpsgd.keras3 as k3
from keras_dpsgd import CyclicPoissonLots, PoissonLots, model_privacy_ledger
from keras_dpsgd.accounting import BandMFEvent
from keras_dpsgd.dp.bandmf import optimize_banded_toeplitz
from tests._bandmf import *  # noqa: F403 (the checks of every backend, collected here)
from tests._bandmf import _compile, _data, _model


def test_one_example_moves_each_participation_block_by_its_column_norm():
    """σ = 0, deterministic lots (q = 1): the releases with and without example k differ at its steps only,
    b apart, and C·(difference) has one block of b rows per participation, each of norm ‖C[:, j]‖·‖g_k‖."""
    n, b, k, d = 9, 3, 4, 5
    strategy = optimize_banded_toeplitz(n, b, cache_dir=None)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(12, d)).astype(np.float32)
    x *= 0.5 / np.linalg.norm(x, axis=1, keepdims=True)  # norm 0.5 < clip: gradients unclipped
    releases = []
    for data in (x, x * (np.arange(12) != k)[:, None]):  # example k, or a zero row (gradient 0) in its place
        lots = CyclicPoissonLots(data, np.zeros(12, np.int32), bands=b, sampling_rate=1.0, seed=0)
        opt = lots.configure(k3.BandMFSGDOptimizer(1.0, 0.0, strategy=strategy, learning_rate=1.0))
        opt.expected_lot_size = 1.0
        model = _compile(_model(d=d, units=1, use_bias=False), opt, loss=lambda yt, yp: keras.ops.sum(yp, axis=-1))
        weights = [model.trainable_weights[0].numpy()[:, 0].copy()]
        for _ in range(n):
            model.fit(lots.dataset(1), epochs=1, verbose=0)
            weights.append(model.trainable_weights[0].numpy()[:, 0].copy())
        releases.append(-np.diff(np.array(weights), axis=0))  # y_t: gradient x_i of the loss Σ w·x_i
    diff = releases[0] - releases[1]  # [n, d]
    moved = np.flatnonzero(np.abs(diff).max(axis=1) > 1e-6)
    np.testing.assert_array_equal(moved, np.arange(lots.parts[k], n, b))  # its part's steps, b apart
    blocks = strategy.matrix() @ diff
    for j in moved:
        block = np.linalg.norm(blocks[j : j + b])
        column = np.linalg.norm(strategy.matrix()[:, j])
        assert block == pytest.approx(column * 0.5, rel=1e-5) and column <= strategy.column_norm
    assert np.linalg.norm(blocks) ** 2 == pytest.approx(sum(np.linalg.norm(blocks[j : j + b]) ** 2 for j in moved))


def test_refuses_bad_arguments():
    strategy = optimize_banded_toeplitz(6, 2, cache_dir=None)
    with pytest.raises(TypeError, match="strategy must be a keras_dpsgd.dp.bandmf.BandedToeplitzStrategy"):
        k3.BandMFSGDOptimizer(1.0, 1.0, strategy=[1.0, 0.5])
    with pytest.raises(ValueError, match="flat clipping or clipping='normalize'"):
        k3.BandMFSGDOptimizer([1.0, 1.0], 1.0, strategy=strategy)
    x, y = _data(10)
    with pytest.raises(ValueError, match=r"bands must be an integer in \[1, 10\], got 11"):
        CyclicPoissonLots(x, y, bands=11, sampling_rate=0.5)
    with pytest.raises(ValueError, match=r"expected_lot_size must be in \(0, 5\], got 6"):
        CyclicPoissonLots(x, y, bands=2, expected_lot_size=6)
    with pytest.raises(ValueError, match=r"CyclicPoissonLots\(bands=2\).as_py_dataset\(\) is refused"):
        CyclicPoissonLots(x, y, bands=2, sampling_rate=0.5).as_py_dataset(3)


def test_parts_are_drawn_at_random_not_by_position():
    """Add/remove adjacency: removing one example must not move the others between parts. By position (example i
    in part i mod b) removing example 0 moves every later example: a data set alternating two kinds of example would
    release the other kind at every step. Drawn at random, each example's part is uniform and independent of the
    others': examples 0 and 2 share a part in about half of the splits (b = 2), not always."""
    x, y = _data(12)
    shared = []
    for seed in range(400):
        lots = CyclicPoissonLots(x, y, bands=2, sampling_rate=0.5, seed=seed)
        shared.append(any(0 in lots.part(t) and 2 in lots.part(t) for t in range(2)))
    assert 0.4 < np.mean(shared) < 0.6  # binomial(400, 1/2): sd 0.025


def test_a_resumed_optimizer_keeps_its_split_and_one_without_a_split_is_refused():
    x, y = _data(30)
    strategy = optimize_banded_toeplitz(6, 3, cache_dir=None)
    first = CyclicPoissonLots(x, y, bands=3, sampling_rate=0.5, seed=1)
    opt = first.configure(k3.BandMFSGDOptimizer(1.0, 1.0, strategy=strategy))
    assert tuple(opt.bandmf_partition_key.numpy()) == first.partition_key
    later = CyclicPoissonLots(x, y, bands=3, sampling_rate=0.5, seed=2)
    assert not np.array_equal(later.parts, first.parts)
    later.configure(opt)  # adopts the optimizer's split
    np.testing.assert_array_equal(later.parts, first.parts)
    unknown = k3.BandMFSGDOptimizer(1.0, 1.0, strategy=strategy)
    unknown.noised_steps.assign(4)  # steps taken on a split it did not record
    with pytest.raises(ValueError, match="took 4 steps on a split of the examples it did not record"):
        CyclicPoissonLots(x, y, bands=3, sampling_rate=0.5, seed=3).configure(unknown)


def test_cyclic_lots_sample_their_part_and_follow_the_optimizer():
    x, y = _data(30)
    lots = CyclicPoissonLots(x, y, bands=3, sampling_rate=0.6, seed=0)
    assert lots.expected_lot_size == pytest.approx(6.0)
    ids = np.arange(30, dtype=np.float32)[:, None] + 1.0  # 0 marks padding
    id_lots = CyclicPoissonLots(ids, y, bands=3, sampling_rate=0.6, seed=0)
    parts = id_lots.parts
    for t, (bx, _, bw) in enumerate(id_lots.lots(9)):
        members = bx[bw > 0, 0].astype(int) - 1
        assert np.all(parts[members] == t % 3)

    class Follower:
        noised_steps = tf.Variable(7, dtype=tf.int64)

    id_lots = CyclicPoissonLots(ids, y, bands=3, sampling_rate=0.6, seed=0)
    id_lots.follow(Follower())  # the next dataset starts at the part of step 7
    (bx, _, bw), *_ = list(id_lots.dataset(2).as_numpy_iterator())
    assert np.all(id_lots.parts[bx[bw > 0, 0].astype(int) - 1] == 7 % 3)


def test_an_earlier_optimizers_steps_keep_their_dpsgd_events():
    x, y = _data(40)
    model = _model()
    plain = PoissonLots(x, y, sampling_rate=0.1, seed=0)
    _compile(model, plain.configure(k3.DPSGDOptimizer(1.0, 1.5, learning_rate=0.1, seed=1)))
    model.fit(plain.dataset(3), epochs=1, verbose=0)
    strategy = optimize_banded_toeplitz(4, 2, cache_dir=None)
    cyclic = CyclicPoissonLots(x, y, bands=2, sampling_rate=0.2, seed=0)
    _compile(model, cyclic.configure(k3.BandMFSGDOptimizer(1.0, 1.2, strategy=strategy, learning_rate=0.1, seed=2)))
    model.fit(cyclic.dataset(4), epochs=1, verbose=0)
    events = model_privacy_ledger(model).events
    assert [type(e).__name__ for e in events] == ["PoissonSampledGaussianEvent", "BandMFEvent"]
    assert (events[0].sampling_rate, events[0].noise_multiplier, events[0].count) == (0.1, 1.5, 3)
    assert events[1] == BandMFEvent(0.2, 1.2, steps=4, bands=2, column_norm=strategy.column_norm)


def test_an_unanchored_iteration_at_another_part_is_refused():
    """A restored optimizer (noised_steps = 5) whose fit began drawing lots before configure: refused, since
    the sampler's own count (0) would put example i's next step out of its cycle."""
    x, y = _data(30)
    lots = CyclicPoissonLots(x, y, bands=3, sampling_rate=0.5, seed=0)
    next(iter(lots.dataset(1)))  # an iteration that began without an anchor, at step 0

    class Restored:
        noised_steps = tf.Variable(5, dtype=tf.int64)

    with pytest.raises(ValueError, match="began drawing lots at the part of step 0 but the optimizer's next step is 5"):
        lots.follow(Restored())
    Restored.noised_steps.assign(6)  # the same part: its lots stay in the cycle
    lots.follow(Restored())

"""PoissonLots sharded over W workers: the union of the workers' lots is one Poisson(q) lot."""

import numpy as np
import pytest
import tensorflow as tf

from keras_dpsgd import PoissonLots

N, Q, W = 1001, 0.05, 2
X = np.arange(N, dtype=np.float32)[:, None]
Y = np.zeros(N, np.float32)


def _workers(seed=3, **kwargs):
    return [PoissonLots(X, Y, sampling_rate=Q, num_workers=W, worker_index=w, seed=seed, **kwargs) for w in range(W)]


def test_each_worker_samples_its_shard_only():
    for w, lots in enumerate(_workers()):
        assert lots.shard_size == len(range(w, N, W))
        for _ in range(20):
            assert np.all(lots.sample_indices() % W == w)


def test_union_of_lot_sizes_is_binomial_n_q():
    workers = _workers(seed=11)
    lots = 2000
    sizes = np.array([sum(len(s.sample_indices()) for s in workers) for _ in range(lots)])
    mean, var = N * Q, N * Q * (1 - Q)
    assert abs(sizes.mean() - mean) < 5 * np.sqrt(var / lots)  # ~ Binomial(N, q) mean
    # Sample variance of 2000 draws: relative sd ~ sqrt(2/2000) = 3.2%; 5 sd bound.
    assert abs(sizes.var(ddof=1) / var - 1) < 5 * np.sqrt(2 / lots)


def test_every_example_in_the_union_with_probability_q():
    workers = _workers(seed=5)
    lots = 400
    counts = np.zeros(N)
    for _ in range(lots):
        for s in workers:
            counts[s.sample_indices()] += 1
    rate = counts / lots
    # Each example's count ~ Binomial(400, q): the mean over all N is q within 5 sd.
    assert abs(rate.mean() - Q) < 5 * np.sqrt(Q * (1 - Q) / (lots * N))
    assert np.all(counts <= lots * Q + 6 * np.sqrt(lots * Q))  # no example sampled twice per lot on two workers


def test_workers_pad_to_one_size_for_the_largest_shard_and_normalize_by_global_l():
    workers = _workers(replicas_per_worker=4)
    sizes = {s.physical_batch_size for s in workers}
    assert len(sizes) == 1 and sizes.pop() % 4 == 0
    single = PoissonLots(X[: (N + 1) // 2], Y[: (N + 1) // 2], sampling_rate=Q)
    assert workers[0].physical_batch_size == -(-single.physical_batch_size // 4) * 4
    for s in workers:
        assert s.expected_lot_size == pytest.approx(Q * N)  # global L
        assert s.sampling_rate == Q and s.num_examples == N


def test_seeded_workers_are_reproducible_and_independent():
    a, b = _workers(seed=7), _workers(seed=7)
    assert np.array_equal(a[0].sample_indices(), b[0].sample_indices())
    # Worker 1's draws are not worker 0's shifted by one (a per-worker stream).
    u0 = PoissonLots(X, Y, sampling_rate=Q, num_workers=W, worker_index=0, seed=7)._rng.random(8)
    u1 = PoissonLots(X, Y, sampling_rate=Q, num_workers=W, worker_index=1, seed=7)._rng.random(8)
    assert not np.allclose(u0, u1)
    # One worker keeps the unsharded stream (bit-identical to before sharding existed).
    plain = PoissonLots(X, Y, sampling_rate=Q, seed=7)
    assert np.array_equal(
        plain.sample_indices(), PoissonLots(X, Y, sampling_rate=Q, seed=7, num_workers=1).sample_indices()
    )
    assert np.array_equal(np.random.default_rng(7).random(3), PoissonLots(X, Y, sampling_rate=Q, seed=7)._rng.random(3))


def test_dataset_turns_auto_sharding_off():
    ds = PoissonLots(X, Y, sampling_rate=Q).dataset(2)
    assert ds.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.OFF


def test_one_workers_lots_through_distribute_only():
    lots = _workers()[1]
    for method in ("dataset", "as_py_dataset"):
        with pytest.raises(ValueError, match=rf"lots.{method}\(\) with num_workers=2: .*lots.distribute\(strategy\)"):
            getattr(lots, method)(2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with pytest.raises(ValueError, match="num_workers=2 but the optimizer's MirroredStrategy runs 1 worker"):
        lots.distribute(strategy)
    for x, _, w in lots._dataset(2):  # what distribute() cuts per replica: this worker's shard only
        real = x.numpy()[w.numpy() > 0, 0].astype(int)
        assert np.all(real % W == 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_workers=0), r"num_workers must be an integer in \[1, 1001\], got 0"),
        (dict(num_workers=2, worker_index=2), r"worker_index must be an integer in \[0, 1\], got 2"),
        (dict(num_workers=2, worker_index=-1), r"worker_index must be an integer in \[0, 1\], got -1"),
        (dict(replicas_per_worker=0), r"replicas_per_worker must be an integer >= 1, got 0"),
        (
            dict(replicas_per_worker=2, physical_batch_size=5),
            r"physical_batch_size must be a multiple of replicas_per_worker=2 .*got 5",
        ),
        (dict(num_workers=2, max_lot_size=502), r"max_lot_size must be an integer in \[1, 501\], got 502"),
    ],
)
def test_bad_shard_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoissonLots(X, Y, sampling_rate=Q, **kwargs)

"""Tests of the Poisson lot sampler: statistics against Binomial(N, q) closed forms."""

import types

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from keras_dpsgd.step.lots import PoissonLots


def _lots_of(sampler, num_lots):
    """Real (weight > 0) example ids of each lot, read back from the padded batches."""
    lots, current, seen = [], [], 0
    for x, y, w in sampler.lots(num_lots):
        assert np.all(x[w == 0] == 0) and np.all(y[w == 0] == 0)  # padding: finite zeros
        current.extend(x[w > 0, 0].astype(int).tolist())
        seen += 1
        if seen % sampler.gradient_accumulation_steps == 0:
            lots.append(current)
            current = []
    return lots


def _data(n):
    x = np.arange(n, dtype=np.float32)[:, None] + 1.0  # ids 1..n, so 0 marks padding
    return x, np.arange(n, dtype=np.int32) + 1


def test_lot_sizes_are_binomial_and_inclusion_is_q():
    n, q, m = 200, 0.1, 3000
    sampler = PoissonLots(*_data(n), sampling_rate=q, seed=1)
    incl = np.zeros((m, n), dtype=bool)
    for t in range(m):
        idx = sampler.sample_indices()
        assert len(np.unique(idx)) == len(idx)  # no repeats within a lot
        incl[t, idx] = True
    sizes = incl.sum(axis=1)
    mean, var = n * q, n * q * (1 - q)
    # Mean: std of the sample mean is sqrt(var / m) ~ 0.077; allow 6 of them.
    assert abs(sizes.mean() - mean) < 6 * np.sqrt(var / m)
    # Variance: std of the sample variance ~ var * sqrt(2 / m); allow 6 of them.
    assert abs(sizes.var(ddof=1) - var) < 6 * var * np.sqrt(2 / m)
    # Each example's inclusion frequency ~ q (std sqrt(q(1-q)/m) ~ 0.0055; 6 std over 200 examples).
    freq = incl.mean(axis=0)
    assert np.max(np.abs(freq - q)) < 6 * np.sqrt(q * (1 - q) / m)
    # Chi-square of the per-example counts ~ chi2(n): mean n, std sqrt(2n) = 20.
    chi2 = np.sum((incl.sum(axis=0) - m * q) ** 2 / (m * q * (1 - q)))
    assert abs(chi2 - n) < 6 * np.sqrt(2 * n)
    # Independence across steps: P(i in lot t and in lot t+1) = q^2, and lot
    # sizes of consecutive steps are uncorrelated.
    both = np.mean(incl[1:] & incl[:-1])
    assert abs(both - q * q) < 6 * np.sqrt(q * q * (1 - q * q) / ((m - 1) * n))
    r = np.corrcoef(sizes[1:], sizes[:-1])[0, 1]
    assert abs(r) < 6 / np.sqrt(m)
    # Independence across examples: P(i and j in the same lot) = q^2.
    pair = np.mean(incl[:, 0::2] & incl[:, 1::2])
    assert abs(pair - q * q) < 6 * np.sqrt(q * q / (m * n / 2))


def test_padded_batches_carry_each_lot_exactly_once():
    n = 60
    x, y = _data(n)
    reference = PoissonLots(x, y, sampling_rate=0.2, seed=7)
    sampler = PoissonLots(x, y, sampling_rate=0.2, seed=7)
    for lot in _lots_of(sampler, 50):
        expected = reference.sample_indices() + 1
        assert sorted(lot) == sorted(expected.tolist())
    assert sampler.overflow_count == 0


def test_overflow_uses_a_bigger_bucket_and_drops_nothing():
    x, y = _data(50)
    reference = PoissonLots(x, y, sampling_rate=0.5, max_lot_size=5, seed=3)
    sampler = PoissonLots(x, y, sampling_rate=0.5, max_lot_size=5, seed=3)
    shapes = set()
    for xb, _, w in sampler.lots(20):
        expected = reference.sample_indices() + 1
        assert sorted(xb[w > 0, 0].astype(int).tolist()) == sorted(expected.tolist())
        assert xb.shape[0] % 5 == 0 and xb.shape[0] >= len(expected)
        shapes.add(xb.shape[0])
    assert sampler.overflow_count == 20


def test_split_into_physical_batches_for_accumulation():
    x, y = _data(100)
    sampler = PoissonLots(x, y, expected_lot_size=30, physical_batch_size=8, seed=5)
    assert sampler.gradient_accumulation_steps == int(np.ceil(sampler.max_lot_size / 8)) > 1
    assert sampler.max_lot_size >= 30 + 6 * np.sqrt(30 * 0.7) - 1
    assert sampler.steps_per_epoch == sampler.lots_per_epoch * sampler.gradient_accumulation_steps
    reference = PoissonLots(x, y, expected_lot_size=30, physical_batch_size=8, seed=5)
    batches = list(sampler.lots(10))
    assert len(batches) == 10 * sampler.gradient_accumulation_steps
    assert all(b[0].shape == (8, 1) for b in batches)
    for lot in _lots_of(PoissonLots(x, y, expected_lot_size=30, physical_batch_size=8, seed=5), 10):
        assert sorted(lot) == sorted((reference.sample_indices() + 1).tolist())


@pytest.mark.parametrize("lot_size, most, replicas", [(30, 8, 1), (30, 16, 2), (30, 100, 1), (8, 8, 1), (2, 1, 1)])
def test_max_physical_batch_size_splits_each_lot_into_equal_batches_of_at_most_m(lot_size, most, replicas):
    """max_physical_batch_size=M: the padded lot of R rows (the default capacity) as k = ceil(R / M) batches of
    P = ceil(R / k) rows (a multiple of the replicas), P <= M, k·P - R < k·replicas; every batch of every lot the
    same shape; each lot's examples exactly once, real rows first (the padding after them)."""
    x, y = _data(100)
    kwargs = dict(expected_lot_size=lot_size, replicas_per_worker=replicas, seed=5)
    capacity = PoissonLots(x, y, **kwargs).max_lot_size
    sampler = PoissonLots(x, y, max_physical_batch_size=most, **kwargs)
    k, p = sampler.gradient_accumulation_steps, sampler.physical_batch_size
    assert k == -(-capacity // most) and p == -(-(-(-capacity // k)) // replicas) * replicas
    assert p <= most and p % replicas == 0 and 0 <= k * p - capacity < k * replicas
    assert sampler.max_lot_size == k * p and sampler.steps_per_epoch == sampler.lots_per_epoch * k
    batches = list(PoissonLots(x, y, max_physical_batch_size=most, **kwargs).lots(20))
    assert len(batches) == 20 * k and {b[0].shape for b in batches} == {(p, 1)}
    reference = PoissonLots(x, y, **kwargs)
    for t, lot in enumerate(_lots_of(sampler, 20)):
        assert sorted(lot) == sorted((reference.sample_indices() + 1).tolist())
        weights = np.concatenate([w for _, _, w in batches[t * k : (t + 1) * k]])
        assert np.all(weights[: len(lot)] == 1) and np.all(weights[len(lot) :] == 0)
    assert sampler.overflow_count == 0


@pytest.mark.parametrize("physical_batch_size", [None, 8])
def test_padding_to_a_multiple_carries_each_lot_exactly_once(physical_batch_size):
    """pad_to_multiple_of=m: each physical batch has the next multiple of m rows (at least m), every sampled
    example exactly once (none dropped), the same lots as the default padding, the same rate for the ledger."""
    x, y = _data(100)
    m = 4
    sampler = PoissonLots(
        x, y, expected_lot_size=30, physical_batch_size=physical_batch_size, pad_to_multiple_of=m, seed=5
    )
    reference = PoissonLots(x, y, expected_lot_size=30, physical_batch_size=physical_batch_size, seed=5)
    assert sampler.pad_to_multiple_of == m and reference.pad_to_multiple_of is None
    k = sampler.gradient_accumulation_steps
    assert (k, sampler.sampling_rate, sampler.expected_lot_size) == (
        reference.gradient_accumulation_steps,
        reference.sampling_rate,
        reference.expected_lot_size,
    )
    batches = list(sampler.lots(40))
    assert len(batches) == 40 * k
    for t in range(40):
        expected = reference.sample_indices() + 1
        lot = batches[t * k : (t + 1) * k]
        rows = {b[0].shape[0] for b in lot}
        assert len(rows) == 1  # the lot's physical batches share one size
        (r,) = rows
        assert r % m == 0 and r >= m and r * k - len(expected) < m * k  # the next multiple, not the capacity
        real = [int(v) for xb, _, w in lot for v in xb[w > 0, 0]]
        assert sorted(real) == sorted(expected.tolist())
    assert sampler.overflow_count == 0


def test_padding_to_a_multiple_keeps_the_lots_poisson():
    """The lots read back from the batches padded to a multiple: sizes Binomial(N, q), each example in with q."""
    n, q, m = 200, 0.1, 1500
    sampler = PoissonLots(*_data(n), sampling_rate=q, pad_to_multiple_of=8, seed=2)
    incl = np.zeros((m, n), dtype=bool)
    for t, lot in enumerate(_lots_of(sampler, m)):
        assert len(set(lot)) == len(lot)
        incl[t, np.asarray(lot, dtype=int) - 1] = True
    sizes = incl.sum(axis=1)
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 6 * np.sqrt(var / m)
    assert abs(sizes.var(ddof=1) - var) < 6 * var * np.sqrt(2 / m)
    assert np.max(np.abs(incl.mean(axis=0) - q)) < 6 * np.sqrt(q * (1 - q) / m)


def test_seed_none_is_not_deterministic_and_a_second_pass_continues_the_stream():
    x, y = _data(1000)
    a = PoissonLots(x, y, sampling_rate=0.5).sample_indices()
    b = PoissonLots(x, y, sampling_rate=0.5).sample_indices()
    assert not np.array_equal(np.sort(a), np.sort(b))
    sampler = PoissonLots(x, y, sampling_rate=0.5, seed=0)
    first = [b[2].sum() for b in sampler.lots(3)]
    second = [b[2].sum() for b in sampler.lots(3)]
    assert first != second


def test_dataset_trains_with_one_trace_and_empty_lots():
    n = 40
    x = np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32)
    sampler = PoissonLots(x, y, sampling_rate=0.02, seed=11)  # P(empty lot) = 0.98^40 ~ 0.45
    sizes = [int(w.sum()) for _, _, w in PoissonLots(x, y, sampling_rate=0.02, seed=11).lots(60)]
    assert 0 in sizes and max(sizes) > 0
    model = keras.Sequential([keras.layers.Dense(1, input_shape=(3,))])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(sampler.dataset(), steps_per_epoch=2, epochs=1, verbose=0)
    traces = model.train_function.experimental_get_tracing_count()  # first call traces (variables)
    hist = model.fit(sampler.dataset(), steps_per_epoch=30, epochs=2, verbose=0)
    assert np.all(np.isfinite(hist.history["loss"]))
    assert model.train_function.experimental_get_tracing_count() == traces  # no retrace per lot size


def test_configure_sets_the_optimizer_and_checks_accumulation():
    x, y = _data(100)
    sampler = PoissonLots(x, y, expected_lot_size=10)
    opt = types.SimpleNamespace(gradient_accumulation_steps=1, expected_lot_size=None, sampling_rate=None)
    assert sampler.configure(opt) is opt
    assert opt.expected_lot_size == pytest.approx(10.0) and opt.sampling_rate == pytest.approx(0.1)
    opt.gradient_accumulation_steps = 2
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        sampler.configure(opt)


def test_from_dataset():
    x, y = _data(30)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    sampler = PoissonLots.from_dataset(ds, sampling_rate=0.5, seed=2)
    assert sampler.num_examples == 30
    ref = PoissonLots(x, y, sampling_rate=0.5, seed=2)
    for lot in _lots_of(sampler, 5):
        assert sorted(lot) == sorted((ref.sample_indices() + 1).tolist())
    with pytest.raises(ValueError, match="infinite"):
        PoissonLots.from_dataset(ds.repeat(), sampling_rate=0.5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "exactly one"),
        ({"sampling_rate": 0.1, "expected_lot_size": 2}, "exactly one"),
        ({"sampling_rate": 0.0}, "sampling_rate must be in"),
        ({"sampling_rate": 1.5}, "sampling_rate must be in"),
        ({"expected_lot_size": 11}, "expected_lot_size must be in"),
        ({"sampling_rate": 0.1, "physical_batch_size": 0}, "physical_batch_size"),
        ({"sampling_rate": 0.1, "max_lot_size": 0}, "max_lot_size"),
        ({"sampling_rate": 0.1, "seed": 1.5}, "seed"),
        ({"sampling_rate": 0.1, "sample_weight": -np.ones(10)}, "sample_weight"),
        ({"sampling_rate": 0.1, "pad_to_multiple_of": 0}, "pad_to_multiple_of"),
        (
            {"sampling_rate": 0.1, "pad_to_multiple_of": 3, "replicas_per_worker": 2, "physical_batch_size": 2},
            "multiple",
        ),
        ({"sampling_rate": 0.1, "pad_to_multiple_of": 4, "num_workers": 2}, "num_workers"),
        ({"sampling_rate": 0.1, "max_physical_batch_size": 0}, r"max_physical_batch_size must be .*>= 1, got 0"),
        ({"sampling_rate": 0.1, "max_physical_batch_size": 2.5}, r"max_physical_batch_size must be .*got 2\.5"),
        (
            {"sampling_rate": 0.1, "max_physical_batch_size": 3, "replicas_per_worker": 2},
            r"max_physical_batch_size must be a multiple of replicas_per_worker=2 .*got 3",
        ),
        (
            {"sampling_rate": 0.1, "max_physical_batch_size": 4, "physical_batch_size": 4},
            "at most one of physical_batch_size and max_physical_batch_size, got physical_batch_size=4, "
            "max_physical_batch_size=4",
        ),
    ],
)
def test_validation(kwargs, match):
    x, y = _data(10)
    with pytest.raises(ValueError, match=match):
        PoissonLots(x, y, **kwargs)


def test_mismatched_sizes_are_refused():
    with pytest.raises(ValueError, match="first dimension"):
        PoissonLots(np.zeros((5, 2)), np.zeros(4), sampling_rate=0.5)


def test_dataset_yields_the_same_batches_as_lots():
    x, y = _data(40)
    features = {"a": x, "b": np.stack([x[:, 0], -x[:, 0]], axis=1).astype(np.int32)}
    expected = list(PoissonLots(features, y, sampling_rate=0.3, physical_batch_size=4, seed=8).lots(6))
    got = list(PoissonLots(features, y, sampling_rate=0.3, physical_batch_size=4, seed=8).dataset(6))
    assert (
        len(got)
        == len(expected)
        == 6 * PoissonLots(x, y, sampling_rate=0.3, physical_batch_size=4).gradient_accumulation_steps
    )
    for (xe, ye, we), (xg, yg, wg) in zip(expected, got):
        for key in ("a", "b"):
            np.testing.assert_array_equal(xg[key].numpy(), xe[key])
            assert xg[key].dtype == tf.as_dtype(xe[key].dtype)
        np.testing.assert_array_equal(yg.numpy(), ye)
        np.testing.assert_array_equal(wg.numpy(), we)


@pytest.mark.parametrize(
    "kwargs",
    [{"pad_to_multiple_of": 3}, {"max_lot_size": 10, "physical_batch_size": 5}, {"max_physical_batch_size": 6}],
)
def test_dataset_draws_the_lots_of_lots_in_blocks_and_each_pass_continues_the_stream(kwargs):
    # tf.data receives the lot indices in blocks of lots (several blocks here), cut into batches by tf.data: the same
    # batches as lots(), padding and overflow (a capacity of 10 at L = 12) included; a second pass draws fresh lots.
    x, y = _data(60)
    weights = np.linspace(0.5, 2.0, 60).astype(np.float32)
    reference = PoissonLots(x, y, expected_lot_size=12, sample_weight=weights, seed=4, **kwargs)
    sampler = PoissonLots(x, y, expected_lot_size=12, sample_weight=weights, seed=4, **kwargs)
    dataset = sampler.dataset(35)
    for _ in range(2):
        expected = list(reference.lots(35))
        got = list(dataset)
        assert len(got) == len(expected) == 35 * sampler.gradient_accumulation_steps
        for e, g in zip(expected, got):
            for want, have in zip(e, g):
                np.testing.assert_array_equal(have.numpy(), want)
                assert have.dtype == tf.as_dtype(want.dtype)
    assert sampler.overflow_count == reference.overflow_count


def test_num_lots_is_validated():
    sampler = PoissonLots(*_data(10), sampling_rate=0.5)
    with pytest.raises(ValueError, match="num_lots"):
        sampler.dataset(-1)
    with pytest.raises(ValueError, match="num_lots"):
        sampler.lots(1.5)

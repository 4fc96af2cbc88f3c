"""StreamingPoissonLots (issue 40, item 5): lots of data read from disk or a tf.data stream are Poisson lots.

Oracles: the Binomial(N, q) closed forms at 5 standard deviations (lot sizes, each example's inclusion frequency,
pairs of examples in one lot, pairs of lots of one pass), the rows read back (x and y of one example together,
every position of the stream reachable, across chunk and shard boundaries), and refusals that name the argument.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_dpsgd import PoissonLots, StreamingPoissonLots

N, Q = 200, 0.1


def _ids(n=N):
    """Example i has x = [i + 1, -(i + 1)] and y = i + 1 (0 marks padding)."""
    ids = np.arange(1, n + 1)
    return np.stack([ids, -ids], axis=1).astype(np.float32), ids.astype(np.int64)


def _stream(n=N, **kwargs):
    x, y = _ids(n)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    return StreamingPoissonLots.from_dataset(dataset, **kwargs)


def _npy(tmp_path, n=N, cuts=(70, 130), **kwargs):
    x, y = _ids(n)
    xs, ys = [], []
    for s, (lo, hi) in enumerate(zip((0,) + cuts, cuts + (n,))):
        xs.append(str(tmp_path / f"x-{s}.npy"))
        ys.append(str(tmp_path / f"y-{s}.npy"))
        np.save(xs[-1], x[lo:hi])
        np.save(ys[-1], y[lo:hi])
    return StreamingPoissonLots.from_npy(xs, ys, **kwargs)


def _inclusion(sampler, num_lots):
    """[lots, N] inclusion matrix, read back from the padded batches (checking each row and the padding)."""
    incl = np.zeros((num_lots, sampler.num_examples), dtype=bool)
    lot, part = 0, 0
    for x, y, w in sampler.lots(num_lots):
        real = w > 0
        assert np.all(x[~real] == 0) and np.all(y[~real] == 0)  # padding: zeros of weight 0
        assert np.array_equal(x[real, 0], y[real]) and np.array_equal(x[real, 1], -y[real])  # one example's row
        ids = y[real] - 1
        assert not incl[lot, ids].any()  # no example twice in a lot
        incl[lot, ids] = True
        part += 1
        if part % sampler.gradient_accumulation_steps == 0:
            lot += 1
    assert lot == num_lots
    return incl


def _check_poisson(incl, q):
    """Sizes, per-example frequencies, pairs within a lot and across lots against Binomial closed forms (5 sigma)."""
    m, n = incl.shape
    sizes = incl.sum(axis=1)
    assert abs(sizes.mean() - n * q) < 5 * np.sqrt(n * q * (1 - q) / m)
    var = n * q * (1 - q)
    assert abs(sizes.var(ddof=1) - var) < 5 * var * np.sqrt(2 / (m - 1)) * 1.2  # (1.2: the Binomial's kurtosis)
    freq = incl.mean(axis=0)  # each example: Binomial(m, q) / m
    assert np.all(np.abs(freq - q) < 5 * np.sqrt(q * (1 - q) / m)), freq.min()
    assert freq.min() > 0  # every example appears
    p2 = q * q  # two events of probability q, independent: both with q^2
    pairs = (incl[:, :-1] & incl[:, 1:]).mean()  # examples i, i+1 in one lot
    across = (incl[:-1] & incl[1:]).mean()  # one example in lots t and t+1 (same pass, mostly)
    for both, count in ((pairs, m * (n - 1)), (across, (m - 1) * n)):
        # The count's variance is at most 3 count p2(1 - p2) (neighbouring pairs share a draw).
        assert abs(both - p2) < 5 * np.sqrt(3 * p2 * (1 - p2) / count)


def test_streamed_lots_are_poisson_at_the_rate():
    """From a tf.data stream, 8 lots per pass, chunks of 64 rows (N = 200 is no multiple): Poisson lots."""
    sampler = _stream(sampling_rate=Q, lots_per_pass=8, chunk_size=64, seed=3)
    assert sampler.lots_per_pass == 8 and sampler.sampling_rate == Q and sampler.expected_lot_size == N * Q
    _check_poisson(_inclusion(sampler, 2000), Q)


def test_memory_mapped_shards_give_poisson_lots(tmp_path):
    """From three .npy shards, memory-mapped, read by index: Poisson lots, every example reachable."""
    sampler = _npy(tmp_path, expected_lot_size=N * Q, seed=4)
    assert sampler.num_examples == N and sampler.lots_per_pass == 1
    _check_poisson(_inclusion(sampler, 2000), Q)


def test_lots_are_padded_like_poisson_lots_and_split_for_accumulation():
    """The capacity, the physical batches and the element spec are PoissonLots' for the same (N, q)."""
    x, y = _ids()
    memory = PoissonLots(x, y, sampling_rate=Q, physical_batch_size=8, seed=0)
    streamed = _stream(sampling_rate=Q, physical_batch_size=8, seed=0)
    assert (streamed.max_lot_size, streamed.gradient_accumulation_steps, streamed.steps_per_epoch) == (
        memory.max_lot_size,
        memory.gradient_accumulation_steps,
        memory.steps_per_epoch,
    )
    assert streamed.element_spec() == memory.element_spec()
    batches = list(streamed.lots(3))
    assert len(batches) == 3 * memory.gradient_accumulation_steps
    assert {b[0].shape[0] for b in batches} == {8}
    dataset = streamed.dataset(3)
    assert int(dataset.cardinality()) == 3 * memory.gradient_accumulation_steps
    assert sum(float(tf.reduce_sum(w)) for _, _, w in dataset) > 0


def test_sample_weights_of_the_data_go_with_their_rows():
    x, y = _ids()
    dataset = tf.data.Dataset.from_tensor_slices((x, y, y.astype(np.float32) / 10))
    sampler = StreamingPoissonLots.from_dataset(dataset, sampling_rate=0.5, seed=0)
    for _, yy, w in sampler.lots(4):
        np.testing.assert_allclose(w[w > 0], yy[w > 0] / 10, rtol=1e-6)
        assert np.all(yy[w == 0] == 0)


def test_tfrecord_files_are_counted_once_and_streamed(tmp_path, caplog):
    x, y = _ids()
    files = [str(tmp_path / f"part-{s}.tfrecord") for s in range(2)]
    for s, f in enumerate(files):
        with tf.io.TFRecordWriter(f) as writer:
            for i in range(s * 120, min(N, (s + 1) * 120)):
                feature = {
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[i]])),
                }
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    spec = {"x": tf.io.FixedLenFeature([2], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}

    def parse(records):
        example = tf.io.parse_example(records, spec)
        return example["x"], example["y"]

    sampler = StreamingPoissonLots.from_tfrecord(files, parse, sampling_rate=Q, chunk_size=64, seed=5)
    assert sampler.num_examples == N and "counted N = 200 examples in one pass" in caplog.text
    _check_poisson(_inclusion(sampler, 400), Q)
    given = StreamingPoissonLots.from_tfrecord(files, parse, num_examples=N, sampling_rate=Q)
    assert given.num_examples == N


def test_a_stream_whose_length_changed_is_refused_before_its_lots():
    """num_examples says 201, a pass reads 200: no lot of the pass comes out."""
    x, y = _ids()
    unknown = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True)  # cardinality unknown
    sampler = StreamingPoissonLots.from_dataset(unknown, num_examples=N + 1, sampling_rate=Q, seed=0)
    with pytest.raises(ValueError, match=r"held 200 examples in this pass.* N = 201.*no lot of this pass was used"):
        next(iter(sampler.lots(1)))


@pytest.mark.parametrize(
    "dataset, kwargs, message",
    [
        ("infinite", {}, r"dataset must be finite to be Poisson-sampled.*infinite dataset"),
        ("arrays", {}, r"dataset must be a tf.data.Dataset of single examples, got tuple"),
        ("finite", {"num_examples": 7}, r"num_examples must be the dataset's cardinality 200, got 7"),
        ("finite", {"num_examples": 0}, r"num_examples must be an integer >= 1"),
        ("ragged", {}, r"dataset must have examples of one fixed shape"),
        ("single", {}, r"dataset must hold \(x, y\) or \(x, y, sample_weight\) examples"),
        ("finite", {"lots_per_pass": 0}, r"lots_per_pass must be an integer >= 1"),
    ],
)
def test_bad_sources_are_refused_naming_the_argument(dataset, kwargs, message):
    x, y = _ids()
    made = {
        "infinite": lambda: tf.data.Dataset.from_tensor_slices((x, y)).repeat(),
        "arrays": lambda: (x, y),
        "finite": lambda: tf.data.Dataset.from_tensor_slices((x, y)),
        "ragged": lambda: tf.data.Dataset.from_tensor_slices((x, y)).map(
            lambda a, b: (a[: tf.cast(b % 2, tf.int32)], b)
        ),
        "single": lambda: tf.data.Dataset.from_tensor_slices(x),
    }[dataset]()
    with pytest.raises((ValueError, TypeError), match=message):
        StreamingPoissonLots.from_dataset(made, sampling_rate=Q, **kwargs)


def test_the_seed_defaults_to_the_operating_systems_entropy():
    """Two samplers without a seed draw different lots (a fixed default seed would repeat them)."""
    a, b = _stream(sampling_rate=0.5), _stream(sampling_rate=0.5)
    assert not np.array_equal(_inclusion(a, 4), _inclusion(b, 4))


def test_pad_to_multiple_of_pads_streamed_lots_like_poisson_lots():
    """PoissonLots' pad_to_multiple_of (issue 41): each streamed lot padded to the next multiple of m rows."""
    sampler = _stream(sampling_rate=Q, pad_to_multiple_of=8, seed=2)
    assert sampler.pad_to_multiple_of == 8
    for x, _, w in sampler.lots(20):
        real = int((w > 0).sum())
        assert len(x) % 8 == 0 and real <= len(x) < real + 8 or (real == 0 and len(x) == 8)

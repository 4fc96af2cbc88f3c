"""The torch backend's Gaussian sampler (keras_dpsgd.backends.torch): the library's Box–Muller on the words of a
keyed Philox generator: the TF sampler's values from the same words, distribution, tails, keys."""

import math

import numpy as np
import pytest
import scipy.stats
import torch

from keras_dpsgd.backends.torch import _noise, _ops


def _draw(n, seed=3, step=0, index=0):
    return _noise.standard_normal((n,), _noise.seeded_key(seed, step, index)).numpy()


def test_the_words_make_the_tf_samplers_values():
    """The core's Box–Muller over TensorFlow's table on the same words (stream 0 of the key): the same normals."""
    import tensorflow as tf

    from keras_dpsgd.backends.tensorflow.ops import TF_OPS
    from keras_dpsgd.dp.noise import box_muller

    key = _noise.seeded_key(3, 0, 0)
    words = _ops.NOISE_OPS.random_words(key, (2, 2048), 0)
    z = _noise.standard_normal((4096,), key).numpy()
    want = box_muller(TF_OPS, *[tf.constant(w) for w in words]).numpy().reshape(-1)
    np.testing.assert_allclose(z, want, rtol=2e-6, atol=2e-6)


def test_matches_the_standard_normal_with_full_tails():
    z = _draw(400_001)  # Odd size: the last pair is cut.
    assert z.shape == (400_001,) and z.dtype == np.float32
    assert abs(z.mean()) < 5 / math.sqrt(z.size)
    assert abs(z.var() - 1.0) < 5 * math.sqrt(2.0 / z.size)
    assert scipy.stats.kstest(z, "norm").pvalue > 1e-3
    half = z[:200_000], z[200_001:400_001]  # the cos and sin halves of the pairs
    assert abs(np.corrcoef(*half)[0, 1]) < 5 / math.sqrt(200_000)
    big = np.abs(_draw(2_000_000, seed=9))
    for t in (2.0, 3.0, 4.0, 4.5):  # P(|Z| > t) within 5 binomial standard deviations
        p = 2 * scipy.stats.norm.sf(t)
        expected, sd = big.size * p, math.sqrt(big.size * p * (1 - p))
        assert abs(np.sum(big > t) - expected) < 5 * sd + 1, t


def test_pairs_with_a_zero_word_are_refined(monkeypatch):
    """Pairs with x0 == 0 (prob. 2^-32) get the refined radius from two more words: past sqrt(2·32·ln 2)."""
    real, calls = _ops.WordReader.read, []

    def read(self, n):
        w = real(self, n).copy()
        if not calls:
            w[[0, 1, 3]] = 0  # x0 of pairs 0, 1 and 3
        calls.append(n)
        return w

    monkeypatch.setattr(_ops.WordReader, "read", read)
    z = _noise.standard_normal((10,), _noise.seeded_key(7, 0, 0)).numpy()
    radius = np.hypot(z[:5], z[5:])
    assert calls == [5, 5, 10]  # x0 and x1 of the 5 pairs, then the refinement's 2 words a pair
    assert np.all(radius[[0, 1, 3]] > math.sqrt(-2 * math.log(2.0**-32)))
    assert np.all(radius[[2, 4]] < math.sqrt(-2 * math.log(2.0**-32)))


def test_keys_give_independent_streams_and_entropy_keys_never_repeat():
    base = _draw(10_000)
    np.testing.assert_array_equal(base, _draw(10_000))  # the same key, the same draw
    for other in (_draw(10_000, index=1), _draw(10_000, step=1), _draw(10_000, seed=4)):
        assert abs(np.corrcoef(base, other)[0, 1]) < 5 / math.sqrt(base.size)
    keys = _noise.EntropyKeys()
    first, second = keys.next_release(), keys.next_release()
    again = _noise.EntropyKeys().next_release()
    assert len({first(0), first(1), second(0), again(0)}) == 4


def test_add_gaussian_scales_and_keeps_shape_and_dtype():
    x = torch.full((300, 7), 2.0)
    key = _noise.seeded_key(5, 0, 0)
    y = _noise.add_gaussian(x, 0.5, key).numpy()
    z = _noise.standard_normal((300, 7), key).numpy()
    assert y.shape == (300, 7) and y.dtype == np.float32
    np.testing.assert_allclose(y, 2.0 + 0.5 * z, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("halves", [False, True])
def test_the_chunked_draw_and_its_in_place_addition_are_the_cores_values(monkeypatch, halves):
    """By chunks (odd and even starts of the second word stream, a chunk cut at the end), and in two halves on two
    threads (a large draw's, here from 2 pairs), the sampler gives the core's ``scaled_normal`` on the whole draw value
    for value, and added into the caller's tensor, ``x + noise``."""
    from keras_dpsgd.dp.noise import scaled_normal

    monkeypatch.setattr(_noise, "_CHUNK", 5)
    monkeypatch.setattr(_noise, "_PARALLEL_PAIRS", 2 if halves else 1 << 40)
    for n in (1, 2, 11, 1001):
        key = _noise.seeded_key(3, 1, 2)
        want = scaled_normal(_ops.NOISE_OPS, n, key, 1.3)
        np.testing.assert_array_equal(_noise._normal(n, key, 1.3).numpy(), want)
        x = torch.randn(n)
        y = x.clone()
        assert _noise.add_gaussian(y, 1.3, key, in_place=True) is y
        np.testing.assert_array_equal(y.numpy(), (x + torch.from_numpy(want)).numpy())


def test_noise_drawn_ahead_is_handed_over_once_and_only_for_its_key_size_and_scale():
    """``NoiseAhead`` (a release's noise on a second thread while the step computes its clipped sum): the draw of
    the release's own (key, size, scale), value for value, once; any other key, size or scale gets nothing (the
    release then draws its own), and what is not taken is dropped."""
    key = _noise.seeded_key(3, 4, 0)
    ahead = _noise.NoiseAhead({0: (key, 1001, 1.3), 1: (key + 1, 10, 1.0), 2: (key, 7, 2.0)})
    np.testing.assert_array_equal(ahead.take(0, key, 1001, 1.3).numpy(), _noise._normal(1001, key, 1.3).numpy())
    assert ahead.take(0, key, 1001, 1.3) is None  # once
    assert ahead.take(1, key, 10, 1.0) is None  # another key
    assert ahead.take(2, key, 7, 2.5) is None  # another scale
    ahead.close()

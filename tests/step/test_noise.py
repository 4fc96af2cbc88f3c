"""The Gaussian noise sampler (keras_dpsgd.step._noise): distribution, tails, determinism."""

import math

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

from keras_dpsgd.step import _noise


def _draw(n, seed=(3, 4)):
    return _noise.standard_normal([n], tf.constant(seed, tf.int64)).numpy()


def test_matches_the_standard_normal():
    z = _draw(400_001)  # Odd size: the last pair is cut.
    assert z.shape == (400_001,) and z.dtype == np.float32
    assert abs(z.mean()) < 5 / math.sqrt(z.size)  # 5 standard errors
    assert abs(z.var() - 1.0) < 5 * math.sqrt(2.0 / z.size)
    assert scipy.stats.kstest(z, "norm").pvalue > 1e-3
    # Independence of the two normals of a pair (cos and sin halves) and of neighbours.
    half = z[:200_000], z[200_001:400_001]
    assert abs(np.corrcoef(*half)[0, 1]) < 5 / math.sqrt(200_000)
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 5 / math.sqrt(z.size)


def test_tail_frequencies_match():
    """P(|Z| > t) within 5 binomial standard deviations, for t up to 4.5 (4e6 samples)."""
    z = np.abs(_draw(4_000_000, seed=(9, 1)))
    for t in (2.0, 3.0, 4.0, 4.5):
        p = 2 * scipy.stats.norm.sf(t)
        expected, sd = z.size * p, math.sqrt(z.size * p * (1 - p))
        assert abs(np.sum(z > t) - expected) < 5 * sd + 1, t


def test_radius_reaches_past_tensorflows_clamp():
    """TF's Box-Muller clamps u1 >= 1e-7 (radius <= 5.68); ours reaches 11.6 for x0 = 0."""
    x0 = tf.constant([0, 0, 1, 2**31], tf.uint32)
    x1 = tf.constant([0, 0, 0, 2**30], tf.uint32)  # angle ~0 and ~π/2
    x2, x3 = tf.constant([0, 1, 5, 5], tf.uint32), tf.constant([0, 0, 5, 5], tf.uint32)
    z = _noise.box_muller(x0, x1, x2, x3).numpy()  # x2, x3 matter only where x0 == 0
    radius = np.hypot(z[0], z[1])
    np.testing.assert_allclose(radius[0], math.sqrt(-2 * math.log(0.5 * 2.0**-96)), rtol=1e-5)
    np.testing.assert_allclose(radius[1], math.sqrt(-2 * math.log(2.0**-64)), rtol=1e-5)
    np.testing.assert_allclose(radius[2], math.sqrt(-2 * math.log(1.5 * 2.0**-32)), rtol=1e-5)
    np.testing.assert_allclose(radius[3], math.sqrt(2 * math.log(2.0)), rtol=1e-5)
    assert radius[0] > 11.5 > 5.68
    np.testing.assert_allclose(z[:, 3], [0.0, math.sqrt(2 * math.log(2.0))], atol=1e-4)


def test_stateless_in_the_seed():
    a, b = _draw(1001, seed=(1, 2)), _draw(1001, seed=(1, 2))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, _draw(1001, seed=(1, 3)))


@pytest.mark.parametrize("shape", [[], [0], [1], [3, 5, 2]])
def test_shapes_and_dtypes(shape):
    seed = tf.constant([5, 6], tf.int64)
    z = _noise.standard_normal(shape, seed, tf.float64)
    assert z.shape == tuple(shape) and z.dtype == tf.float64
    traced = tf.function(lambda s: _noise.standard_normal(tf.constant(shape, tf.int32), s))
    np.testing.assert_allclose(traced(seed).numpy(), z.numpy(), rtol=1e-6)


def test_pairs_with_a_zero_word_are_refined(monkeypatch):
    """standard_normal refines the pairs with x0 == 0 (prob. 2^-32), and only those."""
    real, shapes = _noise._words, []

    def words(shape, seed):
        w = real(shape, seed)
        if not shapes:  # The [2, P] words: make x0 zero in pairs 0, 1 and 3.
            w = tf.tensor_scatter_nd_update(w, [[0, 0], [0, 1], [0, 3]], tf.zeros([3], tf.uint32))
        shapes.append(tuple(tf.get_static_value(shape)))
        return w

    monkeypatch.setattr(_noise, "_words", words)
    z = _noise.standard_normal([10], tf.constant([7, 8], tf.int64)).numpy()
    assert shapes == [(2, 5), (2, 5)]  # The words, then the refinement words
    radius = np.hypot(z[:5], z[5:])  # Pair i is (z[i], z[5 + i]).
    floor = math.sqrt(-2 * math.log(2.0**-32))  # u1 < 2^-32 after refinement
    assert np.all(radius[[0, 1, 3]] > floor) and np.all(radius[[2, 4]] < floor)


def test_add_gaussian_scales_by_stddev():
    x = tf.fill([300, 500], 2.0)
    out = _noise.add_gaussian(x, tf.constant(3.0), tf.constant([1, 9], tf.int64)).numpy()
    z = (out - 2.0) / 3.0
    assert out.shape == (300, 500)
    assert abs(z.mean()) < 5 / math.sqrt(z.size)
    assert abs(z.var() - 1.0) < 5 * math.sqrt(2.0 / z.size)
    assert scipy.stats.kstest(z.ravel(), "norm").pvalue > 1e-3
    # Same key, same noise as standard_normal (the scale is folded into the radius).
    same = _noise.standard_normal([300 * 500], tf.constant([1, 9], tf.int64)).numpy()
    np.testing.assert_allclose(z.ravel(), same, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(_noise.add_gaussian(x, 0.0, tf.constant([1, 9], tf.int64)).numpy(), x.numpy())


def test_cos_by_quarter_turns_matches_cos_and_sin():
    """The polynomial cosine (the JAX sampler's) of θ = 2π·w·2⁻³², shift 0 and 1: cos θ and sin θ to ~1e-7,
    exact at the quarter turns; on float32 numpy arrays, where only the arithmetic is float32."""
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    quarters = np.array([0, 2**30, 2**31, 3 * 2**30, 2**32 - 1], np.uint32)
    w = np.concatenate([words, quarters]).astype(np.float32)
    angle = w.astype(np.float64) * (2 * math.pi * 2.0**-32)  # the float32 word's exact angle
    cos = _noise.cos_by_quarter_turns(w, np.float32(0.0), np, np.where)
    sin = _noise.cos_by_quarter_turns(w, np.float32(1.0), np, np.where)
    assert cos.dtype == sin.dtype == np.float32
    assert np.abs(cos - np.cos(angle)).max() < 2e-7
    assert np.abs(sin - np.sin(angle)).max() < 2e-7
    np.testing.assert_array_equal(cos[-5:], [1, 0, -1, 0, 1])
    np.testing.assert_array_equal(sin[-5:], [0, 1, 0, -1, 0])

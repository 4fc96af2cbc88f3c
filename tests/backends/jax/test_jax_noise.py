"""The JAX backend's Gaussian sampler (keras_dpsgd.backends.jax._noise): the library's Box–Muller on XLA's
threefry bits, with the angle's cosine and sine from polynomials: distribution, tails, pairs, keys."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats

from keras_dpsgd.backends.jax import _noise


def _draw(n, seed=3):
    return np.asarray(_noise.standard_normal((n,), _noise.seeded_key(seed, 0, 0)))


def test_sampler_is_the_library_sampler():
    """Box–Muller from full words, refined where x0 = 0: the TF sampler's values, tails past TF's 5.68."""
    import tensorflow as tf

    from keras_dpsgd.step import _noise as tf_noise

    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=(4, 4096), dtype=np.uint64).astype(np.uint32)
    words[0, :3] = 0  # the refined pairs
    words[2, :3] = [0, 1, 2**31]
    words[1, 3:9] = [0, 2**30, 2**31, 3 * 2**30, 2**32 - 1, 2**29]  # the quarter turns, the last word, π/4
    got = np.asarray(_noise.box_muller(*words))
    want = tf_noise.box_muller(*[tf.constant(w) for w in words]).numpy()
    radius = np.hypot(want[0], want[1])
    # TF's cos/sin of the float32 angle and JAX's polynomials each err by ~1e-7 of the radius.
    assert np.all(np.abs(got - want) < 1e-6 * radius + 1e-7)
    np.testing.assert_allclose(np.hypot(got[0], got[1]), radius, rtol=1e-6)
    assert np.abs(got).max() > 5.7  # TF's clamped sampler never goes past 5.68
    # Exact axes at the quarter turns (cos and sin of 0, π/2, π, 3π/2, 2π).
    r = np.hypot(got[0], got[1])[3:8]
    np.testing.assert_array_equal(got[:, 3:8], [[r[0], 0, -r[2], 0, r[4]], [0, r[1], 0, -r[3], 0]])


def test_matches_the_standard_normal():
    z = _draw(400_001)  # Odd size: the last pair is cut.
    assert z.shape == (400_001,) and z.dtype == np.float32
    assert abs(z.mean()) < 5 / math.sqrt(z.size)
    assert abs(z.var() - 1.0) < 5 * math.sqrt(2.0 / z.size)
    assert scipy.stats.kstest(z, "norm").pvalue > 1e-3
    half = z[:200_000], z[200_001:400_001]  # the cos and sin halves of the pairs
    assert abs(np.corrcoef(*half)[0, 1]) < 5 / math.sqrt(200_000)
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 5 / math.sqrt(z.size)
    # The pair's angle is uniform: no quarter or eighth of the circle is favoured (the polynomial's seams).
    angle = np.arctan2(half[1], half[0])
    counts = np.histogram(angle, bins=16, range=(-math.pi, math.pi))[0]
    assert scipy.stats.chisquare(counts).pvalue > 1e-3


def test_tail_frequencies_match():
    """P(|Z| > t) within 5 binomial standard deviations, for t up to 4.5 (4e6 samples)."""
    z = np.abs(_draw(4_000_000, seed=9))
    for t in (2.0, 3.0, 4.0, 4.5):
        p = 2 * scipy.stats.norm.sf(t)
        expected, sd = z.size * p, math.sqrt(z.size * p * (1 - p))
        assert abs(np.sum(z > t) - expected) < 5 * sd + 1, t


def test_keys_give_independent_streams():
    """Tensor index, step and seed each change the draw; the same key gives the same draw, traced or not
    (up to float32 rounding: XLA fuses the traced expression differently)."""
    base = _draw(10_000)
    others = [
        np.asarray(_noise.standard_normal((10_000,), _noise.seeded_key(3, 0, 1))),
        np.asarray(_noise.standard_normal((10_000,), _noise.seeded_key(3, 1, 0))),
        _draw(10_000, seed=4),
    ]
    for other in others:
        assert abs(np.corrcoef(base, other)[0, 1]) < 5 / math.sqrt(base.size)
    traced = jax.jit(lambda k: _noise.standard_normal((10_000,), k))(_noise.seeded_key(3, 0, 0))
    np.testing.assert_allclose(np.asarray(traced), base, rtol=1e-6, atol=1e-6)


def test_add_gaussian_scales_and_keeps_shape_and_dtype():
    x = jnp.full((300, 7), 2.0, jnp.float32)
    key = _noise.seeded_key(5, 0, 0)
    y = np.asarray(_noise.add_gaussian(x, 0.5, key))
    z = np.asarray(_noise.standard_normal((300, 7), key))
    assert y.shape == (300, 7) and y.dtype == np.float32
    np.testing.assert_allclose(y, 2.0 + 0.5 * z, rtol=1e-6, atol=1e-6)


def test_pairs_with_a_zero_word_are_refined(monkeypatch):
    """Pairs with x0 == 0 (prob. 2^-32) get the refined radius from two more words; the rest do not."""
    real, calls = _noise._words, []

    def words(key, shape):
        w = real(key, shape)
        if not calls:
            w = w.at[0, jnp.array([0, 1, 3])].set(0)
        calls.append(shape)
        return w

    monkeypatch.setattr(_noise, "_words", words)
    z = np.asarray(_noise.standard_normal((10,), _noise.seeded_key(7, 0, 0)))
    radius = np.hypot(z[:5], z[5:])
    assert np.all(radius[[0, 1, 3]] > math.sqrt(-2 * math.log(2.0**-32)))  # beyond any unrefined radius
    assert np.all(radius[[2, 4]] < math.sqrt(-2 * math.log(2.0**-32)))

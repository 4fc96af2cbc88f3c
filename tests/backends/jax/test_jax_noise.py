"""The JAX backend's noise source (keras_dpsgd.backends.jax._noise: the core's sampler over JAX_OPS): keys,
traced and eager draws, shapes and dtypes. The sampler's distribution and tails are tested once per table
in tests/dp/test_dp_noise.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from keras_dpsgd.backends.jax import _noise


def _draw(n, seed=3):
    return np.asarray(_noise.standard_normal((n,), _noise.seeded_key(seed, 0, 0)))


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
    assert _noise.standard_normal((2, 3), key, jnp.bfloat16).dtype == jnp.bfloat16

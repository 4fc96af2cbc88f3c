"""The JAX suite's random draws by size class (tests/_jax_initializers.py) are Keras's own, bit for bit: every
random initializer of Keras and ``keras.random``'s draws, on shapes of sizes 1 to a few thousand, against Keras's
own JAX functions (one program per shape); a draw inside a trace and a float16 draw take Keras's own path."""

import jax
import keras
import numpy as np
import pytest
from keras.src.backend.jax import random as keras_jax_random

from tests import _jax_initializers

SHAPES = [(1,), (3,), (5, 7), (24, 8), (8, 2, 4), (3, 3, 16, 5), (1000,), (2, 1025)]
INITIALIZERS = [
    keras.initializers.RandomNormal(mean=0.3, stddev=0.02),
    keras.initializers.TruncatedNormal(mean=-0.1, stddev=0.5),
    keras.initializers.RandomUniform(minval=-0.3, maxval=0.7),
    keras.initializers.GlorotUniform(),
    keras.initializers.GlorotNormal(),
    keras.initializers.HeNormal(),
    keras.initializers.LecunUniform(),
    keras.initializers.VarianceScaling(scale=2.0, mode="fan_avg", distribution="untruncated_normal"),
    keras.initializers.Orthogonal(),
]


@pytest.fixture
def keras_own(monkeypatch):
    """Keras's own JAX draws, for the duration of a test."""
    for name, fn in _jax_initializers.ORIGINAL.items():
        monkeypatch.setattr(keras_jax_random, name, fn)


def _draws(shape):
    out = []
    for init in INITIALIZERS[: None if len(shape) > 1 else -1]:  # Orthogonal: 2 dimensions or more
        out.append(np.asarray(type(init).from_config({**init.get_config(), "seed": 7})(shape)))
    generator = keras.random.SeedGenerator(11)
    out.append(np.asarray(keras.random.normal(shape, mean=1.5, stddev=3.0, seed=generator)))
    out.append(np.asarray(keras.random.truncated_normal(shape, seed=generator)))  # the generator moved once
    out.append(np.asarray(keras.random.uniform(shape, minval=-2, maxval=5, seed=generator)))
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_draws_by_size_class_are_kerass_own_bit_for_bit(shape, request):
    assert keras_jax_random.normal is not _jax_initializers.ORIGINAL["normal"]  # installed (conftest)
    ours = _draws(shape)
    request.getfixturevalue("keras_own")
    theirs = _draws(shape)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_a_traced_draw_and_a_float16_draw_take_kerass_own_path(monkeypatch):
    calls = []
    for name, fn in list(_jax_initializers.ORIGINAL.items()):
        monkeypatch.setitem(_jax_initializers.ORIGINAL, name, lambda *a, _fn=fn, **k: calls.append(1) or _fn(*a, **k))
    jax.jit(lambda key: keras.random.normal((3,), seed=key))(jax.random.PRNGKey(0))
    keras.random.uniform((4,), dtype="float16", seed=3)
    assert len(calls) == 2
    keras.random.uniform((4,), seed=3)
    assert len(calls) == 2

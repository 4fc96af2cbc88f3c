"""The JAX suite's random draws outside a trace, compiled once per size class (issue 38: the suite's CPU).

On JAX, Keras draws each random weight eagerly: ``jax.random.truncated_normal`` (``normal``, ``uniform``) compiled
for that weight's shape, then its scale and shift (``sample * stddev + mean``), two more programs per shape. A
model's build compiled dozens of programs (0.1 to 0.6 s of CPU each), a fifth of the JAX suite's CPU.

JAX's threefry is partitionable (``jax_threefry_partitionable``): element i of a draw is a function of the key and
i alone, so a shape's draw is the first n values of a longer flat draw with the same key, reshaped. Here a draw
outside a trace is made at the next power of two and sliced, and its scale and shift are done in numpy float32
(each one IEEE-rounded operation, as XLA's): the same values, bit for bit
(tests/backends/jax/test_jax_initializers.py), from one program per size class. Anything else (a draw inside a
trace, a dtype other than float32, a tensor mean or stddev, another PRNG) takes Keras's own path. The library's
draws (noise, inside its jitted step) are traced: untouched.
"""

import math

import jax
import numpy as np
from keras.src.backend.jax import random as keras_jax_random

ORIGINAL = {name: getattr(keras_jax_random, name) for name in ("normal", "truncated_normal", "uniform")}


def _scalar(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _static_shape(shape):
    try:
        return tuple(int(d) for d in shape)
    except TypeError:  # a None (symbolic) dimension
        return None


def _bucketed(name, draw, scaled):
    """Keras's backend function `name`, drawing with `draw(key, flat_shape, dtype, **kw)` at a power-of-two size."""

    def fn(shape, *args, dtype=None, seed=None, **kwargs):
        import keras

        dtype = dtype or keras.config.floatx()
        key = keras_jax_random.jax_draw_seed(seed)  # drawn once: the generator moves as on Keras's own path
        params = dict(zip(("mean", "stddev") if scaled else ("minval", "maxval"), args), **kwargs)
        size_known = _static_shape(shape)
        if (
            isinstance(key, jax.core.Tracer)
            or size_known is None
            or math.prod(size_known) == 0
            or str(dtype) != "float32"
            or not all(_scalar(v) for v in params.values())
        ):
            return ORIGINAL[name](shape, *args, dtype=dtype, seed=key, **kwargs)
        n = math.prod(size_known)
        flat = np.asarray(draw(key, (1 << (n - 1).bit_length(),), dtype, **({} if scaled else params)))
        sample = flat[:n].reshape(size_known)
        if scaled:  # Keras: sample * stddev + mean, each a float32 operation
            sample = sample * np.float32(params.get("stddev", 1.0)) + np.float32(params.get("mean", 0.0))
        return jax.numpy.asarray(sample)

    return fn


def install() -> bool:
    """Routes Keras's JAX ``normal``, ``truncated_normal`` and ``uniform`` through the size classes; returns whether
    it did (only with JAX's partitionable threefry, the default PRNG)."""
    if not jax.config.jax_threefry_partitionable or jax.config.jax_default_prng_impl != "threefry2x32":
        return False
    keras_jax_random.normal = _bucketed("normal", lambda k, s, d: jax.random.normal(k, s, d), scaled=True)
    keras_jax_random.truncated_normal = _bucketed(
        "truncated_normal", lambda k, s, d: jax.random.truncated_normal(k, -2.0, 2.0, s, d), scaled=True
    )
    keras_jax_random.uniform = _bucketed(
        "uniform", lambda k, s, d, minval=0.0, maxval=1.0: jax.random.uniform(k, s, d, minval, maxval), scaled=False
    )
    return True

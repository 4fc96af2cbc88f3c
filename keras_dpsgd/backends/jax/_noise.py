"""The JAX backend's noise source: the DP core's Gaussian sampler (:mod:`keras_dpsgd.dp.noise`) over its table.

The sampler (Box–Muller with the radius refined where a word is 0, tails to 11.6: why the libraries' own
normals do not serve the Gaussian mechanism is in :mod:`keras_dpsgd.dp.noise`) and its random words
(XLA's threefry, polynomials for the angle: :mod:`keras_dpsgd.backends.jax.ops`) are written once; this module
is the backend's interface to them (``keras_dpsgd.backends.INTERFACE``) and its keys.

Keys (:func:`seeded_key`, :func:`entropy_key`): a seeded optimizer's noise is a function of (seed, the
release's position in the model's ledger, tensor index), so reproducible, resumable and never repeated within
a model's ledger; without a seed the key is drawn from OS entropy (``os.urandom``) and never saved
(``keras_dpsgd.backends.jax.state``).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from keras_dpsgd.backends.jax.ops import JAX_OPS, key_data
from keras_dpsgd.dp import release
from keras_dpsgd.dp.noise import noise_key, scaled_normal

__all__ = ["add_gaussian", "standard_normal", "seeded_key", "entropy_key", "key_data"]


def standard_normal(shape, key: jax.Array, dtype=jnp.float32) -> jax.Array:
    """N(0, 1) samples of static `shape`, a function of `key` (computed in float32)."""
    shape = tuple(int(s) for s in shape)
    return scaled_normal(JAX_OPS, math.prod(shape), key, 1.0).reshape(shape).astype(dtype)


def add_gaussian(x: jax.Array, stddev, key: jax.Array) -> jax.Array:
    """``x + N(0, stddev² I)`` with the scale folded into the radius (``keras_dpsgd.dp.release.add_gaussian``)."""
    return release.add_gaussian(JAX_OPS, x, stddev, key)


def seeded_key(seed: int, noised_steps, index: int) -> jax.Array:
    """The key of tensor `index` of the release at ledger position `noised_steps` under `seed` (int64)."""
    return noise_key(JAX_OPS, seed, noised_steps, index)


def entropy_key() -> np.ndarray:
    """Two uint32 words of OS entropy: a fresh noise key for a process that has no seed."""
    return np.frombuffer(os.urandom(8), np.uint32).copy()

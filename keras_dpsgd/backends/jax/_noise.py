"""The library's Gaussian sampler on JAX (the JAX backend's noise source).

The same Box–Muller as the TensorFlow sampler (:mod:`keras_dpsgd.step._noise`, whose docstring explains
why TensorFlow's and JAX's own normals, clamped or truncated, do not serve the Gaussian mechanism):
``u1 = (x0 + ½)·2⁻³²`` from a full 32-bit word, refined by two more words where ``x0 = 0``, so the
radius reaches ``sqrt(2·97·ln 2) ≈ 11.6``. The math (``refined_unit``, ``radius``,
``cos_by_quarter_turns``) is that module's. Two choices are JAX's, both for speed on CPU, where the
noise of a step is a large part of a small model's step (795k coordinates: ~8 ms of a train step before,
~4 ms now):

- the words come from XLA's own threefry generator (``jax.lax.rng_bit_generator`` with
  ``RNG_THREE_FRY``: Threefry-2x32, 20 rounds, the algorithm of ``jax.random``), its 128-bit state drawn
  from the key by ``jax.random.bits``; it is about twice as fast as ``jax.random.bits`` on CPU. Its
  stream is a function of the key, the shape and the XLA version (XLA does not promise the same bits
  across versions or platforms);
- the angle's cosine and sine are polynomials (``cos_by_quarter_turns``), since XLA's ``cos`` and
  ``sin`` on CPU cost ~6 ns an element, computed as one [2, P] grid, not a concatenation of two
  halves (XLA's fused concatenation evaluates both halves for every element).

Keys (:func:`seeded_key`, :func:`entropy_key`): a seeded optimizer's noise is a function of
(seed, the release's position in the model's ledger, tensor index), so reproducible, resumable and never
repeated within a model's ledger; without a seed the key is drawn
from OS entropy (``os.urandom``) and never saved (``keras_dpsgd.backends.jax.state``).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from keras_dpsgd.step._noise import _coarse, cos_by_quarter_turns, radius, refined_unit

__all__ = ["add_gaussian", "standard_normal", "box_muller", "seeded_key", "entropy_key", "key_data"]


def _words(key: jax.Array, shape) -> jax.Array:
    """Uniform uint32 words (all 2³² values) of `shape`, a function of `key` (XLA's threefry)."""
    state = jax.random.bits(key, (4,), jnp.uint32)
    _, words = jax.lax.rng_bit_generator(state, shape, jnp.uint32, algorithm=jax.lax.RandomAlgorithm.RNG_THREE_FRY)
    return words


def _pairs(u1, w1, scale) -> jax.Array:
    """[2, P]: row 0 ``scale·r cos θ``, row 1 ``scale·r sin θ`` (``polar``'s pair, as one elementwise grid)."""
    shift = jnp.arange(2, dtype=jnp.float32)[:, None]
    return radius(u1, scale, jnp)[None, :] * cos_by_quarter_turns(w1[None, :], shift, jnp, jnp.where)


def box_muller(x0, x1, x2=None, x3=None) -> jax.Array:
    """Two standard normals per pair of uint32 words: [2, P] (``keras_dpsgd.step._noise.box_muller``'s math)."""
    w0 = jnp.asarray(x0).astype(jnp.float32)
    if x2 is None:
        u1 = _coarse(w0)
    else:
        u1 = refined_unit(w0, jnp.asarray(x2).astype(jnp.float32), jnp.asarray(x3).astype(jnp.float32), jnp.where)
    return _pairs(u1, jnp.asarray(x1).astype(jnp.float32), jnp.float32(1.0))


def _scaled_normal(n: int, key: jax.Array, scale) -> jax.Array:
    """``scale`` · N(0, I_n), float32 [n]: refinement words drawn only where some ``x0`` is 0."""
    pairs = (n + 1) // 2
    words = _words(jax.random.fold_in(key, 0), (2, pairs))
    w0 = words[0].astype(jnp.float32)  # Exact 0.0 iff x0 == 0.

    def refined(w0):
        extra = _words(jax.random.fold_in(key, 1), (2, pairs)).astype(jnp.float32)
        return refined_unit(w0, extra[0], extra[1], jnp.where)

    u1 = jax.lax.cond(jnp.any(words[0] == 0), refined, _coarse, w0)
    scale = jnp.asarray(scale, jnp.float32)
    z = _pairs(u1, words[1].astype(jnp.float32), scale).reshape(-1)
    return z if z.size == n else z[:n]


def standard_normal(shape, key: jax.Array, dtype=jnp.float32) -> jax.Array:
    """N(0, 1) samples of static `shape`, a function of `key` (computed in float32)."""
    shape = tuple(int(s) for s in shape)
    n = int(np.prod(shape, dtype=np.int64))
    return _scaled_normal(n, key, 1.0).reshape(shape).astype(dtype)


def add_gaussian(x: jax.Array, stddev, key: jax.Array) -> jax.Array:
    """``x + N(0, stddev² I)`` with the scale folded into the radius."""
    if x.size == 0:
        return x
    z = _scaled_normal(int(x.size), key, stddev)
    return x + z.reshape(x.shape).astype(x.dtype)


def key_data(words) -> jax.Array:
    """A threefry key from its two uint32 words."""
    return jax.random.wrap_key_data(jnp.asarray(words, jnp.uint32), impl="threefry2x32")


def seeded_key(seed: int, noised_steps, index: int) -> jax.Array:
    """The key of tensor `index` of the release at ledger position `noised_steps` under `seed` (int64)."""
    seed = int(seed) % 2**64
    key = key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32))
    key = jax.random.fold_in(key, jnp.asarray(noised_steps).astype(jnp.uint32))
    return jax.random.fold_in(key, index)


def entropy_key() -> np.ndarray:
    """Two uint32 words of OS entropy: a fresh noise key for a process that has no seed."""
    return np.frombuffer(os.urandom(8), np.uint32).copy()

"""The JAX backend's table of array operations (:class:`keras_dpsgd.dp.ops.ArrayOps`) for the DP core.

Random words, both choices for speed on CPU (a small model's step spends a large part in its noise):

- XLA's own threefry generator (``jax.lax.rng_bit_generator`` with ``RNG_THREE_FRY``: Threefry-2x32, 20
  rounds, the algorithm of ``jax.random``), its 128-bit state drawn from ``fold_in(key, stream)`` by
  ``jax.random.bits``; about twice as fast as ``jax.random.bits`` on CPU. Its stream is a function of the
  key, the shape and the XLA version (XLA does not promise the same bits across versions or platforms);
- the angle's cosine and sine are polynomials (``keras_dpsgd.dp.noise.circle_by_quarter_turns``), since
  XLA's ``cos`` and ``sin`` on CPU cost ~6 ns an element.

A seeded key is the threefry key of the seed's two 32-bit halves, folded with the release's position in the
model's ledger.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from keras_dpsgd.dp.noise import circle_by_quarter_turns
from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["JAX_OPS", "key_data", "make_local_state"]


def key_data(words) -> jax.Array:
    """A threefry key from its two uint32 words."""
    return jax.random.wrap_key_data(jnp.asarray(words, jnp.uint32), impl="threefry2x32")


def _random_words(key, shape, stream: int):
    """uint32 words of static `shape` (every value of 2³²), a function of (key, stream)."""
    state = jax.random.bits(jax.random.fold_in(key, stream), (4,), jnp.uint32)
    algorithm = jax.lax.RandomAlgorithm.RNG_THREE_FRY
    _, words = jax.lax.rng_bit_generator(state, tuple(shape), jnp.uint32, algorithm=algorithm)
    return words


def _seed_key(seed: int, position):
    seed = int(seed) % 2**64
    key = key_data(np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32))
    return jax.random.fold_in(key, jnp.asarray(position).astype(jnp.uint32))


def _group_sum(x, groups, num_groups):
    """[B, G] as a product with the 0/1 membership matrix [V, G]."""
    member = np.zeros((len(groups), num_groups), np.float32)
    member[np.arange(len(groups)), list(groups)] = 1.0
    return x @ jnp.asarray(member, x.dtype)


def _cond(pred, true_fn, false_fn):
    return jax.lax.cond(pred, lambda _: true_fn(), lambda _: false_fn(), None)


JAX_OPS = ArrayOps(
    name="jax",
    minimum=jnp.minimum,
    maximum=jnp.maximum,
    exp=jnp.exp,
    where=jnp.where,
    zeros_like=jnp.zeros_like,
    ones_like=jnp.ones_like,
    log=jnp.log,
    sqrt=jnp.sqrt,
    is_finite=jnp.isfinite,
    cast=lambda x, dtype: jnp.asarray(x).astype(dtype),
    reshape=jnp.reshape,
    reduce_all=lambda x, axis=None, keepdims=False: jnp.all(x, axis=axis, keepdims=keepdims),
    group_sum=_group_sum,
    gather_columns=lambda x, index: x[:, jnp.asarray(list(index))],
    cond=_cond,
    random_words=_random_words,
    fold_in=jax.random.fold_in,
    seed_key=_seed_key,
    unit_circle=circle_by_quarter_turns(jnp.round, jnp.floor, jnp.where),
    rows=list,
    concat=jnp.concatenate,
    split=lambda x, sizes, axis: jnp.split(x, np.cumsum(sizes)[:-1].tolist(), axis),
)


def make_local_state(state) -> None:
    """Nothing yet: on JAX the optimizer's local state (the lot size's mirror, the non-finite count, the ledger
    offset, the noise key) is optimizer variables, made when the optimizer is built
    (``keras_dpsgd.backends.jax.state.add_variables``): a stateless step threads them through."""

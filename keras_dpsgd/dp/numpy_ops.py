"""The table of array operations (:class:`keras_dpsgd.dp.ops.ArrayOps`) over NumPy arrays, with keyed random words.

One table serves every NumPy use of the core: the reference table the core's tests run over, and the torch
backend's noise (``keras_dpsgd.backends.torch``: the Gaussian sampler runs in NumPy, single-threaded, and the noise
is then added to the tensor). A user of the table that needs keys of its own takes :func:`keyed_words` under its
own tag with ``dataclasses.replace``, so that two users' keys never meet.

Random words: NumPy's Philox-4x64 under a 128-bit key, its raw 64-bit outputs read as word pairs. A key is a
Python int, a BLAKE2b digest of its parts (``seed_key``: the seed and the release's position in the model's
ledger; ``fold_in``: a key and an index; ``random_words``: a key and a stream), so two keys agree only if all
their parts (and the tag) do.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import numpy as np

from keras_dpsgd.dp.noise import circle_by_trig
from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["NUMPY_OPS", "digest", "keyed_words", "philox_words"]


def digest(tag: bytes, *parts: int | bytes) -> int:
    """A 128-bit key: BLAKE2b of `tag` and the parts (ints as signed 32-byte words, bytes as they are)."""
    h = hashlib.blake2b(tag, digest_size=16)
    for part in parts:
        h.update(part if isinstance(part, bytes) else int(part).to_bytes(32, "little", signed=True))
    return int.from_bytes(h.digest(), "little")


def philox_words(key: int, n: int) -> np.ndarray:
    """n uniform uint32 words (all 2³² values), a function of `key`: the raw 64-bit outputs of NumPy's Philox under
    the 128-bit key, each read as two words (in the machine's byte order)."""
    return np.random.Philox(key=key).random_raw((n + 1) // 2).view(np.uint32)[:n]


def keyed_words(tag: bytes) -> dict[str, Callable]:
    """The table's ``random_words``, ``fold_in`` and ``seed_key`` with keys digested under `tag`."""

    def random_words(key, shape, stream: int) -> np.ndarray:
        shape = tuple(int(s) for s in shape)
        return philox_words(digest(tag, b"stream", int(key), int(stream)), math.prod(shape)).reshape(shape)

    return {
        "random_words": random_words,
        "fold_in": lambda key, index: digest(tag, b"fold", int(key), int(index)),
        "seed_key": lambda seed, position: digest(tag, b"seeded", int(seed), int(position)),
    }


def _group_sum(x, groups, num_groups):
    """[B, G] as a product with the 0/1 membership matrix [V, G]."""
    member = np.zeros((len(groups), num_groups), x.dtype)
    member[np.arange(len(groups)), list(groups)] = 1
    return x @ member


NUMPY_OPS = ArrayOps(
    name="numpy",
    minimum=np.minimum,
    maximum=np.maximum,
    exp=np.exp,
    where=np.where,
    zeros_like=np.zeros_like,
    ones_like=np.ones_like,
    log=np.log,
    sqrt=np.sqrt,
    is_finite=np.isfinite,
    cast=lambda x, dtype: np.asarray(x).astype(dtype, copy=False),
    reshape=np.reshape,
    reduce_all=lambda x, axis=None, keepdims=False: np.all(x, axis=axis, keepdims=keepdims),
    group_sum=_group_sum,
    gather_columns=lambda x, index: x[:, list(index)],
    cond=lambda pred, true_fn, false_fn: true_fn() if bool(pred) else false_fn(),
    unit_circle=circle_by_trig(np.cos, np.sin, np.stack),
    rows=list,
    concat=np.concatenate,
    split=lambda x, sizes, axis: np.split(x, np.cumsum(sizes)[:-1], axis),
    **keyed_words(b"keras_dpsgd/numpy"),
)

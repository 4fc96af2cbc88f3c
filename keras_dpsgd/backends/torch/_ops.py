"""The torch backend's tables of array operations (``keras_dpsgd.dp.ops.ArrayOps``), which the DP core runs over.

:data:`TORCH_OPS` serves the core's math on torch tensors (clip factors, the lot, the release). Eager: ``cond``
runs the branch its (concrete) predicate picks. :data:`NOISE_OPS` is the core's NumPy table
(``keras_dpsgd.dp.numpy_ops``) with this backend's random words, on which the core's Gaussian sampler
(``keras_dpsgd.dp.noise``) runs for this backend (``_noise``): numpy is single-threaded, where torch's many
elementwise kernels wait on its thread pool on a CPU shared with other work.

Random words (both tables): numpy's Philox-4x64 under a 128-bit key, its raw 64-bit outputs read as word pairs. A
key is a Python int, a BLAKE2b digest of its parts (``seed_key``: the seed and the release's position in the
model's ledger; ``fold_in``: a key and an index; ``random_words``: a key and a stream), so two keys agree only if
all their parts do.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from keras_dpsgd.dp import numpy_ops
from keras_dpsgd.dp.noise import circle_by_trig
from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["TORCH_OPS", "NOISE_OPS", "WordReader", "digest", "stream_key", "words"]


def digest(*parts: int | bytes) -> int:
    """A 128-bit key: BLAKE2b of the parts under the torch noise's tag (``keras_dpsgd.dp.numpy_ops.digest``)."""
    return numpy_ops.digest(b"keras_dpsgd/torch-noise", *parts)


_NO_WORDS = np.zeros(0, np.uint32)


class WordReader:
    """The words of :func:`words` under `key`, read in consecutive pieces from word `start` (one Philox state, no
    array of all the words: a backend draws them by chunks)."""

    def __init__(self, key: int, start: int = 0):
        self._philox = np.random.Philox(key=key)
        raw = start // 2  # each raw 64-bit output is two words
        self._philox.advance(raw // 4)  # Philox-4x64: four raw outputs per step of its counter
        self._philox.random_raw(raw % 4)
        self._carry = self._philox.random_raw(1).view(np.uint32)[1:] if start % 2 else _NO_WORDS

    def read(self, n: int) -> np.ndarray:
        """The next `n` words."""
        take = min(n, self._carry.size)
        head, self._carry = self._carry[:take], self._carry[take:]
        need = n - take
        if need == 0:
            return head
        fresh = self._philox.random_raw((need + 1) // 2).view(np.uint32)
        self._carry = fresh[need:]
        return fresh[:need] if take == 0 else np.concatenate([head, fresh[:need]])


def words(key: int, n: int) -> np.ndarray:
    """n uniform uint32 words (all 2³² values), a function of `key`: the raw 64-bit outputs of numpy's Philox under
    the 128-bit key, each read as two words (in the machine's byte order)."""
    return WordReader(key).read(n)


def stream_key(key: int, stream: int) -> int:
    """The key of the words of `key`'s `stream` (``random_words``)."""
    return digest(b"stream", int(key), int(stream))


def _numpy_words(key, shape, stream: int):
    shape = tuple(int(s) for s in shape)
    return words(stream_key(key, stream), math.prod(shape)).reshape(shape)


def _fold_in(key, index):
    return digest(b"fold", int(key), int(index))


def _seed_key(seed, position):
    return digest(b"seeded", int(seed), int(position))


NOISE_OPS = dataclasses.replace(
    numpy_ops.NUMPY_OPS,
    name="numpy (torch's noise)",
    random_words=_numpy_words,
    fold_in=_fold_in,
    seed_key=_seed_key,
)


def _where(condition, x, y):
    """``torch.where`` that takes Python numbers for either branch (as ``numpy.where`` does)."""
    like = next((t for t in (x, y, condition) if isinstance(t, torch.Tensor)), None)
    dtype = next((t.dtype for t in (x, y) if isinstance(t, torch.Tensor)), torch.float32)
    device = None if like is None else like.device
    x, y = (t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=dtype, device=device) for t in (x, y))
    return torch.where(torch.as_tensor(condition, device=device), x, y)


def _numbers_too(fn):
    """A binary torch function that takes a Python number for either argument (as NumPy's does)."""

    def call(x, y):
        like = x if isinstance(x, torch.Tensor) else y if isinstance(y, torch.Tensor) else None
        if like is None:
            return fn(torch.as_tensor(x), torch.as_tensor(y))
        x, y = (
            t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=like.dtype, device=like.device) for t in (x, y)
        )
        return fn(x, y)

    return call


def _cast(x, dtype):
    return torch.as_tensor(x).to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)


def _reduce_all(x, axis=None, keepdims=False):
    return torch.all(x) if axis is None else torch.all(x, dim=axis, keepdim=keepdims)


def _group_sum(x, groups, num_groups):
    """[B, G] as a product with the 0/1 membership matrix [V, G]."""
    member = torch.zeros(len(groups), num_groups, dtype=x.dtype, device=x.device)
    member[torch.arange(len(groups)), torch.as_tensor(list(groups))] = 1.0
    return x @ member


TORCH_OPS = ArrayOps(
    name="torch",
    minimum=_numbers_too(torch.minimum),
    maximum=_numbers_too(torch.maximum),
    exp=torch.exp,
    where=_where,
    zeros_like=torch.zeros_like,
    ones_like=torch.ones_like,
    log=torch.log,
    sqrt=torch.sqrt,
    is_finite=torch.isfinite,
    cast=_cast,
    reshape=torch.reshape,
    reduce_all=_reduce_all,
    group_sum=_group_sum,
    gather_columns=lambda x, index: x[:, torch.as_tensor(list(index))],
    cond=lambda pred, true_fn, false_fn: true_fn() if bool(pred) else false_fn(),
    random_words=lambda key, shape, stream: torch.from_numpy(_numpy_words(key, shape, stream).astype(np.int64)),
    fold_in=_fold_in,
    seed_key=_seed_key,
    unit_circle=circle_by_trig(torch.cos, torch.sin, torch.stack),
    rows=lambda x: list(x.unbind(0)),
    concat=torch.cat,
    split=lambda x, sizes, axis: list(torch.split(x, list(sizes), axis)),
)

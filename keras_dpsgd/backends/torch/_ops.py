"""The torch backend's table of array operations (``keras_dpsgd.dp.ops.ArrayOps``), which the DP core runs over.

Eager: ``cond`` runs the branch its (concrete) predicate picks. Random words are numpy's Philox-4x64 under a
128-bit key (``_noise``): ``seed_key``/``fold_in`` hash their parts (BLAKE2b), so two keys agree only if all
their parts do. The table is built from the fields ``ArrayOps`` declares (the core's table grows with it).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from keras_dpsgd.backends.torch._noise import _digest, words
from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["TORCH_OPS"]


def _where(condition, x, y):
    """``torch.where`` that takes Python numbers for either branch (as ``numpy.where`` does)."""
    like = next((t for t in (x, y, condition) if isinstance(t, torch.Tensor)), None)
    dtype = next((t.dtype for t in (x, y) if isinstance(t, torch.Tensor)), torch.float32)
    device = None if like is None else like.device
    x, y = (t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=dtype, device=device) for t in (x, y))
    return torch.where(torch.as_tensor(condition, device=device), x, y)


def _dtype(dtype):
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _reduce_all(x, axis=None, keepdims=False):
    return torch.all(x) if axis is None else torch.all(x, dim=axis, keepdim=keepdims)


def _group_sum(x, groups, num_groups):
    """[B, G] as a product with the 0/1 membership matrix [V, G]."""
    member = torch.zeros(len(groups), num_groups, dtype=x.dtype, device=x.device)
    member[torch.arange(len(groups)), torch.as_tensor(list(groups))] = 1.0
    return x @ member


def _random_words(key, shape, stream: int):
    """Words of `shape` (every value of 2³², as int64), a function of (key, stream)."""
    shape = tuple(int(s) for s in shape)
    return torch.from_numpy(words(_digest(b"stream", int(key), stream), int(np.prod(shape))).astype(np.int64)).reshape(
        shape
    )


def _unit_circle(w1):
    angle = w1 * (2.0 * np.pi * 2.0**-32)
    return torch.stack([torch.cos(angle), torch.sin(angle)])


_ALL = dict(
    name="torch",
    minimum=torch.minimum,
    maximum=torch.maximum,
    exp=torch.exp,
    where=_where,
    zeros_like=torch.zeros_like,
    ones_like=torch.ones_like,
    log=torch.log,
    sqrt=torch.sqrt,
    is_finite=torch.isfinite,
    cast=lambda x, dtype: torch.as_tensor(x).to(_dtype(dtype)),
    reshape=torch.reshape,
    reduce_all=_reduce_all,
    group_sum=_group_sum,
    gather_columns=lambda x, index: x[:, torch.as_tensor(list(index))],
    cond=lambda pred, true_fn, false_fn: true_fn() if bool(pred) else false_fn(),
    random_words=_random_words,
    fold_in=lambda key, index: _digest(b"fold", int(key), int(index)),
    seed_key=lambda seed, position: _digest(b"seeded", int(seed), int(position)),
    unit_circle=_unit_circle,
)

TORCH_OPS = ArrayOps(**{field.name: _ALL[field.name] for field in dataclasses.fields(ArrayOps)})

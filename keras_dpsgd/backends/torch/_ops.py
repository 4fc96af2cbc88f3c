"""The torch backend's table of array operations (``keras_dpsgd.dp.ops.ArrayOps``), which the DP core runs over."""

from __future__ import annotations

import torch

from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["TORCH_OPS"]


def _where(condition, x, y):
    """``torch.where`` that takes Python numbers for either branch (as ``numpy.where`` does)."""
    like = next((t for t in (x, y, condition) if isinstance(t, torch.Tensor)), None)
    dtype = next((t.dtype for t in (x, y) if isinstance(t, torch.Tensor)), torch.float32)
    device = None if like is None else like.device
    x, y = (t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=dtype, device=device) for t in (x, y))
    return torch.where(torch.as_tensor(condition, device=device), x, y)


TORCH_OPS = ArrayOps(
    name="torch",
    minimum=torch.minimum,
    maximum=torch.maximum,
    exp=torch.exp,
    where=_where,
    zeros_like=torch.zeros_like,
    ones_like=torch.ones_like,
)

"""The release of a lot's clipped sum: Gaussian noise scaled by its sensitivity, then the normalization.

Abadi et al. 2016, Algorithm 1, "add noise" and the division by the lot size:

* :func:`add_noise`: ``Σ_i c_i g_i[v] + N(0, σ_v² S_v²)`` on each variable v, where ``S_v`` is the
  sensitivity the clipped sum carries (:class:`keras_dpsgd.dp.clip.ClippedSum`: the bound C of v's group).
  Under R replicas each adds its share ``N(0, σ_v² S_v² / R)`` under a key of its own (``scale = 1/√R``);
  the cross-replica sum holds ``N(0, σ_v² S_v²)`` once.
* :func:`lot_denominator`, :func:`normalize`: divide by the expected lot size L (Poisson lots: the
  unbiased estimate of the mean, whose sensitivity is C/L), else by the realized number of examples.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Sequence

from keras_dpsgd.dp.clip import ClippedSum
from keras_dpsgd.dp.noise import scaled_normal
from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["add_gaussian", "add_noise", "lot_denominator", "normalize"]


def add_gaussian(ops: ArrayOps, x: Any, stddev: Any, key: Any) -> Any:
    """``x + N(0, stddev² I)`` of static shape, the noise of :func:`keras_dpsgd.dp.noise.scaled_normal`."""
    n = math.prod(int(d) for d in x.shape)
    if n == 0:
        return x
    return x + ops.cast(ops.reshape(scaled_normal(ops, n, key, stddev), tuple(x.shape)), x.dtype)


def add_noise(
    clipped: ClippedSum,
    sigmas: Sequence[float],
    gaussian: Callable[[Any, Any, int], Any],
    scale: Any = 1.0,
) -> list:
    """Each variable's clipped sum plus ``N(0, (σ_v · S_v · scale)²)``, ``S_v = clipped.sensitivity[v]``.

    Args:
      clipped: the lot's clipped sum and its sensitivity.
      sigmas: σ_v of each variable (a variable with σ_v = 0 is left as it is: no noise is drawn).
      gaussian: ``gaussian(x, stddev, index)`` -> ``x + N(0, stddev²)`` under the key of tensor `index`
        (the backend's sampler: :func:`add_gaussian` under the front end's keys).
      scale: 1, or ``1/√R`` for one replica's share of R.
    """
    return [
        s if sigmas[v] == 0 else gaussian(s, sigmas[v] * clipped.sensitivity[v] * scale, v)
        for v, s in enumerate(clipped.sums)
    ]


def lot_denominator(ops: ArrayOps, num_examples: Any, expected_lot_size: Any) -> Any:
    """float32: the expected lot size L if L > 0, else the realized `num_examples`."""
    lot = ops.cast(expected_lot_size, "float32")
    return ops.where(lot > 0.0, lot, ops.cast(num_examples, "float32"))


def normalize(
    ops: ArrayOps, noised: Sequence[Any], denominator: Any, divide: Callable[[Any, Any], Any] = operator.truediv
) -> list:
    """Each noised sum divided by the lot's `denominator` (:func:`lot_denominator`), in its own dtype.

    `divide(g, d)` divides (an eager backend may divide in place a tensor it owns: the same values).
    """
    return [divide(g, ops.cast(denominator, g.dtype)) for g in noised]

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
from keras_dpsgd.dp.noise import scaled_normals
from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["add_gaussian", "add_gaussians", "add_noise", "each", "lot_denominator", "normalize"]


def add_gaussian(ops: ArrayOps, x: Any, stddev: Any, key: Any) -> Any:
    """``x + N(0, stddev² I)`` of static shape, the noise of :func:`keras_dpsgd.dp.noise.scaled_normal`."""
    return add_gaussians(ops, [x], [stddev], key)[0]


def add_gaussians(ops: ArrayOps, xs: Sequence[Any], stddevs: Sequence[Any], key: Any) -> list:
    """``x + N(0, stddev² I)`` of each (x, stddev), independent, from one draw under `key`
    (:func:`keras_dpsgd.dp.noise.scaled_normals`: the tensors' pairs of words in order; one sampler in a traced
    step). One tensor alone gets :func:`add_gaussian`'s noise."""
    sizes = [math.prod(int(d) for d in x.shape) for x in xs]
    drawn = [i for i, n in enumerate(sizes) if n]
    noise = scaled_normals(
        ops,
        [sizes[i] for i in drawn],
        key,
        [stddevs[i] for i in drawn],
        [tuple(xs[i].shape) for i in drawn],
    )
    out = list(xs)
    for i, z in zip(drawn, noise):
        out[i] = xs[i] + ops.cast(z, xs[i].dtype)
    return out


def add_noise(
    clipped: ClippedSum,
    sigmas: Sequence[float],
    gaussians: Callable[[list, list, list], list],
    scale: Any = 1.0,
) -> list:
    """Each variable's clipped sum plus ``N(0, (σ_v · S_v · scale)²)``, ``S_v = clipped.sensitivity[v]``.

    Args:
      clipped: the lot's clipped sum and its sensitivity.
      sigmas: σ_v of each variable (a variable with σ_v = 0 is left as it is: no noise is drawn).
      gaussians: ``gaussians(xs, stddevs, indices)`` -> ``[x + N(0, stddev²)]``, independent, called once per
        release with the variables that get noise and their indices, in order (the backend's sampler:
        :func:`add_gaussians` under the key of the release's first index; :func:`each` makes it from a one-tensor
        sampler, each tensor under its index's key).
      scale: 1, or ``1/√R`` for one replica's share of R.
    """
    indices = [v for v in range(len(clipped.sums)) if sigmas[v] != 0]
    stddevs, made = [], {}  # one array per distinct (σ_v, S_v): the sampler then folds one scalar into its radius
    for v in indices:
        pair = (sigmas[v], id(clipped.sensitivity[v]))
        if pair not in made:
            made[pair] = sigmas[v] * clipped.sensitivity[v] * scale
        stddevs.append(made[pair])
    out = list(clipped.sums)
    if indices:  # σ = 0 everywhere: nothing drawn
        for v, noised in zip(indices, gaussians([out[v] for v in indices], stddevs, indices)):
            out[v] = noised
    return out


def each(gaussian: Callable[[Any, Any, int], Any]) -> Callable[[list, list, list], list]:
    """The ``gaussians`` of :func:`add_noise` from a one-tensor ``gaussian(x, stddev, index)``, called in order."""
    return lambda xs, stddevs, indices: [gaussian(x, s, i) for x, s, i in zip(xs, stddevs, indices)]


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

"""Adaptive clipping in the JAX and torch train steps: the core's bound rules on the optimizer's values.

The settings, the rules and the release of the bound queries are the core's (:mod:`keras_dpsgd.dp.adaptive`,
one implementation, over the backend's :class:`keras_dpsgd.dp.ops.ArrayOps`); ``release_noise_multipliers`` and
the ledger's σ_eff are the optimizer's (``keras_dpsgd.step.adaptive.AdaptiveClippingCore``), so the ledger charges
the norm queries exactly as on TensorFlow. What TensorFlow does in the optimizer's hooks
(``on_per_example_sq_norms``, ``add_noise``, ``on_noised_step``) the JAX and torch train steps do here, through
`state`, the optimizer's variables read and written by variable (JAX: the values of the traced step,
``_jax_front.OptimizerState``; torch, eager: the variables themselves, :class:`Variables`):

* every batch: each group's query terms summed into ``adaptive_norm_sums`` (:func:`accumulate_queries`);
* at the lot's release, after the gradient's noise with the bounds in force: with
  ``divide_by_bound`` each group's noised sum divided by its bound (:func:`divide_by_bound`);
  then the queries released under a key of their own (index ``NORM_NOISE_INDEX``), the next bounds
  written to ``clip_bounds`` and the sums zeroed (:func:`release_queries`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_dpsgd.dp import adaptive as core
from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["NORM_NOISE_INDEX", "Variables", "is_adaptive", "accumulate_queries", "divide_by_bound", "release_queries"]

NORM_NOISE_INDEX = core.NORM_NOISE_INDEX  # the key index of the queries' noise (the gradient's: 0..V-1)


def is_adaptive(optimizer: Any) -> bool:
    """Whether `optimizer` clips adaptively (``AdaptiveClippingCore``)."""
    from keras_dpsgd.step.adaptive import AdaptiveClippingCore

    return isinstance(optimizer, AdaptiveClippingCore)


class Variables:
    """An eager step's `state`: a variable's value read, a new value assigned to it."""

    def __getitem__(self, variable: Any) -> Any:
        return variable.value

    def __setitem__(self, variable: Any, value: Any) -> None:
        variable.assign(value)


def accumulate_queries(optimizer: Any, ops: ArrayOps, state: Any, sq_norms, finite, bounds) -> None:
    """Adds one batch's query terms to ``adaptive_norm_sums`` (`bounds`: [G] in force; `finite`: [B, 1])."""
    terms = core.example_query_terms(optimizer._adaptive, sq_norms, bounds, finite, optimizer._clip_groups(), ops)
    state[optimizer._norm_sums] = state[optimizer._norm_sums] + terms.sum(0)


def divide_by_bound(optimizer: Any, ops: ArrayOps, noised: list, bounds) -> list:
    """With ``divide_by_bound``: each variable's noised sum divided by its group's bound in force
    (post-processing of the release); else `noised` unchanged."""
    if not optimizer.divide_by_bound:
        return noised
    groups = optimizer._clip_groups()
    return [n / ops.cast(bounds[groups[v]], n.dtype) for v, n in enumerate(noised)]


def release_queries(optimizer: Any, ops: ArrayOps, state: Any, bounds, denominator, noise) -> None:
    """Releases the lot's bound queries and writes the next bounds (after the gradient's release).

    Args:
      optimizer: the adaptive DP optimizer.
      ops: the backend's table.
      state: its variables' values, read and written by variable.
      bounds: [G] the bounds in force (those the lot was clipped to).
      denominator: the gradient's L (``expected_lot_size``, else the realized lot size).
      noise: [G] standard normal draws under the key of index :data:`NORM_NOISE_INDEX` of this release.
    """
    settings = optimizer._adaptive
    sigmas = ops.cast(np.asarray(settings.norm_sigmas, np.float32), "float32")
    sums = state[optimizer._norm_sums]
    new = core.next_bounds_from_sums(settings, sums, bounds, sigmas, noise, lambda n: n / denominator, ops)
    state[optimizer.clip_bounds] = ops.gather_columns(new[None, :], optimizer._clip_groups())[0]  # flat: C per variable
    state[optimizer._norm_sums] = ops.zeros_like(sums)

"""Adaptive clipping on Keras 3 with JAX: the stateless train step's plumbing of the core's bound rules.

The settings, the rules and the release of the bound queries are the core's (:mod:`keras_dpsgd.dp.adaptive`,
one implementation, on ``jax.numpy`` here); ``release_noise_multipliers`` and the ledger's σ_eff are the
optimizer's (``keras_dpsgd.step.adaptive.AdaptiveClippingCore``), so the ledger charges the norm queries
exactly as on TensorFlow. What TensorFlow does in the optimizer's hooks (``on_per_example_sq_norms``,
``add_noise``, ``on_noised_step``) the JAX train step (``_jax_train_step``) does here, on the optimizer's variables as
values of the traced step (``_OptimizerState``):

* every batch: each group's query terms summed into ``adaptive_norm_sums`` (:func:`accumulate_queries`);
* at the lot's release, after the gradient's noise with the bounds in force: with
  ``divide_by_bound`` each group's noised sum divided by its bound (:func:`divide_by_bound`);
  then the queries released under a key of their own (index ``NORM_NOISE_INDEX``), the next bounds
  written to ``clip_bounds`` and the sums zeroed (:func:`release_queries`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp

from keras_dpsgd.backends.jax import standard_normal
from keras_dpsgd.backends.jax.ops import JAX_OPS
from keras_dpsgd.dp import adaptive as core

__all__ = ["is_adaptive", "accumulate_queries", "divide_by_bound", "release_queries"]


def is_adaptive(optimizer: Any) -> bool:
    """Whether `optimizer` clips adaptively (``AdaptiveClippingCore``)."""
    from keras_dpsgd.step.adaptive import AdaptiveClippingCore

    return isinstance(optimizer, AdaptiveClippingCore)


def accumulate_queries(optimizer: Any, opt: Any, sq_norms, finite, bounds) -> None:
    """Adds one batch's query terms to ``adaptive_norm_sums`` (`bounds`: [G] in force; `finite`: [B, 1])."""
    terms = core.example_query_terms(optimizer._adaptive, sq_norms, bounds, finite, optimizer._clip_groups(), JAX_OPS)
    opt[optimizer._norm_sums] = opt[optimizer._norm_sums] + jnp.sum(terms, axis=0)


def divide_by_bound(optimizer: Any, noised: list, bounds) -> list:
    """With ``divide_by_bound``: each variable's noised sum divided by its group's bound in force
    (post-processing of the release); else `noised` unchanged."""
    if not optimizer.divide_by_bound:
        return noised
    groups = optimizer._clip_groups()
    return [n / bounds[groups[v]].astype(n.dtype) for v, n in enumerate(noised)]


def release_queries(optimizer: Any, opt: Any, bounds, denominator, key_for: Callable[[int], Any]) -> None:
    """Releases the lot's bound queries and writes the next bounds (after the gradient's release).

    Args:
      optimizer: the adaptive DP optimizer.
      opt: its traced values.
      bounds: [G] the bounds in force (those the lot was clipped to).
      denominator: the gradient's L (``expected_lot_size``, else the realized lot size).
      key_for: the key of the step's noise tensor of a given index (the gradient's keys are 0..V-1).
    """
    settings = optimizer._adaptive
    sigmas = jnp.asarray(settings.norm_sigmas, jnp.float32)
    noise = standard_normal(bounds.shape, key_for(core.NORM_NOISE_INDEX), jnp.float32)
    sums = opt[optimizer._norm_sums]
    new = core.next_bounds_from_sums(settings, sums, bounds, sigmas, noise, lambda n: n / denominator, JAX_OPS)
    opt[optimizer.clip_bounds] = new[jnp.asarray(optimizer._clip_groups())]  # flat: C once per variable
    opt[optimizer._norm_sums] = jnp.zeros_like(sums)

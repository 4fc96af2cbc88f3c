"""Per-example gradients, clipped and summed, on the JAX backend: ``jax.vmap`` of one example's gradient.

Each example's loss is computed on its own (``jax.vmap`` over the batch axis of ``jax.grad`` of a
function that sees a batch of one), so no layer can mix examples: a layer that reduces over the
batch sees one example. The protocol is the TensorFlow backends' (``keras_dpsgd.backends.tensorflow.per_example_backend``):

    summed[v] = Σ_i factors[i, v] · g_i[v],   sq_norms[i, v] = ||g_i[v]||²

and an example whose factor is 0 contributes exactly 0, even when its gradient holds NaN or Inf
(its gradient is replaced by 0 before the product). The factors are ``keras_dpsgd.step._math.clip_factors``
(flat or per group, 0 for non-finite rows), written here on ``jax.numpy``.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from keras_dpsgd.step import _rounding

__all__ = ["finite_rows", "clip_factors", "clipped_sum", "sq_norms", "staged_sq_norms"]


def finite_rows(sq_norms: jax.Array) -> jax.Array:
    """[B, 1] bool: the examples whose squared norms are all finite (``_step.finite_rows``)."""
    return jnp.all(jnp.isfinite(sq_norms), axis=1, keepdims=True)


def clip_factors(sq_norms, bounds, groups: Sequence[int], finite=None, stability: float | None = None) -> jax.Array:
    """Per-example factors [B, V] (``keras_dpsgd.step._math.clip_factors``: the same rule).

    ``min(1, C_g/||g_i[g]||)`` for variable v in group g (``||g_i[g]||²`` sums the group's squared
    norms), or ``C_g/(||g_i[g]|| + γ)`` with `stability` γ; 0 on every column of a non-finite row.
    """
    groups = list(groups)
    num_groups = max(groups) + 1
    if finite is None:
        finite = finite_rows(sq_norms)
    bounds = jnp.asarray(bounds, sq_norms.dtype)
    if groups == list(range(num_groups)):
        group_sq = sq_norms
    else:
        member = jnp.asarray([[1.0 if g == h else 0.0 for h in range(num_groups)] for g in groups], sq_norms.dtype)
        group_sq = sq_norms @ member  # [B, G]
    norms = jnp.sqrt(group_sq)
    if stability is not None:
        per_group = bounds / (norms + stability)
    else:
        per_group = jnp.where(norms > bounds, bounds / jnp.where(norms > bounds, norms, 1.0), 1.0)
    factors = per_group[:, jnp.asarray(groups)]
    return jnp.where(finite, factors, 0.0)


def staged_sq_norms(g: jax.Array) -> tuple[jax.Array, int]:
    """(``||g_i||²`` per row i of g [B, ...] in float32, how many terms each rounded sum adds at most).

    Summed over the last axis, then over the rest, with an optimization barrier between (XLA would merge two
    reductions into one): a rounding bound of ``γ_{last + rest}`` rather than ``γ_{last · rest}``.
    """
    g = g.astype(jnp.float32)
    shape = g.shape[1:]
    if len(shape) < 2:
        return jnp.sum(jnp.square(g).reshape(g.shape[0], -1), axis=1), max(1, math.prod(shape))
    last, rest = shape[-1], math.prod(shape[:-1])
    rows = jax.lax.optimization_barrier(jnp.sum(jnp.square(g).reshape(g.shape[0], rest, last), axis=2))
    return jnp.sum(rows, axis=1), last + rest


def sq_norms(grads: Sequence[jax.Array]) -> jax.Array:
    """float32 [B, V]: upper bounds of ``||g_i[v]||²`` of per-example gradients (each [B, *shape]) that the
    release sums themselves (a relative rounding margin, ``_rounding.positive_upper``)."""
    if not grads:
        raise ValueError("no trainable variables: nothing to clip")
    return jnp.stack([_rounding.positive_upper(*staged_sq_norms(g)) for g in grads], axis=1)


def clipped_sum(
    grads: Sequence[jax.Array], factors_fn: Callable[[jax.Array], jax.Array]
) -> tuple[list[jax.Array], jax.Array]:
    """(Σ_i factors[i, v] g_i[v] for each v, sq_norms [B, V]) from per-example gradients [B, *shape].

    A zero factor contributes exactly 0 (its example's gradient is zeroed first, NaN or Inf included).
    """
    norms = sq_norms(grads)
    factors = factors_fn(norms)
    summed = []
    for v, g in enumerate(grads):
        f = factors[:, v].reshape((-1,) + (1,) * (g.ndim - 1))
        g32 = jnp.where(f > 0, g.astype(jnp.float32), 0.0)
        summed.append(jnp.sum(g32 * f, axis=0))
    return summed, norms


def per_example_grads(loss_of_one: Callable, params, *batched, in_axes) -> tuple:
    """``jax.vmap(jax.grad(loss_of_one, has_aux=True))``: (per-example gradients, aux) over axis 0."""
    return jax.vmap(jax.grad(loss_of_one, has_aux=True), in_axes=in_axes)(params, *batched)

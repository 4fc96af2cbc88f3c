"""Per-example gradients, clipped and summed, on the JAX backend: ``jax.vmap`` of one example's gradient.

Each example's loss is computed on its own (``jax.vmap`` over the batch axis of ``jax.grad`` of a
function that sees a batch of one), so no layer can mix examples: a layer that reduces over the
batch sees one example. The protocol is the TensorFlow backends' (``keras_dpsgd.backends.tensorflow.per_example_backend``):

    summed[v] = Σ_i factors[i, v] · g_i[v],   sq_norms[i, v] = ||g_i[v]||²

and an example whose factor is 0 contributes exactly 0, even when its gradient holds NaN or Inf
(its gradient is replaced by 0 before the product). The factors are the DP core's
(``keras_dpsgd.dp.clip.clip_factors`` over ``keras_dpsgd.backends.jax.ops.JAX_OPS``: flat or per group, 0 for
non-finite rows).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from keras_dpsgd.dp import rounding as _rounding

__all__ = ["clipped_sum", "sq_norms", "staged_sq_norms", "weighted_row_sum"]


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


def weighted_row_sum(g: jax.Array, f: jax.Array) -> jax.Array:
    """``Σ_i f_i g_i`` of per-example gradients g [B, *shape] (float32) for factors f [B]: one matrix-vector product
    over the flattened rows (XLA's CPU reduction over the leading axis of ``g * f`` was the DP step's largest cost on
    keras_hub's attention kernels); a row with ``f_i <= 0`` adds exactly 0, NaN or Inf included."""
    keep = (f > 0).reshape((-1,) + (1,) * (g.ndim - 1))
    # The row length from the static shape: an empty lot (B = 0) has no -1 to infer.
    rows = jnp.where(keep, g.astype(jnp.float32), 0.0).reshape(g.shape[0], math.prod(g.shape[1:]))
    weights = jnp.where(f > 0, f.astype(jnp.float32), 0.0)
    return jnp.matmul(weights, rows, precision=jax.lax.Precision.HIGHEST).reshape(g.shape[1:])


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
        summed.append(weighted_row_sum(g, factors[:, v]))
    return summed, norms


def per_example_grads(loss_of_one: Callable, params, *batched, in_axes) -> tuple:
    """``jax.vmap(jax.grad(loss_of_one, has_aux=True))``: (per-example gradients, aux) over axis 0."""
    return jax.vmap(jax.grad(loss_of_one, has_aux=True), in_axes=in_axes)(params, *batched)

"""The DP-SGD step math as pure functions, shared by every front end (tf_keras, Keras 3).

Abadi et al. 2016, Algorithm 1, for a lot of examples and V trainable variables, after a
per-example backend has computed ``sq_norms[i, v] = ||g_i[v]||²``:

* :func:`clip_factors`: ``factors[i, v] = min(1, C_g / ||g_i[g]||)`` where ``g = groups[v]`` is the
  clipping group of variable v and ``||g_i[g]||²`` sums ``sq_norms[i, u]`` over the variables u of
  that group. Flat clipping is one group (every variable in group 0, one bound C); per-layer
  clipping (Abadi et al. 2016, Sec 3.1; McMahan et al. 2018) is one group per variable. An
  example with a non-finite squared norm gets factor 0 everywhere (:func:`finite_rows`).
  Per-example normalization (``stability`` γ > 0: automatic clipping, Bu et al., NeurIPS 2023; De
  et al. 2022's rescaling to unit norm) replaces the factor by ``C_g / (||g_i[g]|| + γ)``: every
  example then has norm < C_g, so the sensitivity is C_g, as for clipping (the front ends use C = 1).
* :func:`noise_stddevs`: the noise on variable v is N(0, σ_v² C_{groups[v]}²).
* :func:`normalize`: divide by the expected lot size L (Poisson lots), else by the realized
  number of examples.

The functions hold no state and read no optimizer: a front end passes the bounds (a tensor, so
adaptive clipping may change them between steps), the static groups and the σ's.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

__all__ = ["clip_groups", "finite_rows", "clip_factors", "noise_stddevs", "noise_key", "normalize"]


def clip_groups(num_variables: int, per_layer: bool) -> list[int]:
    """The clipping group of each variable: all in group 0 (flat), or one group each."""
    return list(range(num_variables)) if per_layer else [0] * num_variables


def finite_rows(sq_norms: tf.Tensor) -> tf.Tensor:
    """[B, 1] bool: True for the examples whose squared norms are all finite."""
    return tf.reduce_all(tf.math.is_finite(sq_norms), axis=1, keepdims=True)


def clip_factors(
    sq_norms: tf.Tensor,
    bounds: tf.Tensor,
    groups: Sequence[int],
    finite: tf.Tensor | None = None,
    stability: float | None = None,
) -> tf.Tensor:
    """Per-example clip factors [B, V] (Abadi et al. 2016, Alg. 1, "clip gradient").

    Args:
      sq_norms: float32 [B, V], ``||g_i[v]||²`` of each example i and variable v.
      bounds: float32 [G], the clip bound C_g of each group.
      groups: V static ints in [0, G): the group of each variable.
      finite: [B, 1] bool from :func:`finite_rows` (computed here if None); rows that are
        False get factor 0 in every column.
      stability: None (clipping) or γ > 0 (per-example normalization, Bu et al. 2023).

    Returns:
      factors [B, V]: ``min(1, C_g / ||g_i[g]||)`` (clipping) or ``C_g / (||g_i[g]|| + γ)``
      (normalization) for variable v in group g, 0 for non-finite examples. A group whose squared
      norm overflows to inf gets factor 0 too.
    """
    groups = list(groups)
    num_groups = max(groups) + 1
    if finite is None:
        finite = finite_rows(sq_norms)
    bounds = tf.cast(bounds, sq_norms.dtype)
    if num_groups == len(groups) and groups == list(range(num_groups)):
        group_sq = sq_norms  # One group per variable: nothing to add up.
    else:
        group_sq = tf.transpose(tf.math.unsorted_segment_sum(tf.transpose(sq_norms), groups, num_groups))
    norms = tf.sqrt(group_sq)
    if stability is not None:
        per_group = bounds / (norms + tf.cast(stability, norms.dtype))
    else:
        per_group = tf.where(norms > bounds, bounds / norms, tf.ones_like(norms))
    factors = tf.gather(per_group, groups, axis=1)
    return tf.where(finite, factors, tf.zeros_like(factors))


def noise_stddevs(sigmas: Sequence[float], bounds: tf.Tensor, groups: Sequence[int]) -> tf.Tensor:
    """float32 [V]: the standard deviation σ_v · C_{groups[v]} of the noise on each variable."""
    bounds = tf.cast(bounds, tf.float32)
    return tf.constant(list(sigmas), tf.float32) * tf.gather(bounds, list(groups))


def noise_key(seed: int, noised_steps: tf.Tensor, index: int) -> tf.Tensor:
    """The [2] int64 key of the noise on tensor `index` of a seeded step: a function of
    (seed, the release's position in the model's ledger, index), so reproducible and resumable."""
    step_seed = tf.stack([tf.constant(seed % (2**63), tf.int64), tf.cast(noised_steps, tf.int64)])
    return tf.random.experimental.stateless_fold_in(step_seed, index)


def normalize(noised: Sequence[tf.Tensor], num_examples: tf.Tensor, expected_lot_size: tf.Tensor) -> list[tf.Tensor]:
    """Divides each noised sum by the expected lot size L if L > 0, else by `num_examples`."""
    lot = tf.cast(expected_lot_size, tf.float32)
    denominator = tf.where(lot > 0.0, lot, tf.cast(num_examples, tf.float32))
    return [g / tf.cast(denominator, g.dtype) for g in noised]

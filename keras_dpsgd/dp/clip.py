"""Per-example clipping (Abadi et al. 2016, Algorithm 1, "clip gradient"), and the clipped sum's record.

For a batch of B examples and V trainable variables, after the backend has computed
``sq_norms[i, v] = ||g_i[v]||²`` (certified upper bounds: :mod:`keras_dpsgd.dp.rounding`):

* :func:`clip_factors`: ``factors[i, v] = min(1, C_g / ||g_i[g]||)`` where ``g = groups[v]`` is the clipping
  group of variable v and ``||g_i[g]||²`` sums ``sq_norms[i, u]`` over the variables u of that group. Flat
  clipping is one group (every variable in group 0, one bound C); per-layer clipping (Abadi et al. 2016,
  Sec. 3.1; McMahan et al. 2018) is one group per variable (:func:`clip_groups`). An example with a
  non-finite squared norm gets factor 0 everywhere (:func:`finite_rows`). Per-example normalization
  (``stability`` γ > 0: automatic clipping, Bu et al., NeurIPS 2023; De et al. 2022) replaces the factor by
  ``C_g / (||g_i[g]|| + γ)``: every example then has norm < C_g, so the sensitivity is C_g, as for clipping.
* :class:`ClippedSum`: ``Σ_i factors[i, v] · g_i[v]`` of each variable, the number of examples it sums,
  and its sensitivity: the bound C of each variable's group, which one example's removal can move the
  group's part of the sum by at most. The noise step reads the sensitivity from the record
  (:func:`keras_dpsgd.dp.release.add_noise`); nothing recomputes it.

The functions hold no state: the bounds are arrays (adaptive clipping changes them between lots), the
groups static ints.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["ClippedSum", "clip_groups", "clip_factors", "finite_rows", "sensitivity"]


def clip_groups(num_variables: int, per_layer: bool) -> list[int]:
    """The clipping group of each variable: all in group 0 (flat), or one group each (per layer)."""
    return list(range(num_variables)) if per_layer else [0] * num_variables


def finite_rows(ops: ArrayOps, sq_norms: Any) -> Any:
    """[B, 1] bool: True for the examples whose squared norms are all finite."""
    return ops.reduce_all(ops.is_finite(sq_norms), 1, True)


def clip_factors(
    ops: ArrayOps,
    sq_norms: Any,
    bounds: Any,
    groups: Sequence[int],
    finite: Any = None,
    stability: float | None = None,
) -> Any:
    """Per-example clip factors [B, V] (Abadi et al. 2016, Alg. 1, "clip gradient").

    Args:
      ops: the backend's table.
      sq_norms: float [B, V], ``||g_i[v]||²`` of each example i and variable v.
      bounds: float [G], the clip bound C_g of each group.
      groups: V static ints in [0, G): the group of each variable.
      finite: [B, 1] bool from :func:`finite_rows` (computed here if None); rows that are False get factor
        0 in every column.
      stability: None (clipping) or γ > 0 (per-example normalization, Bu et al. 2023).

    Returns:
      factors [B, V]: ``min(1, C_g / ||g_i[g]||)`` (clipping) or ``C_g / (||g_i[g]|| + γ)`` (normalization)
      for variable v in group g, 0 for non-finite examples. A group whose squared norm overflows to inf gets
      factor 0 too (``C/inf``).
    """
    groups = [int(g) for g in groups]
    num_groups = max(groups) + 1
    if finite is None:
        finite = finite_rows(ops, sq_norms)
    bounds = ops.cast(bounds, sq_norms.dtype)
    if groups == list(range(num_groups)):
        group_sq = sq_norms  # One group per variable: nothing to add up.
    else:
        group_sq = ops.group_sum(sq_norms, groups, num_groups)
    norms = ops.sqrt(group_sq)
    ones = ops.ones_like(norms)
    if stability is not None:
        per_group = bounds / (norms + stability)
    else:
        over = norms > bounds  # the divisor is 1 where the factor is 1 (no inf or NaN computed there)
        per_group = ops.where(over, bounds / ops.where(over, norms, ones), ones)
    factors = per_group if groups == list(range(num_groups)) else ops.gather_columns(per_group, groups)
    return ops.where(finite, factors, ops.zeros_like(factors))


def sensitivity(bounds: Any, groups: Sequence[int]) -> tuple:
    """The L2 sensitivity of each variable's part of a clipped sum: C of its group (a scalar array each).

    Removing one example moves the sum of group g by at most C_g in L2 norm (its clipped gradient's norm),
    so the Gaussian mechanism on variable v needs noise σ_v · C_{groups[v]} (Abadi et al. 2016, Alg. 1).
    """
    by_group = {g: bounds[g] for g in sorted({int(g) for g in groups})}  # each C_g read once (a traced step: one op)
    return tuple(by_group[int(g)] for g in groups)


@dataclasses.dataclass(frozen=True)
class ClippedSum:
    """A clipped sum with what the release needs to know about it.

    Attributes:
      sums: ``Σ_i c_i g_i[v]`` of each variable v (float32 arrays, the variables' shapes).
      num_examples: float32 scalar array, the examples the sums hold (the lot's realized size).
      sensitivity: the bound C_{groups[v]} of each variable (:func:`sensitivity`): one example changes the
        sums of a group by at most this much in L2 norm.
    """

    sums: tuple
    num_examples: Any
    sensitivity: tuple

    def with_sums(self, sums: Sequence[Any]) -> "ClippedSum":
        """The same record over other sums (e.g. gradient canaries added before the noise)."""
        return dataclasses.replace(self, sums=tuple(sums))

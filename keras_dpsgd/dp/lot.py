"""The lot state machine: k batches' clipped sums accumulated, then released once (Abadi et al. 2016, Sec. 3.1).

A lot of ``gradient_accumulation_steps`` = k batches is one DP-SGD step: the clipped sums of its batches
are added up (:func:`accumulate`), the lot is released once on its k-th batch (:func:`is_complete`,
:func:`as_clipped_sum`: one noise draw), then a new lot starts (:func:`reset`). An incomplete lot is never
released nor carried into another lot: it is discarded (:func:`reset`; the front end counts and announces
it). The functions are pure: the front end stores a :class:`Lot` where its Keras keeps state (TensorFlow:
the optimizer's ``dp_accumulator`` variables; JAX: the same variables, threaded through the stateless step).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from keras_dpsgd.dp.clip import ClippedSum
from keras_dpsgd.dp.ops import ArrayOps

__all__ = ["Lot", "accumulate", "as_clipped_sum", "is_complete", "reset"]


@dataclasses.dataclass(frozen=True)
class Lot:
    """The state of a lot being accumulated.

    Attributes:
      sums: the accumulated clipped sum of each variable (in the accumulators' dtypes).
      examples: float32 scalar, the examples of the lot's batches so far.
      batches: integer scalar, the batches accumulated so far.
    """

    sums: tuple
    examples: Any
    batches: Any


def accumulate(ops: ArrayOps, lot: Lot, batch: ClippedSum) -> Lot:
    """The lot with one more batch's clipped sum added."""
    sums = tuple(acc + ops.cast(s, acc.dtype) for acc, s in zip(lot.sums, batch.sums))
    return Lot(sums, lot.examples + batch.num_examples, lot.batches + 1)


def is_complete(lot: Lot, batches_per_lot: int) -> Any:
    """Scalar bool array: True once the lot holds its k batches (the same on every replica)."""
    return lot.batches >= batches_per_lot


def as_clipped_sum(ops: ArrayOps, lot: Lot, sensitivity: tuple) -> ClippedSum:
    """The lot's clipped sum (float32) for the release; `sensitivity` is its batches' (the bounds in force:
    they change only between lots)."""
    return ClippedSum(tuple(ops.cast(s, "float32") for s in lot.sums), lot.examples, tuple(sensitivity))


def reset(ops: ArrayOps, lot: Lot) -> Lot:
    """An empty lot (after a release, or discarding an incomplete lot)."""
    return Lot(tuple(ops.zeros_like(s) for s in lot.sums), ops.zeros_like(lot.examples), ops.zeros_like(lot.batches))

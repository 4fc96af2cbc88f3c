"""Is a DP fit's validation data held out? Row fingerprints of the training data against the validation data.

A callback that decides on a ``val_`` quantity (EarlyStopping, ReduceLROnPlateau, ...) decides on the
validation data without noise; that is outside ε only while no validation row is a training row
(issue 37.5). Object identity is not enough: a copy of ``x_train``, or a slice of it, is the training
data all the same. Each row (all of x's leaves, an example's inputs) is fingerprinted by a 128-bit
BLAKE2b digest of its bytes after casting numbers to float32 (what the model sees of a copy in another
dtype; -0.0 as 0.0; integers beyond 2**24 may then share a fingerprint, which refuses: fail closed),
and one shared digest refuses the fit.

The training rows are fit's ``x`` when it holds arrays (after ``validation_split``: fit has split
them), or the source arrays of a ``PoissonLots`` dataset; the validation rows are those of
``validation_data``'s x (arrays, or a finite ``tf.data.Dataset``, read once). Fail closed: where the
rows of either side cannot be read (a generator, a ``PyDataset``, a dataset of unknown length without
``validation_steps``, another dataset as training data), the decision is refused too.

What this cannot see: near duplicates (an augmented or re-normalized copy of a training row), and a
validation dataset that draws other rows at every pass (its first pass is the one read).
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Union

import numpy as np
import tensorflow as tf

from keras_dpsgd.step.lots import PoissonLotsPyDataset, is_lots_dataset, lots_of

__all__ = ["validation_overlap"]

_HELD_OUT = (
    "validate on held-out data: examples that are not in the training set, as arrays "
    "(validation_data=(x_val, y_val)) or a finite tf.data.Dataset, or validation_split=... with array inputs"
)


def _leaves(x: Any) -> list:
    return tf.nest.flatten(x)


def _as_rows(leaf: Any) -> Optional[np.ndarray]:
    """`leaf` as a numpy array [n, ...] with the dtype rule of the fingerprints, or None if it has no rows."""
    if not hasattr(leaf, "shape"):
        return None
    a = np.asarray(leaf.numpy() if isinstance(leaf, tf.Tensor) else leaf)
    if a.ndim == 0:
        return None
    if a.dtype.kind in "fiub":
        return a.astype(np.float32) + np.float32(0.0)  # -0.0 + 0.0 is 0.0
    return a


def _row_bytes(a: np.ndarray) -> list:
    if a.dtype.kind == "f":
        flat = np.ascontiguousarray(a.reshape(len(a), -1))
        return [row.tobytes() for row in flat]
    return [repr(row.tolist()).encode("utf-8") for row in a]  # strings, objects


def fingerprints(leaves: list) -> Union[list, str]:
    """One digest per row of the arrays `leaves` (sharing their first dimension), or why there is none."""
    arrays = [_as_rows(leaf) for leaf in leaves]
    if not arrays or any(a is None for a in arrays):
        return "its inputs are not arrays with one row per example"
    n = {len(a) for a in arrays}
    if len(n) != 1:
        return "its input arrays do not share their first dimension"
    digests = [hashlib.blake2b(digest_size=16) for _ in range(n.pop())]
    for a in arrays:
        for digest, row in zip(digests, _row_bytes(a)):
            digest.update(row)
    return [d.digest() for d in digests]


def _training_rows(x: Any) -> Union[list, str]:
    lots = lots_of(x)
    if lots is not None:
        inputs = lots._inputs()
        if inputs is None:
            return f"fit's training data is streamed from disk ({type(lots).__name__}), its rows are not in memory"
        return fingerprints(_leaves(inputs))
    if x is None or isinstance(x, (tf.data.Dataset, PoissonLotsPyDataset)) or not _leaves(x):
        return f"fit's training data ({type(x).__name__}) has rows keras_dpsgd cannot read"
    rows = fingerprints(_leaves(x))
    return f"fit's training data: {rows}" if isinstance(rows, str) else rows


def _dataset_inputs(dataset: tf.data.Dataset, steps: Optional[int]) -> Union[list, str]:
    """The inputs (x) of a finite validation dataset, read once, as one array per leaf."""
    if steps is not None:
        dataset = dataset.take(int(steps))
    elif dataset.cardinality() < 0:  # INFINITE or UNKNOWN: reading it might never end
        return "validation_data is a tf.data.Dataset of unknown or infinite length (pass validation_steps)"
    batches = []
    for element in dataset:
        batches.append(element[0] if isinstance(element, (tuple, list)) else element)
    if not batches:
        return []
    leaves = [_leaves(b) for b in batches]
    return [np.concatenate([np.asarray(b[i]) for b in leaves]) for i in range(len(leaves[0]))]


def _validation_rows(validation: Any, steps: Optional[int]) -> Union[list, str]:
    if is_lots_dataset(validation):
        return "validation_data is a PoissonLots dataset: the training lots themselves"
    if isinstance(validation, tf.data.Dataset):
        leaves = _dataset_inputs(validation, steps)
        if isinstance(leaves, str) or not leaves:
            return leaves
    elif isinstance(validation, (tuple, list)) and validation:
        leaves = _leaves(validation[0])
    else:
        return f"validation_data ({type(validation).__name__}) has rows keras_dpsgd cannot read"
    rows = fingerprints(leaves)
    return f"validation_data: {rows}" if isinstance(rows, str) else rows


def validation_overlap(fit_locals: dict) -> Optional[str]:
    """None when fit's validation data is proven held out (or there is none), else why not.

    `fit_locals`: the locals of the running ``fit`` (``keras_dpsgd._frames.fit_frame``), read after fit
    split off ``validation_split``: its ``x`` is the training part, ``validation_data`` the split.
    """
    validation = fit_locals.get("validation_data")
    if validation is None:
        return None  # Keras computes no val_ quantity: the callback has nothing to decide on
    val = _validation_rows(validation, fit_locals.get("validation_steps"))
    if isinstance(val, str):
        return f"{val}, so keras_dpsgd cannot check that it is held out; {_HELD_OUT}"
    train = _training_rows(fit_locals.get("x"))
    if isinstance(train, str):
        return f"{train}, so keras_dpsgd cannot check that the validation data is held out; {_HELD_OUT}"
    seen = set(train)
    shared = [i for i, digest in enumerate(val) if digest in seen]
    if not shared:
        return None
    return (
        f"{len(shared)} of the {len(val)} validation rows are training rows (the first: validation row "
        f"{shared[0]}; byte for byte after casting to float32), so the callback decides on the private "
        f"training data without noise; {_HELD_OUT} (drop the shared rows from the validation data)"
    )

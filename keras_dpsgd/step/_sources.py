"""Where :class:`keras_dpsgd.StreamingPoissonLots` reads its rows: arrays read by index, or a stream read in order.

A stream has ``lots(members)``: given the sorted example indices of some lots, the rows of each lot
``(x, y, sample_weight)`` as numpy arrays, in the order of its indices; arrays have ``padded_rows(idx, real)``: the
rows of one physical batch. Which lot holds which example is
drawn by the sampler (:mod:`keras_dpsgd.step.streaming`), never here.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

from keras_dpsgd.dp.refusals import refuse

_Lot = tuple  # (x, y, sample_weight): numpy structures sharing their first dimension


def _weights(w: Optional[np.ndarray], n: int, where: str) -> np.ndarray:
    """The sample weights of `n` rows (1 when the data hold none), checked finite and >= 0."""
    if w is None:
        return np.ones((n,), np.float32)
    w = np.asarray(w, np.float32).reshape(-1)
    if len(w) != n or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"sample_weight of {where} must be finite and >= 0, one per example, got {w[:8]}...")
    return w


def _spec(example_spec: Any, name: str) -> Any:
    """A per-example spec with a batch dimension None in front; shapes must be fully known (lots are padded)."""

    def one(s):
        if not s.shape.is_fully_defined():
            raise ValueError(
                f"{name} must have examples of one fixed shape (each lot is padded to a static shape), got {s}"
            )
        return tf.TensorSpec((None,) + tuple(s.shape), s.dtype)

    return tf.nest.map_structure(one, example_spec)


def _empty(spec: Any) -> Any:
    return tf.nest.map_structure(lambda s: np.zeros((0,) + tuple(s.shape[1:]), s.dtype.as_numpy_dtype), spec)


class ArrayShards:
    """Rows of arrays cut into shards along the first axis (memory-mapped ``.npy`` files), read by index.

    Each lot reads only its own rows (about L), shard by shard: the memory used is one lot.
    """

    random_access = True

    def __init__(self, x: Sequence[np.ndarray], y: Sequence[np.ndarray], w: Optional[Sequence[np.ndarray]]):
        if not x or len(x) != len(y) or (w is not None and len(w) != len(x)):
            raise ValueError(
                f"x_files, y_files (and sample_weight_files) must name the same number (>= 1) of shards, got "
                f"{len(x)} and {len(y)}" + ("" if w is None else f" and {len(w)}")
            )
        for i, (a, b) in enumerate(zip(x, y)):
            if a.ndim == 0 or b.ndim == 0 or len(a) != len(b) or (w is not None and len(w[i]) != len(a)):
                raise ValueError(f"shard {i}: x and y must share their first dimension, got {a.shape} and {b.shape}")
            if a.shape[1:] != x[0].shape[1:] or b.shape[1:] != y[0].shape[1:]:
                raise ValueError(f"shard {i}: rows of shape {a.shape[1:]}, {b.shape[1:]} differ from shard 0's")
        self._x, self._y, self._w = list(x), list(y), None if w is None else list(w)
        self._offsets = np.cumsum([0] + [len(a) for a in x])
        self.num_examples = int(self._offsets[-1])
        self.element_spec = tuple(tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype)) for a in (x[0], y[0]))

    def padded_rows(self, idx: np.ndarray, real: int) -> _Lot:
        """The rows of the examples ``idx[:real]`` (any order), then zero rows of weight 0 up to ``len(idx)``."""
        real = int(real)
        order = np.argsort(idx[:real], kind="stable")
        x, y, w = self._rows(idx[:real][order])

        def pad(a):
            out = np.zeros((len(idx),) + a.shape[1:], a.dtype)
            out[order] = a  # back to the order of idx
            return out

        return pad(x), pad(y), pad(w)

    def _rows(self, idx: np.ndarray) -> _Lot:
        """The rows of the examples `idx`, sorted."""
        cuts = np.searchsorted(idx, self._offsets)
        parts = [
            (s, idx[cuts[s] : cuts[s + 1]] - self._offsets[s]) for s in range(len(self._x)) if cuts[s + 1] > cuts[s]
        ]

        def read(arrays, first):
            if not parts:
                return np.zeros((0,) + first.shape[1:], first.dtype)
            return np.concatenate([np.asarray(arrays[s][local]) for s, local in parts])

        w = None if self._w is None else read(self._w, self._w[0])
        return read(self._x, self._x[0]), read(self._y, self._y[0]), _weights(w, len(idx), "the shards")


class Stream:
    """Examples read in order from a finite ``tf.data.Dataset`` (one example per element): one pass, many lots.

    `chunks`: the dataset in batches (chunks) of examples. Each pass reads it once and routes every example to the lots
    that hold it (their sorted indices), so one pass feeds all the lots asked for; memory: those lots' rows
    plus one chunk. The pass must see exactly `num_examples` examples, else it is refused (q = L/N would be
    wrong) before any of its lots is returned.
    """

    random_access = False

    def __init__(self, chunks: tf.data.Dataset, num_examples: int, name: str):
        spec = chunks.element_spec  # batched: [chunk, ...] per component
        if not isinstance(spec, tuple) or len(spec) not in (2, 3):
            raise ValueError(f"{name} must hold (x, y) or (x, y, sample_weight) examples, got elements {spec}")
        self._spec = _spec(tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape[1:], s.dtype), spec), name)
        self.element_spec = self._spec[:2]
        self._name = name
        self.num_examples = num_examples
        self._chunks = chunks.prefetch(tf.data.AUTOTUNE)

    def lots(self, members: Sequence[np.ndarray]) -> list:
        counts = [len(m) for m in members]
        wanted = np.concatenate(members) if members else np.zeros((0,), np.int64)  # lot by lot
        order = np.argsort(wanted, kind="stable")
        in_stream = wanted[order]  # every (lot, example) pair, by position in the stream
        pieces, start = [], 0
        for chunk in self._chunks.as_numpy_iterator():
            stop = start + len(tf.nest.flatten(chunk)[0])
            lo, hi = np.searchsorted(in_stream, (start, stop))
            if hi > lo:  # one gather per chunk, whatever the number of lots
                local = in_stream[lo:hi] - start
                pieces.append(tf.nest.map_structure(lambda a, local=local: a[local], chunk))
            start = stop
        if start != self.num_examples:
            raise refuse(
                "stream-size-changed",
                f"{self._name} held {start} examples in this pass, but its lots are drawn at q = L/N for "
                f"num_examples N = {self.num_examples}: the data changed, so the rate would be wrong; no lot of "
                "this pass was used",
            )
        rows = tf.nest.map_structure(lambda *a: np.concatenate(a), *pieces) if pieces else _empty(self._spec)
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        by_lot = tf.nest.map_structure(lambda a: a[back], rows)  # lot by lot again
        ends = np.cumsum(counts)
        out = []
        for n, end in zip(counts, ends):
            lot = tf.nest.map_structure(lambda a, lo=end - n, hi=end: a[lo:hi], by_lot)
            w = lot[2] if len(lot) == 3 else None
            out.append((lot[0], lot[1], _weights(w, int(n), self._name)))
        return out

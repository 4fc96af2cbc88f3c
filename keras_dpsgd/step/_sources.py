"""Where :class:`keras_dpsgd.StreamingPoissonLots` reads its rows: arrays read by index, or a stream read in order.

Both readers have one method, ``lots(members)``: given the sorted example indices of some lots, the rows of each
lot ``(x, y, sample_weight)`` as numpy arrays, in the order of its indices. Which lot holds which example is
drawn by the sampler (:mod:`keras_dpsgd.step.streaming`), never here.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

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

    def lots(self, members: Sequence[np.ndarray]) -> list:
        return [self._rows(m) for m in members]

    def _rows(self, idx: np.ndarray) -> _Lot:
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

    Each pass reads the dataset once in chunks of `chunk_size` examples and routes every example to the lots
    that hold it (their sorted indices), so one pass feeds all the lots asked for; memory: those lots' rows
    plus one chunk. The pass must see exactly `num_examples` examples, else it is refused (q = L/N would be
    wrong) before any of its lots is returned.
    """

    random_access = False

    def __init__(self, dataset: tf.data.Dataset, num_examples: int, chunk_size: int, name: str):
        spec = dataset.element_spec
        if not isinstance(spec, tuple) or len(spec) not in (2, 3):
            raise ValueError(f"{name} must hold (x, y) or (x, y, sample_weight) examples, got elements {spec}")
        self._spec = _spec(spec, name)
        self.element_spec = self._spec[:2]
        self._name = name
        self.num_examples = num_examples
        self._chunks = dataset.batch(chunk_size).prefetch(tf.data.AUTOTUNE)

    def lots(self, members: Sequence[np.ndarray]) -> list:
        parts: list = [[] for _ in members]
        start = 0
        for chunk in self._chunks.as_numpy_iterator():
            stop = start + len(tf.nest.flatten(chunk)[0])
            for k, m in enumerate(members):
                lo, hi = np.searchsorted(m, (start, stop))
                if hi > lo:
                    local = m[lo:hi] - start
                    parts[k].append(tf.nest.map_structure(lambda a, local=local: a[local], chunk))
            start = stop
        if start != self.num_examples:
            raise ValueError(
                f"{self._name} held {start} examples in this pass, but its lots are drawn at q = L/N for "
                f"num_examples N = {self.num_examples}: the data changed, so the rate would be wrong; no lot of "
                "this pass was used"
            )
        out = []
        for lot in parts:
            rows = tf.nest.map_structure(lambda *a: np.concatenate(a), *lot) if lot else _empty(self._spec)
            w = rows[2] if len(rows) == 3 else None
            out.append((rows[0], rows[1], _weights(w, len(tf.nest.flatten(rows[0])[0]), self._name)))
        return out

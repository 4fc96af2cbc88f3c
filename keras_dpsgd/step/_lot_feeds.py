"""How Poisson lots reach ``fit``: the mark their datasets carry, a Keras 3 ``PyDataset`` of them, and a finite
``tf.data.Dataset`` read into memory.

A dataset made by :meth:`keras_dpsgd.PoissonLots.dataset` (or ``distribute``, ``as_py_dataset``) names its sampler
(:func:`lots_of`): ``fit`` of a private Keras 3 model takes ``shuffle=False`` for it, every DP ``fit`` records the
rate of its lots (:mod:`keras_dpsgd.step.fed_data`), and the callback guard reads its rows
(:mod:`keras_dpsgd.step._held_out`).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from keras_dpsgd.step._poisson import PoissonSampling, check_num_lots
from keras_dpsgd.dp.refusals import refuse

__all__ = ["LOTS_ATTR", "PoissonLotsPyDataset", "is_lots_dataset", "lots_of", "read_examples"]

LOTS_ATTR = "_keras_dpsgd_poisson_lots"


def lots_of(data: Any) -> Optional[PoissonSampling]:
    """The :class:`PoissonLots` whose :meth:`~PoissonLots.dataset`, :meth:`~PoissonLots.as_py_dataset` or
    :meth:`~PoissonLots.distribute` made `data` (that object itself, not one derived from it by
    ``map``, ``batch``...), else None."""
    if isinstance(data, PoissonLotsPyDataset):
        return data._lots
    lots = getattr(data, LOTS_ATTR, None)
    return lots if isinstance(lots, PoissonSampling) else None


def is_lots_dataset(data: Any) -> bool:
    """True for a dataset made by :meth:`PoissonLots.dataset` or :meth:`PoissonLots.as_py_dataset`
    (lots are independent draws: fit's ``shuffle`` means nothing for them)."""
    return lots_of(data) is not None


def read_examples(dataset: tf.data.Dataset) -> list:
    """The columns ``[x, y]`` or ``[x, y, sample_weight]`` of a finite dataset of single examples, stacked in memory.

    Raises:
      ValueError: if the dataset is infinite or empty, or its elements are not ``(x, y)`` /
        ``(x, y, sample_weight)`` tuples.
    """
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError("dataset must be finite to be Poisson-sampled, got an infinite dataset")
    spec = dataset.element_spec
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
        raise ValueError(f"dataset elements must be (x, y) or (x, y, sample_weight), got {spec}")
    columns = None
    for element in dataset.as_numpy_iterator():
        if columns is None:
            columns = [[] for _ in element]
        for col, part in zip(columns, element):
            col.append(part)
    if columns is None:
        raise ValueError("dataset must hold at least 1 example, got an empty dataset")
    return [tf.nest.map_structure(lambda *a: np.stack(a), *col) for col in columns]


class PoissonLotsPyDataset(keras.utils.PyDataset):
    """Poisson lots as a Keras 3 ``keras.utils.PyDataset`` (get one with :meth:`PoissonLots.as_py_dataset`).

    Every ``__getitem__`` draws a fresh lot, whatever the index: lots are
    independent, so their order means nothing and ``fit(shuffle=...)``
    changes nothing. Keras draws two lots before training to learn the
    batch shapes and does not train on them (the stream of fresh lots goes
    on). Each epoch is `num_lots` fresh lots (or endless: pass
    ``steps_per_epoch``).

    One worker, in this process only: worker processes would copy the
    sampler's generator and draw the same lots (no longer independent), so
    ``workers`` other than 1 and ``use_multiprocessing=True`` are refused.
    """

    def __init__(self, lots: PoissonSampling, num_lots: Optional[int] = None):
        super().__init__(workers=1, use_multiprocessing=False)
        check_num_lots(num_lots)
        self._lots = lots
        self._num_lots = None if num_lots is None else int(num_lots)
        self._stream = lots._numpy_batches(None)
        self._lock = threading.Lock()

    @property
    def workers(self) -> int:
        return 1

    @workers.setter
    def workers(self, value: int) -> None:
        if value != 1:
            raise refuse(
                "lots-py-dataset-workers",
                f"workers must be 1 for Poisson lots, got {value!r}: several workers would draw lots out of "
                "order or, as processes, the same lots",
            )

    @property
    def use_multiprocessing(self) -> bool:
        return False

    @use_multiprocessing.setter
    def use_multiprocessing(self, value: bool) -> None:
        if value:
            raise refuse(
                "lots-py-dataset-workers",
                "use_multiprocessing must be False for Poisson lots, got True: each process would copy the "
                "sampler's generator and draw the same lots",
            )

    @property
    def num_batches(self) -> Optional[int]:
        """`num_lots` (one batch per lot), or None for an endless stream."""
        return self._num_lots

    def __len__(self) -> int:
        if self._num_lots is None:
            raise TypeError("an endless PoissonLotsPyDataset has no len(); pass steps_per_epoch to fit")
        return self._num_lots

    def __getitem__(self, index: int) -> tuple:
        """A fresh lot ``(x, y, sample_weight)`` (the index only bounds a finite dataset)."""
        if self._num_lots is not None and not 0 <= index < self._num_lots:
            raise IndexError(f"index must be in [0, {self._num_lots}), got {index!r}")
        with self._lock:
            return next(self._stream)

"""Poisson sampling and padding over N examples: the draws the accountant assumes, and their fixed shapes.

:class:`PoissonSampling` holds what every sampler of lots shares, whatever holds the rows (arrays in memory,
:class:`keras_dpsgd.PoissonLots`; files or a stream, :class:`keras_dpsgd.StreamingPoissonLots`): the rate q, the
capacity and the physical batches, the generator of the lots (each example independently with probability q; Abadi
et al. 2016, Algorithm 1), the padding of a lot to its physical size (weight-0 rows, an overflow in a bigger
bucket), the shards of several workers, and :meth:`PoissonSampling.configure` of the optimizer. Why Poisson and not
shuffling, the padding's cost and what the timing reveals, the secrecy of the seed and the workers' shards: the
docstring of :mod:`keras_dpsgd.step.lots`.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any, Iterator, Optional

import numpy as np
import tensorflow as tf
from scipy import stats

from keras_dpsgd import _validate, ledger
from keras_dpsgd.accounting.planning import lots_per_epoch
from keras_dpsgd.dp.refusals import refuse

__all__ = ["PoissonSampling", "check_num_lots", "check_workers", "strategy_workers"]

_LOG = logging.getLogger("keras_dpsgd")
_LOTS_PER_BLOCK = 16  # lots per element of the index generator (PoissonSampling._index_dataset)


def _lot_capacity(num_examples: int, sampling_rate: float, overflow_probability: float) -> int:
    """Smallest k with P(Binomial(N, q) > k) <= overflow_probability."""
    if sampling_rate >= 1.0:
        return num_examples
    k = int(stats.binom.isf(overflow_probability, num_examples, sampling_rate))
    return int(min(num_examples, max(1, k)))


def _split(capacity: int, max_physical_batch_size: Any, replicas: int) -> tuple[int, int]:
    """(k, P): a lot of `capacity` rows as k = ceil(capacity / M) physical batches of P = ceil(capacity / k) rows
    (rounded up to a multiple of `replicas`), so P <= M = `max_physical_batch_size` and k * P - capacity < k * replicas.

    Raises:
      ValueError: M not an integer >= `replicas`, or not a multiple of it.
    """
    most = _validate.integer_at_least(replicas, max_physical_batch_size=max_physical_batch_size)
    if most % replicas:
        raise ValueError(
            f"max_physical_batch_size must be a multiple of replicas_per_worker={replicas} (each replica gets an "
            f"equal part), got {max_physical_batch_size!r}"
        )
    batches = math.ceil(capacity / most)
    return batches, math.ceil(math.ceil(capacity / batches) / replicas) * replicas


def check_num_lots(num_lots: Optional[int]) -> None:
    """Refuses a `num_lots` other than None (an endless stream) or an integer >= 0."""
    if num_lots is not None:
        _validate.integer_at_least(0, num_lots=num_lots)


def strategy_workers(strategy: Any) -> int:
    """The workers of a ``tf.distribute`` strategy (1 for one machine)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 1
    spec = resolver.cluster_spec().as_dict()
    return max(1, len(spec.get("worker", [])) + len(spec.get("chief", [])))


def check_workers(num_workers: int, strategy: Any) -> None:
    """Refuses a sampler whose shards do not match the strategy's workers."""
    if strategy is None:
        return
    workers = strategy_workers(strategy)
    if workers != num_workers:
        raise refuse(
            "lots-num-workers",
            f"PoissonLots has num_workers={num_workers} but the optimizer's {type(strategy).__name__} runs "
            f"{workers} worker(s): each worker must sample its own shard (PoissonLots(..., "
            f"num_workers={workers}, worker_index=<this worker's index>)), so that the union of the workers' "
            "lots is one Poisson lot of the data set",
        )


class PoissonSampling:
    """The rate, the capacity, the generator and the padding of Poisson lots over N examples (module docstring).

    A subclass holds the rows and calls :meth:`_init_sampling` with N and the sampler's arguments (those of
    :class:`keras_dpsgd.PoissonLots`).
    """

    def _init_sampling(
        self,
        n: int,
        *,
        sampling_rate: Optional[float],
        expected_lot_size: Optional[float],
        physical_batch_size: Optional[int],
        max_lot_size: Optional[int],
        overflow_probability: float,
        pad_to_multiple_of: Optional[int],
        seed: Optional[int],
        num_workers: int,
        worker_index: int,
        replicas_per_worker: int,
        max_physical_batch_size: Optional[int] = None,
    ) -> None:
        """The rate, the capacity and the generator of lots over N = `n` examples (the arguments of the class)."""
        self._n = n
        if (sampling_rate is None) == (expected_lot_size is None):
            raise ValueError(
                "exactly one of sampling_rate and expected_lot_size must be given, got "
                f"sampling_rate={sampling_rate!r}, expected_lot_size={expected_lot_size!r}"
            )
        if sampling_rate is not None:
            q = _validate.in_range(0, 1, "(]", sampling_rate=sampling_rate)
        else:
            q = _validate.in_range(0, n, "(]", expected_lot_size=expected_lot_size) / n
        self._q = q
        self._workers = _validate.integer_in_range(1, n, num_workers=num_workers)
        self._worker_index = _validate.integer_in_range(0, self._workers - 1, worker_index=worker_index)
        self._shard = np.arange(self._worker_index, n, self._workers)  # i % W == w
        replicas = _validate.integer_at_least(1, replicas_per_worker=replicas_per_worker)
        overflow_probability = _validate.in_range(0, 1, "()", overflow_probability=overflow_probability)
        largest_shard = math.ceil(n / self.num_workers)
        if max_lot_size is None:
            capacity = _lot_capacity(largest_shard, q, overflow_probability)
        else:
            capacity = _validate.integer_in_range(1, largest_shard, max_lot_size=max_lot_size)
        if physical_batch_size is not None and max_physical_batch_size is not None:
            raise ValueError(
                "give at most one of physical_batch_size and max_physical_batch_size, got "
                f"physical_batch_size={physical_batch_size!r}, max_physical_batch_size={max_physical_batch_size!r}"
            )
        if max_physical_batch_size is not None:
            self._accum, self._physical = _split(capacity, max_physical_batch_size, replicas)
        elif physical_batch_size is None:
            self._physical = math.ceil(capacity / replicas) * replicas
            self._accum = 1
        else:
            self._physical = _validate.integer_at_least(1, physical_batch_size=physical_batch_size)
            if self._physical % replicas:
                raise ValueError(
                    f"physical_batch_size must be a multiple of replicas_per_worker={replicas} (each replica "
                    f"gets an equal part), got {physical_batch_size!r}"
                )
            self._accum = max(1, math.ceil(capacity / self._physical))
        self._capacity = self._physical * self._accum
        self._multiple = None
        if pad_to_multiple_of is not None:
            self._multiple = _validate.integer_at_least(1, pad_to_multiple_of=pad_to_multiple_of)
            if self._workers > 1 or self._multiple % replicas:
                raise ValueError(
                    "pad_to_multiple_of must be a multiple of replicas_per_worker and needs num_workers=1 (every "
                    f"worker pads to the same size), got pad_to_multiple_of={pad_to_multiple_of!r}, "
                    f"replicas_per_worker={replicas}, num_workers={self._workers}"
                )
        if seed is not None:
            seed = _validate.integer_at_least(0, seed=seed)
            if self.num_workers > 1:
                seed = [seed, self.num_workers, self.worker_index]  # One stream per worker.
        # One generator for the life of the object: a second iteration of the
        # dataset continues the stream instead of replaying the same lots.
        self._rng = np.random.default_rng(seed)
        self.overflow_count = 0

    # ---------------------------------------------------------------- facts
    @property
    def num_examples(self) -> int:
        """N, the number of examples."""
        return self._n

    @property
    def num_workers(self) -> int:
        """W, the workers sampling a shard each (1: no sharding)."""
        return self._workers

    @property
    def worker_index(self) -> int:
        """w, this worker's shard: the examples i with i % W == w."""
        return self._worker_index

    @property
    def shard_size(self) -> int:
        """The examples of this worker's shard (N when W = 1)."""
        return len(self._shard)

    @property
    def sampling_rate(self) -> float:
        """q, the probability that an example is in a given lot."""
        return self._q

    @property
    def expected_lot_size(self) -> float:
        """L = qN, the expected lot size of the whole (global) lot: the optimizer's normalizer."""
        return self._q * self._n

    @property
    def physical_batch_size(self) -> int:
        """Rows per physical batch (without overflow)."""
        return self._physical

    @property
    def gradient_accumulation_steps(self) -> int:
        """Physical batches per lot; use it as the optimizer's gradient_accumulation_steps."""
        return self._accum

    @property
    def max_lot_size(self) -> int:
        """Lot capacity before overflow: physical_batch_size * gradient_accumulation_steps."""
        return self._capacity

    @property
    def lots_per_epoch(self) -> int:
        """ceil(N/L) = ceil(1/q): lots per epoch (:func:`keras_dpsgd.accounting.lots_per_epoch`, the one definition)."""
        return lots_per_epoch(self._n, self.expected_lot_size)

    @property
    def steps_per_epoch(self) -> int:
        """Physical batches per epoch, for ``fit(steps_per_epoch=...)``."""
        return self.lots_per_epoch * self._accum

    # ------------------------------------------------------------- sampling
    def sample_indices(self) -> np.ndarray:
        """Draws one lot: the indices of the selected examples, in random order.

        Each example is selected independently with probability q (so the
        size is Binomial(N, q)); the indices are distinct. With W workers, the
        examples of this worker's shard only (Binomial(shard_size, q)).
        """
        return self._rng.permutation(self._members())

    def _members(self) -> np.ndarray:
        """One lot's examples in increasing order: each one independently with probability q."""
        if self.num_workers == 1:
            return np.flatnonzero(self._rng.random(self._n) < self._q)
        return self._shard[self._rng.random(len(self._shard)) < self._q]

    @property
    def pad_to_multiple_of(self) -> Optional[int]:
        """m: each physical batch padded to the next multiple of m rows; None: to the capacity."""
        return self._multiple

    def _physical_rows(self, lot_size: int) -> int:
        if self._multiple is not None and lot_size <= self._capacity:
            return max(1, math.ceil(math.ceil(lot_size / self._accum) / self._multiple)) * self._multiple
        if lot_size <= self._capacity:
            return self._physical
        # Overflow: a bigger bucket (a multiple of the physical batch size),
        # never a truncated lot.
        self.overflow_count += 1
        if self.overflow_count == 1:
            _LOG.warning(
                "PoissonLots: a lot of %d examples exceeded the capacity %d; it is emitted in a "
                "bigger padded batch (no example is dropped).",
                lot_size,
                self._capacity,
            )
        per_batch = math.ceil(lot_size / self._accum)
        bucket = self._multiple or self._physical
        return math.ceil(per_batch / bucket) * bucket

    def _index_batches(self, num_lots: Optional[int]) -> Iterator[tuple]:
        """Yields, per physical batch, (row indices, sample weights, number of real rows).

        Padded rows have index N (a row of zeros appended for gathering) and weight 0.
        """
        drawn = 0
        while num_lots is None or drawn < num_lots:
            indices = self.sample_indices()
            weights = 1.0 if self._weights is None else self._weights[indices]
            idx, w = self._padded(len(indices), indices, weights, self._n)
            yield from self._parts(len(indices), idx, w)
            drawn += 1

    def _index_dataset(self, num_lots: Optional[int]) -> tf.data.Dataset:
        """:meth:`_index_batches` as a ``tf.data.Dataset`` of (row indices, sample weights, real rows) per physical
        batch, the same batches in the same order.

        The generator hands ``tf.data`` up to ``_LOTS_PER_BLOCK`` lots at a time (their batches concatenated), cut
        into batches by ``tf.data`` itself: each element that crosses from Python into ``tf.data`` costs a few
        hundred microseconds of host time (``benchmarks/padding.py``), paid once per block instead of per batch.
        A block never holds more lots than `num_lots` asks for; an endless stream draws at most a block ahead
        (lots drawn and never trained on are never released: the lots used are still independent draws).
        """
        per_block = _LOTS_PER_BLOCK * self._accum

        def blocks():  # each iteration of the dataset: a fresh pass
            batches = self._index_batches(num_lots)
            while block := list(itertools.islice(batches, per_block)):
                idx, w, real = zip(*block)
                yield np.concatenate(idx), np.concatenate(w), np.array([len(i) for i in idx], np.int64), np.array(real)

        signature = (
            tf.TensorSpec(shape=(None,), dtype=tf.int64),
            tf.TensorSpec(shape=(None,), dtype=tf.float32),
            tf.TensorSpec(shape=(None,), dtype=tf.int64),
            tf.TensorSpec(shape=(None,), dtype=tf.int64),
        )

        def split(idx, w, sizes, real):
            ends = tf.cumsum(sizes)
            parts = tf.data.Dataset.from_tensor_slices((ends - sizes, ends, real))
            return parts.map(lambda start, end, r: (idx[start:end], w[start:end], r))

        return tf.data.Dataset.from_generator(blocks, output_signature=signature).flat_map(split)

    def _padded(self, n: int, rows: Any, weights: Any, fill: Any) -> tuple:
        """One lot of `n` examples, its `rows` (an array or a structure of arrays) and `weights`, padded to the
        lot's physical size with `fill` (the padding row: a scalar) and weight 0 (overflow: a bigger bucket)."""
        size = self._physical_rows(n) * self._accum

        def pad(a):
            out = np.full((size,) + a.shape[1:], fill, dtype=a.dtype)
            out[:n] = a
            return out

        w = np.zeros((size,), dtype=np.float32)
        w[:n] = weights
        return tf.nest.map_structure(pad, rows), w

    def _parts(self, lot_size: int, *padded: Any) -> Iterator[tuple]:
        """The `gradient_accumulation_steps` physical batches of one padded lot of `lot_size` examples:
        each of the `padded` structures cut in equal parts, and the number of real rows of each part."""
        rows = len(padded[-1]) // self._accum
        for b in range(self._accum):
            part = slice(b * rows, (b + 1) * rows)
            cut = [tf.nest.map_structure(lambda a, part=part: a[part], p) for p in padded]
            yield (*cut, np.int64(min(rows, max(0, lot_size - b * rows))))

    def configure(self, optimizer: Any) -> Any:
        """Tells a DP optimizer how its lots are drawn; returns it.

        Sets ``optimizer.expected_lot_size = qN`` (the normalizer of the noised
        sum) and ``optimizer.sampling_rate = q`` (for the accountant).

        Raises:
          ValueError: if the optimizer's gradient_accumulation_steps differs
            from this sampler's, or the optimizer's strategy has another number
            of workers than `num_workers`.
        """
        check_workers(self.num_workers, getattr(optimizer, "_distribution_strategy", None))
        accum = ledger.accumulation_steps(optimizer)
        if accum != self._accum:
            raise refuse(
                "lots-accumulation-mismatch",
                f"optimizer.gradient_accumulation_steps must be {self._accum} (physical batches per "
                f"lot of this PoissonLots), got {accum}",
            )
        optimizer.expected_lot_size = self.expected_lot_size
        optimizer.sampling_rate = self._q
        return optimizer

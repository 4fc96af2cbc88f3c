"""Poisson lots from data that does not fit in memory: ``tf.data`` pipelines, TFRecord files, memory-mapped
``.npy`` shards, a tensorflow-datasets split.

Same sampling, same accounting
------------------------------
:class:`StreamingPoissonLots` is a :class:`keras_dpsgd.PoissonLots` whose examples stay on disk. Each lot holds
each of the N examples independently with probability q = L/N (Abadi et al. 2016, Algorithm 1), drawn by the same
generator (seeded from the operating system's entropy; a `seed` is for tests only: whoever knows it knows every
lot), padded and cut into physical batches by the same code (padding rows are zeros of ``sample_weight`` 0, which
the step's clipped sum ignores), and ``configure(optimizer)``, the check of what ``fit`` is fed
(:mod:`keras_dpsgd.step.fed_data`) and the ledger treat its lots as PoissonLots' (it is one): ε after k lots is the
in-memory sampler's for the same (N, L, σ, k). Only the reading of the rows differs.

Random access: memory-mapped ``.npy`` shards
--------------------------------------------
:meth:`StreamingPoissonLots.from_npy`: each lot reads its own ~L rows from the memory-mapped files. Memory: one lot.

A stream: one pass feeds K lots
-------------------------------
:meth:`~StreamingPoissonLots.from_dataset`, :meth:`~StreamingPoissonLots.from_tfrecord`,
:meth:`~StreamingPoissonLots.from_tfds` read their data in order only. Reading all N examples for every lot
would cost N reads per lot, so each pass draws the memberships of K = `lots_per_pass` lots at once (each lot's
own Bernoulli(q) draw for every position 0..N-1, independent across lots and examples: the K lots are K
independent Poisson lots, exactly as K separate draws) and reads the data once, routing each example to the lots
that hold it. Cost: N/K examples read per lot. **Memory: the K lots in flight**, about K·L rows (K·max_lot_size
at most but for an overflow, which is never truncated), plus one chunk of `chunk_size` examples and K·L
indices. The lots of a pass go to ``fit`` only after the pass has read exactly N examples: data whose length
changed (so that q = L/N would be wrong) are refused before any lot of that pass reaches a step.

Membership is by position in the stream; a pipeline that reshuffles between passes is fine (the order is
independent of the draws, so each example is still in each lot with probability q, independently).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from keras_dpsgd import _validate
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.step._sources import ArrayShards, Stream
from keras_dpsgd.step.lots import PoissonLots

__all__ = ["StreamingPoissonLots"]

_LOG = logging.getLogger("keras_dpsgd")

_DEFAULT_LOTS_PER_PASS = 32


def _num_examples(dataset: tf.data.Dataset, num_examples: Optional[int], name: str) -> int:
    """N: the dataset's cardinality, or `num_examples` (checked against it), or counted in one pass (announced)."""
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"{name} must be a tf.data.Dataset of single examples, got {type(dataset).__name__}")
    known = int(dataset.cardinality())
    if known == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            f"{name} must be finite to be Poisson-sampled (q = L/N needs N), got an infinite dataset (a repeat() "
            "without a count?)"
        )
    if num_examples is not None:
        num_examples = _validate.integer_at_least(1, num_examples=num_examples)
        if known >= 0 and known != num_examples:
            raise refuse(
                "stream-size-changed", f"num_examples must be the {name}'s cardinality {known}, got {num_examples}"
            )
        return num_examples  # otherwise every pass checks it
    if known >= 0:
        if known < 1:
            raise ValueError(f"{name} must hold at least 1 example, got an empty dataset")
        return known
    counted = int(dataset.reduce(np.int64(0), lambda n, _: n + 1))
    if counted < 1:
        raise ValueError(f"{name} must hold at least 1 example, got an empty dataset")
    _LOG.warning(
        "StreamingPoissonLots: the cardinality of %s is unknown; counted N = %d examples in one pass (pass "
        "num_examples=%d to skip the count; every pass checks it).",
        name,
        counted,
        counted,
    )
    return counted


class StreamingPoissonLots(PoissonLots):
    """Poisson lots of data read from disk or from a ``tf.data`` pipeline, for ``fit`` (module docstring).

    Build one with :meth:`from_npy`, :meth:`from_dataset`, :meth:`from_tfrecord` or :meth:`from_tfds`; use
    it as :class:`keras_dpsgd.PoissonLots`::

        lots = StreamingPoissonLots.from_npy(["x-0.npy", "x-1.npy"], ["y-0.npy", "y-1.npy"], expected_lot_size=256)
        lots.configure(optimizer)
        model.fit(lots.dataset(lots.lots_per_epoch), epochs=...)

    One worker only (``num_workers`` 1); ``dataset``, ``as_py_dataset``, ``distribute`` (one worker's local
    replicas) and ``lots`` work as PoissonLots'.

    Args:
      source: where the rows are read (made by the ``from_*`` constructors).
      sampling_rate: q, as :class:`keras_dpsgd.PoissonLots` (exactly one of it and `expected_lot_size`).
      expected_lot_size: L = qN, as :class:`keras_dpsgd.PoissonLots`.
      physical_batch_size: as :class:`keras_dpsgd.PoissonLots`.
      max_physical_batch_size: as :class:`keras_dpsgd.PoissonLots`.
      max_lot_size: as :class:`keras_dpsgd.PoissonLots`.
      overflow_probability: as :class:`keras_dpsgd.PoissonLots`.
      pad_to_multiple_of: as :class:`keras_dpsgd.PoissonLots` (None: every lot padded to the capacity).
      seed: for tests only: None (the default) draws from the operating system; whoever knows a fixed seed knows
        every lot.
      lots_per_pass: K >= 1, the lots one pass over a stream feeds (memory: K lots; reads: N/K examples per
        lot); None for min(32, lots_per_epoch). Ignored for random-access sources (``.npy``).
    """

    def __init__(
        self,
        source: Union[ArrayShards, Stream],
        *,
        sampling_rate: Optional[float] = None,
        expected_lot_size: Optional[float] = None,
        physical_batch_size: Optional[int] = None,
        max_physical_batch_size: Optional[int] = None,
        max_lot_size: Optional[int] = None,
        overflow_probability: float = 1e-9,
        pad_to_multiple_of: Optional[int] = None,
        seed: Optional[int] = None,
        lots_per_pass: Optional[int] = None,
    ):
        if not isinstance(source, (ArrayShards, Stream)):
            raise TypeError(
                "source must come from StreamingPoissonLots.from_npy/from_dataset/from_tfrecord/from_tfds, got "
                f"{type(source).__name__}"
            )
        self._source = source
        self._weights = None  # each lot reads its weights with its rows
        self._init_sampling(
            source.num_examples,
            sampling_rate=sampling_rate,
            expected_lot_size=expected_lot_size,
            physical_batch_size=physical_batch_size,
            max_physical_batch_size=max_physical_batch_size,
            max_lot_size=max_lot_size,
            overflow_probability=overflow_probability,
            pad_to_multiple_of=pad_to_multiple_of,
            seed=seed,
            num_workers=1,
            worker_index=0,
            replicas_per_worker=1,
        )
        if source.random_access:
            self._per_pass = 1
        elif lots_per_pass is None:
            self._per_pass = min(_DEFAULT_LOTS_PER_PASS, self.lots_per_epoch)
        else:
            self._per_pass = _validate.integer_at_least(1, lots_per_pass=lots_per_pass)

    # -------------------------------------------------------------- sources
    @classmethod
    def from_npy(
        cls,
        x_files: Sequence[str],
        y_files: Sequence[str],
        *,
        sample_weight_files: Optional[Sequence[str]] = None,
        **kwargs: Any,
    ) -> "StreamingPoissonLots":
        """Lots of ``.npy`` shards, memory-mapped (``np.load(mmap_mode="r")``): the rows are the shards'
        rows in the order of the files. Each lot reads its own rows.

        Args:
          x_files: the shards' inputs, one file per shard (a str: one shard).
          y_files: the shards' targets, one file per shard.
          sample_weight_files: optional per-example weights, one file per shard.
          **kwargs: the keyword arguments of the class.
        """

        def load(files):
            files = [files] if isinstance(files, str) else list(files)
            return [np.load(f, mmap_mode="r") for f in files]

        weights = None if sample_weight_files is None else load(sample_weight_files)
        return cls(ArrayShards(load(x_files), load(y_files), weights), **kwargs)

    @classmethod
    def from_dataset(
        cls, dataset: tf.data.Dataset, *, num_examples: Optional[int] = None, chunk_size: int = 1024, **kwargs: Any
    ) -> "StreamingPoissonLots":
        """Lots streamed from a finite *unbatched* ``tf.data.Dataset`` of ``(x, y)`` or ``(x, y, sample_weight)``
        examples (of fixed shapes), read once per pass of `lots_per_pass` lots, never held in memory.

        Args:
          dataset: the examples, in a deterministic number (N) per pass.
          num_examples: N; None for the dataset's cardinality, or, when that is unknown, N counted in one
            pass (announced). Every pass checks it.
          chunk_size: examples read at once.
          **kwargs: the keyword arguments of the class.

        Raises:
          ValueError: an infinite or empty dataset, `num_examples` other than a known cardinality, elements that
            are not ``(x, y[, sample_weight])`` of fixed shapes.
        """
        n = _num_examples(dataset, num_examples, "dataset")
        chunk_size = _validate.integer_at_least(1, chunk_size=chunk_size)
        return cls(Stream(dataset.batch(chunk_size), n, "dataset"), **kwargs)

    @classmethod
    def from_tfrecord(
        cls,
        files: Union[str, Sequence[str]],
        parse: Callable[[tf.Tensor], tuple],
        *,
        num_examples: Optional[int] = None,
        chunk_size: int = 1024,
        **kwargs: Any,
    ) -> "StreamingPoissonLots":
        """Lots streamed from TFRecord files, read in the order of `files`.

        Args:
          files: the TFRecord files (a str: one file).
          parse: a batch of records (a string tensor of shape [B]) to ``(x, y)`` or ``(x, y, sample_weight)``
            tensors of B rows each, traced by ``tf.data`` (e.g. over ``tf.io.parse_example``: one parse per
            chunk, much faster than one per record).
          num_examples: N, the records in all the files; None to count them once (announced).
          chunk_size: records read (and parsed) at once.
          **kwargs: the keyword arguments of the class.
        """
        files = [files] if isinstance(files, str) else list(files)
        if not files:
            raise ValueError("files must name at least 1 TFRecord file, got none")
        chunk_size = _validate.integer_at_least(1, chunk_size=chunk_size)
        records = tf.data.TFRecordDataset(files)
        n = _num_examples(records, num_examples, "the TFRecord files")
        # tf.data's vectorized map: one parse per chunk of records (tf.io.parse_example), not one per record.
        chunks = records.batch(chunk_size).map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return cls(Stream(chunks, n, "the TFRecord files"), **kwargs)

    @classmethod
    def from_tfds(
        cls, name: str, split: str, *, data_dir: Optional[str] = None, **kwargs: Any
    ) -> "StreamingPoissonLots":
        """Lots streamed from a prepared tensorflow-datasets split (``as_supervised``: ``(x, y)`` pairs); N is the
        split's size in the data set's metadata. Needs ``pip install tensorflow-datasets``; nothing is downloaded.

        Args:
          name: the data set's name (``"mnist"``).
          split: the split (``"train"``).
          data_dir: where it was prepared (tensorflow-datasets' default when None).
          **kwargs: the keyword arguments of :meth:`from_dataset` and of the class.
        """
        try:
            import tensorflow_datasets as tfds
        except ImportError as e:  # pragma: no cover - depends on the installation
            raise ImportError("from_tfds needs tensorflow-datasets: pip install tensorflow-datasets") from e
        builder = tfds.builder(name, data_dir=data_dir)
        dataset = builder.as_dataset(split=split, as_supervised=True, shuffle_files=False)
        n = int(builder.info.splits[split].num_examples)
        return cls.from_dataset(dataset, num_examples=n, **kwargs)

    # ------------------------------------------------------------- sampling
    @property
    def lots_per_pass(self) -> int:
        """K, the lots one pass over the data feeds (1 for random-access sources)."""
        return self._per_pass

    def element_spec(self) -> tuple:
        """The ``tf.data`` element spec (batch dimension None)."""
        return (*self._source.element_spec, tf.TensorSpec(shape=(None,), dtype=tf.float32))

    def _inputs(self) -> None:
        return None  # the rows stay on disk (keras_dpsgd.step._held_out cannot fingerprint them)

    def _numpy_batches(self, num_lots: Optional[int]) -> Iterator[tuple]:
        if self._source.random_access:
            for idx, real in self._index_parts(num_lots):
                yield self._source.padded_rows(idx, real)
            return
        drawn = 0
        while num_lots is None or drawn < num_lots:
            k = self._per_pass if num_lots is None else min(self._per_pass, num_lots - drawn)
            for x, y, w in self._source.lots([self._members() for _ in range(k)]):
                n = len(w)
                order = self._rng.permutation(n)  # the lot in random order, as PoissonLots gives it
                rows, weights = self._padded(n, tf.nest.map_structure(lambda a: a[order], (x, y)), w[order], 0)
                for (px, py), pw, _ in self._parts(n, rows, weights):
                    yield px, py, pw
            drawn += k

    def _index_parts(self, num_lots: Optional[int]) -> Iterator[tuple]:
        """Random access: per physical batch, the indices of its examples (padded with 0) and how many are real."""
        for idx, _, real in self._index_batches(num_lots):
            yield np.where(np.arange(len(idx)) < real, idx, 0), real

    def _dataset(self, num_lots: Optional[int]) -> tf.data.Dataset:
        spec = self.element_spec()
        if not self._source.random_access:
            batches = tf.data.Dataset.from_generator(lambda: self._numpy_batches(num_lots), output_signature=spec)
            return self._finished(batches, num_lots)
        # Only the indices are drawn in the generator; the rows are read by tf.data's parallel map.
        signature = (tf.TensorSpec((None,), tf.int64), tf.TensorSpec((), tf.int64))
        indices = tf.data.Dataset.from_generator(lambda: self._index_parts(num_lots), output_signature=signature)

        def read(idx, real):
            rows = tf.numpy_function(self._source.padded_rows, [idx, real], [s.dtype for s in spec], stateful=False)
            return tuple(tf.ensure_shape(r, s.shape) for r, s in zip(rows, spec))

        return self._finished(indices, num_lots, read)

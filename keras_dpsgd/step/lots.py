"""Poisson-sampled lots for ``model.fit``: the sampling the accountant assumes.

Poisson sampling versus shuffling
---------------------------------
The moments/RDP accountant of Abadi et al. (2016, Section 3.1) amplifies
privacy by sub-sampling: at every step each of the N examples enters the lot
*independently* with probability q = L/N, so the lot size is random
(Binomial(N, q), possibly 0) and whether one example was used says nothing
about the others. The usual Keras input pipeline instead shuffles the data and
cuts it into fixed-size batches of B examples: every example is used exactly
once per epoch, batches within an epoch are disjoint, and the batch size is
fixed. That is a different mechanism, and the Poisson ε reported for it is not
a proven bound (Chua et al. 2024, "How private are DP-SGD implementations?",
show real gaps). TF Privacy reports the Poisson ε for shuffled batches anyway;
here the honest path is the easy one: :class:`PoissonLots` draws real Poisson
lots, a ``fit`` on them records their rate, a ``fit`` on other data while the
optimizer holds a Poisson rate is refused (:mod:`keras_dpsgd.step.fed_data`),
and the ledger (:mod:`keras_dpsgd.ledger`) warns when, with no rate known, it has
to assume Poisson sampling for data it did not sample.

Fixed shapes
------------
A Poisson lot has a random size, so each lot is padded to a fixed physical size
with examples of ``sample_weight`` 0 (zeros, so finite). A weight-0 example has
per-example loss 0 and gradient 0: it adds nothing to the clipped sum, and the
optimizer divides the noised sum by the *expected* lot size L (Abadi et al.
2016, Algorithm 1, with the normalization of their Section 3.1), never by the
padded or the realized size. The padded size (``max_lot_size``) is the
Binomial(N, q) quantile with tail probability ``overflow_probability``
(default 1e-9, about mean + 6 standard deviations). A lot larger than that
(an overflow) is never truncated: it is emitted in a bigger bucket (the next
multiple of the physical batch size) and counted in
:attr:`PoissonLots.overflow_count`. The dataset's batch dimension is ``None``,
so Keras traces ``train_step`` once whatever the size (an XLA-compiled step
compiles once more for an overflow bucket). Large lots can be split into
``gradient_accumulation_steps`` physical batches of ``physical_batch_size``
rows each (use the same number in the optimizer's
``gradient_accumulation_steps``).

What the timing reveals
-----------------------
Padded to the capacity, every step computes on the same number of rows
whatever the lot's size, so the step's time and shapes say nothing about
it (except in an overflow, probability ``overflow_probability`` per lot).
That padding costs: about 6√L rows over L (L = 64: 117 rows, 1.8 times the
rows of a non-private batch of L; L = 256: 1.4 times; ``benchmarks/padding.py``).
``pad_to_multiple_of=m`` pads each lot only to the next multiple of m rows
instead (about m/2 rows of padding): cheaper, but then the batch's size,
and with it the step's time, reveals the lot's size to within m to anyone
who sees the shapes or the timing of the steps. The lot's size depends on
whether an example was sampled, so that is a release the ε does not count:
the ε covers what the training releases (the noised updates, the model,
its checkpoints and logs), not a side channel of the machine it runs on.
Use it where nobody outside the training sees its step times or batch
shapes (a machine of your own, timings not published); keep the default
otherwise. Under JAX (or ``jit_compile=True``) each distinct size compiles
the step once more (about 12√L/m sizes within 6 standard deviations).

Memory
------
The DP step's peak memory follows the rows it computes on: padded to the
capacity (about L + 6√L rows: 69 at L = 32), a lot costs about as much memory
as a non-private step on that many rows (``benchmarks/memory.py``: 1.55x the
peak of a non-private step on L rows for a small BERT and a small Llama with
LoRA; the DP step on L rows: 1.12x and 1.14x). To bound it by a step on at most L rows while keeping
constant shapes, split each lot into k = ceil(R / L) physical batches of
ceil(R / k) rows (R = ``max_lot_size`` of the default sampler), accumulated by
the optimizer and released once::

    R = PoissonLots(x, y, expected_lot_size=L).max_lot_size
    k = math.ceil(R / L)
    lots = PoissonLots(x, y, expected_lot_size=L, physical_batch_size=math.ceil(R / k))
    optimizer = DPSGDOptimizer(..., gradient_accumulation_steps=lots.gradient_accumulation_steps)

(measured 1.08x and 1.18x; the same rows, k calls per lot instead of one).

Secrecy of the sampling
-----------------------
Amplification by sub-sampling holds only while the lots stay secret. With
``seed=None`` (the default) the generator draws its seed from the operating
system. A fixed ``seed`` is for tests and reproducible experiments; anyone who
knows it knows every lot, which voids the amplification.

Several workers
---------------
Under ``tf.distribute.MultiWorkerMirroredStrategy`` each of W workers samples its own shard:
``PoissonLots(x, y, ..., num_workers=W, worker_index=w)`` owns the examples
``{i : i % W == w}`` and puts each of them in the lot with the same q, independently. The union
of the W workers' lots is then a Poisson(q) lot of the whole data set, the lot the accountant
assumes (every example independently with probability q). Every worker pads to the same
physical size (the capacity rule above applied to the largest shard, ``ceil(N/W)`` examples,
rounded up to a multiple of ``replicas_per_worker`` so that the worker's replicas get equal
parts), and the optimizer still divides by the global L = qN (``expected_lot_size``). The
dataset turns ``tf.data`` auto-sharding off: each worker already holds its shard, and
auto-sharding would drop some of its lots. Each worker's sampling is independent and secret:
with ``seed=None`` each draws from its own OS entropy; a fixed seed is combined with the
worker index (and known to whoever knows the seed).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Iterator, Optional

import keras
import numpy as np
import tensorflow as tf
from scipy import stats

from keras_dpsgd import _validate, ledger
from keras_dpsgd.accounting.planning import lots_per_epoch

__all__ = ["PoissonLots"]

_LOG = logging.getLogger("keras_dpsgd")


def _leaves(structure: Any) -> list:
    return tf.nest.flatten(structure)


def _as_numpy_structure(structure: Any, name: str) -> Any:
    if structure is None:
        raise ValueError(f"{name} must be an array or a nested structure of arrays, got None")
    return tf.nest.map_structure(np.asarray, structure)


def _lot_capacity(num_examples: int, sampling_rate: float, overflow_probability: float) -> int:
    """Smallest k with P(Binomial(N, q) > k) <= overflow_probability."""
    if sampling_rate >= 1.0:
        return num_examples
    k = int(stats.binom.isf(overflow_probability, num_examples, sampling_rate))
    return int(min(num_examples, max(1, k)))


def _check_num_lots(num_lots: Optional[int]) -> None:
    if num_lots is not None:
        _validate.integer_at_least(0, num_lots=num_lots)


class PoissonLots:
    """Lots drawn by Poisson sampling, as a ``tf.data.Dataset`` (or a Keras 3 ``PyDataset``) for ``fit``.

    Every step draws a fresh, independent Poisson sample of the examples: each
    example is in the lot with probability q, independently of the other
    examples and of the other steps (Abadi et al. 2016, Algorithm 1, "Take a
    random sample L_t with sampling probability L/N"). Lots may be empty; no
    example is repeated within a lot; none is dropped (see the module
    docstring on overflow).

    Usage::

        lots = PoissonLots(x_train, y_train, expected_lot_size=256)
        optimizer = DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                   gradient_accumulation_steps=lots.gradient_accumulation_steps)
        lots.configure(optimizer)  # sets expected_lot_size = qN and sampling_rate = q
        model.compile(optimizer=optimizer, loss=...)
        model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=...)
        # or, one pass of lots_per_epoch fresh lots per epoch:
        model.fit(lots.dataset(lots.lots_per_epoch), epochs=...)

    ``fit(lots.dataset())`` without ``steps_per_epoch`` is refused by Keras
    before training: the default dataset is endless (see :meth:`dataset`).

    The same dataset feeds a tf_keras model and a Keras 3 model made private
    with :func:`keras_dpsgd.keras3.make_private` (split lots too: give the
    DP optimizer ``gradient_accumulation_steps=lots.gradient_accumulation_steps``).
    :meth:`as_py_dataset` gives the lots as a ``keras.utils.PyDataset``.

    The dataset yields ``(x, y, sample_weight)`` physical batches whose batch
    dimension is ``None`` in the element spec (so ``train_step`` is traced
    once); padded rows are zeros with ``sample_weight`` 0.

    Args:
      x: inputs, an array or a nested structure (dict/list/tuple) of arrays
        sharing the first dimension N.
      y: targets, same convention as `x`.
      sampling_rate: q in (0, 1]. Exactly one of `sampling_rate` and
        `expected_lot_size` must be given.
      expected_lot_size: L = qN, in (0, N].
      sample_weight: optional per-example weights of shape (N,), >= 0, passed
        through for the sampled examples (padding gets weight 0).
      physical_batch_size: rows per physical batch; None for one physical
        batch per lot (of `max_lot_size` rows). Otherwise each lot is split
        into `gradient_accumulation_steps` = ceil(capacity / physical_batch_size)
        physical batches.
      max_lot_size: the lot capacity; None for the Binomial(N, q) quantile
        with tail `overflow_probability`.
      overflow_probability: per-step probability that a lot exceeds the
        default capacity, in (0, 1).
      pad_to_multiple_of: None (default) to pad every lot to the capacity
        (constant shapes and timing), or m >= 1 to pad each physical batch
        only to the next multiple of m rows (at least m): less padding, but
        the batch's size reveals the lot's size to within m (see "What the
        timing reveals"). One worker only; a multiple of
        `replicas_per_worker`.
      seed: None (default: entropy from the operating system) or an integer
        for reproducible sampling (see "Secrecy of the sampling").
      num_workers: W >= 1 workers, each sampling its shard (see "Several
        workers" in the module docstring); 1: no sharding.
      worker_index: w in [0, W): this worker's shard, the examples i % W == w.
      replicas_per_worker: the replicas of this worker's strategy (its
        devices); the physical batch size is a multiple of it.

    Raises:
      ValueError: on invalid arguments (the message names the argument).
    """

    def __init__(
        self,
        x: Any,
        y: Any,
        *,
        sampling_rate: Optional[float] = None,
        expected_lot_size: Optional[float] = None,
        sample_weight: Any = None,
        physical_batch_size: Optional[int] = None,
        max_lot_size: Optional[int] = None,
        overflow_probability: float = 1e-9,
        pad_to_multiple_of: Optional[int] = None,
        seed: Optional[int] = None,
        num_workers: int = 1,
        worker_index: int = 0,
        replicas_per_worker: int = 1,
    ):
        self._x = _as_numpy_structure(x, "x")
        self._y = _as_numpy_structure(y, "y")
        sizes = {leaf.shape[0] if leaf.ndim else None for leaf in _leaves(self._x) + _leaves(self._y)}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                f"x and y must be arrays sharing their first dimension, got sizes {sorted(map(str, sizes))}"
            )
        n = int(sizes.pop())
        if n < 1:
            raise ValueError(f"x must hold at least 1 example, got {n}")
        if sample_weight is None:
            self._weights = None
        else:
            w = np.asarray(sample_weight, dtype=np.float32)
            if w.shape != (n,) or not np.all(np.isfinite(w)) or np.any(w < 0):
                raise ValueError(f"sample_weight must be finite, >= 0 and of shape ({n},), got shape {w.shape}")
            self._weights = w
        self._init_sampling(
            n,
            sampling_rate=sampling_rate,
            expected_lot_size=expected_lot_size,
            physical_batch_size=physical_batch_size,
            max_lot_size=max_lot_size,
            overflow_probability=overflow_probability,
            pad_to_multiple_of=pad_to_multiple_of,
            seed=seed,
            num_workers=num_workers,
            worker_index=worker_index,
            replicas_per_worker=replicas_per_worker,
        )

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
        if physical_batch_size is None:
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

    def lots(self, num_lots: Optional[int] = None) -> Iterator[tuple]:
        """Yields padded physical batches ``(x, y, sample_weight)`` as numpy arrays.

        Each lot yields `gradient_accumulation_steps` physical batches; real
        examples come first, then padding rows of zeros with weight 0.

        Args:
          num_lots: number of lots to draw; None for an endless stream.
        """
        _check_num_lots(num_lots)
        return self._numpy_batches(num_lots)

    def _numpy_batches(self, num_lots: Optional[int]) -> Iterator[tuple]:
        for idx, w, real in self._index_batches(num_lots):

            def take(a, idx=idx, real=real):
                out = np.zeros((len(idx),) + a.shape[1:], dtype=a.dtype)
                out[:real] = a[idx[:real]]
                return out

            yield tf.nest.map_structure(take, self._x), tf.nest.map_structure(take, self._y), w

    def _inputs(self) -> Any:
        """The inputs x of every example, in memory (:mod:`keras_dpsgd.step._held_out` fingerprints them)."""
        return self._x

    def element_spec(self) -> tuple:
        """The ``tf.data`` element spec (batch dimension None)."""

        def spec(a):
            return tf.TensorSpec(shape=(None,) + a.shape[1:], dtype=tf.as_dtype(a.dtype))

        return (
            tf.nest.map_structure(spec, self._x),
            tf.nest.map_structure(spec, self._y),
            tf.TensorSpec(shape=(None,), dtype=tf.float32),
        )

    def dataset(self, num_lots: Optional[int] = None) -> tf.data.Dataset:
        """A ``tf.data.Dataset`` of physical batches: endless, or `num_lots` lots long.

        Only the lot indices are drawn in Python; the examples are gathered by
        TensorFlow (the arrays are copied into tensors once). Every iteration
        of the dataset draws fresh lots (the sampler's generator continues).

        The cardinality is declared, so that Keras knows where an epoch ends:

        * ``num_lots=None`` (default): infinite. Pass ``steps_per_epoch``:
          ``fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=E)``.
          Without it Keras refuses the dataset before training (an endless
          stream has no epochs).
        * ``num_lots=k``: ``k * gradient_accumulation_steps`` physical batches.
          ``fit(lots.dataset(lots.lots_per_epoch), epochs=E)`` needs no
          ``steps_per_epoch``: each epoch is one pass of ``lots_per_epoch``
          fresh lots.

        Args:
          num_lots: number of lots per pass; None for an endless stream.

        Raises:
          ValueError: with `num_workers` > 1 (use :meth:`distribute`: the strategy's own
            splitting would spread one worker's lot over several steps).
        """
        _check_num_lots(num_lots)
        self._refuse_shards("dataset")
        data = self._dataset(num_lots)
        # The dataset names its lots: fit of a private Keras 3 model takes shuffle=False (nothing to
        # shuffle), every DP fit records the rate of these lots (keras_dpsgd.step.fed_data), and the
        # callback guard reads their rows (validation data must not hold them: keras_dpsgd.step._held_out).
        setattr(data, _LOTS_ATTR, self)
        return data

    def _refuse_shards(self, method: str) -> None:
        if self.num_workers > 1:
            raise ValueError(
                f"lots.{method}() with num_workers={self.num_workers}: under MultiWorkerMirroredStrategy the strategy "
                "would cut each worker's lot into as many parts as there are replicas in all and spread it over "
                "several steps, so a step would no longer be one Poisson lot; use fit(lots.distribute(strategy))"
            )

    def _dataset(self, num_lots: Optional[int]) -> tf.data.Dataset:
        def with_zero_row(a):  # row N: the (finite) padding example
            return tf.convert_to_tensor(np.concatenate([a, np.zeros((1,) + a.shape[1:], a.dtype)]))

        x = tf.nest.map_structure(with_zero_row, self._x)
        y = tf.nest.map_structure(with_zero_row, self._y)
        signature = (
            tf.TensorSpec(shape=(None,), dtype=tf.int64),
            tf.TensorSpec(shape=(None,), dtype=tf.float32),
            tf.TensorSpec(shape=(), dtype=tf.int64),
        )

        def gather(idx, w, real):
            del real  # padding rows point at the zero row
            return (
                tf.nest.map_structure(lambda a: tf.gather(a, idx), x),
                tf.nest.map_structure(lambda a: tf.gather(a, idx), y),
                w,
            )

        indices = tf.data.Dataset.from_generator(lambda: self._index_batches(num_lots), output_signature=signature)
        return self._finished(indices, num_lots, gather)

    def _finished(self, batches: tf.data.Dataset, num_lots: Optional[int], fn: Any = None) -> tf.data.Dataset:
        """`batches` (one element per physical batch, mapped by `fn`) with their cardinality, unsharded, prefetched."""
        size = tf.data.INFINITE_CARDINALITY if num_lots is None else int(num_lots) * self._accum
        batches = batches.apply(tf.data.experimental.assert_cardinality(size))
        if fn is not None:
            batches = batches.map(fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        options = tf.data.Options()
        # Each worker samples its own shard (or, with W = 1, the one worker is the whole lot):
        # tf.distribute's auto-sharding would drop lots.
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        return batches.with_options(options).prefetch(tf.data.AUTOTUNE)

    def distribute(self, strategy: tf.distribute.Strategy, num_lots: Optional[int] = None) -> Any:
        """The lots for ``fit`` under a ``tf.distribute`` strategy: this worker's lot, in equal parts.

        Each physical batch of :meth:`dataset` (this worker's shard lot, padded) is cut into one
        part per local replica (``strategy.distribute_datasets_from_function``), so one step of
        the strategy is one physical batch of every worker: the union over the workers is one
        Poisson lot of the whole set. Needed with several workers (MultiWorkerMirroredStrategy:
        ``strategy.experimental_distribute_dataset`` would split each worker's batch into
        R = all replicas' parts, spreading one lot over several steps); with one worker, the same
        as ``fit(lots.dataset())``.

        Args:
          strategy: the strategy of the model and its optimizer.
          num_lots: lots per pass; None for an endless stream.

        Raises:
          ValueError: the strategy's workers are not `num_workers`, or its local replicas do not
            divide the physical batch size (pass ``replicas_per_worker``).
        """
        _check_num_lots(num_lots)
        _check_workers(self.num_workers, strategy)
        local = strategy.num_replicas_in_sync // self.num_workers
        if self._physical % local:
            raise ValueError(
                f"the physical batch size {self._physical} must be a multiple of the worker's {local} replicas: "
                f"build PoissonLots(..., replicas_per_worker={local})"
            )

        def parts(*batch):  # [rows, ...] -> [local, rows / local, ...]: one element per replica
            return tf.data.Dataset.from_tensor_slices(
                tf.nest.map_structure(lambda a: tf.reshape(a, tf.concat([[local, -1], tf.shape(a)[1:]], 0)), batch)
            )

        def per_worker(context: tf.distribute.InputContext) -> tf.data.Dataset:
            del context  # This worker's shard is fixed by worker_index.
            batches = self._dataset(num_lots).flat_map(parts)
            if num_lots is not None:
                batches = batches.apply(tf.data.experimental.assert_cardinality(int(num_lots) * self._accum * local))
            return batches.prefetch(tf.data.AUTOTUNE)

        distributed = strategy.distribute_datasets_from_function(per_worker)
        setattr(distributed, _LOTS_ATTR, self)  # the rate fit records (keras_dpsgd.step.fed_data)
        return distributed

    def as_py_dataset(self, num_lots: Optional[int] = None) -> "PoissonLotsPyDataset":
        """The lots as a Keras 3 ``keras.utils.PyDataset``: endless, or `num_lots` lots per epoch.

        Same batches as :meth:`dataset` (padded with zero rows of weight 0, the
        batch dimension free), drawn in Python: ``fit(lots.as_py_dataset(
        lots.lots_per_epoch), epochs=E)``. See :class:`PoissonLotsPyDataset`.

        Raises:
          ValueError: if a lot is split into several physical batches
            (`physical_batch_size`): Keras reads two batches ahead to learn
            their shapes and does not train on them, so the physical batches
            would no longer line up with the lots (use :meth:`dataset`).
        """
        _check_num_lots(num_lots)
        self._refuse_shards("as_py_dataset")
        if self._accum != 1:
            raise ValueError(
                f"as_py_dataset needs one physical batch per lot, got gradient_accumulation_steps={self._accum} "
                f"(physical_batch_size={self._physical}): Keras reads batches ahead to learn their shapes "
                "and skips them, so the physical batches would straddle two lots; use lots.dataset() (it "
                "accumulates exactly), or leave physical_batch_size None"
            )
        return PoissonLotsPyDataset(self, num_lots)

    def configure(self, optimizer: Any) -> Any:
        """Tells a DP optimizer how its lots are drawn; returns it.

        Sets ``optimizer.expected_lot_size = qN`` (the normalizer of the noised
        sum) and ``optimizer.sampling_rate = q`` (for the accountant).

        Raises:
          ValueError: if the optimizer's gradient_accumulation_steps differs
            from this sampler's, or the optimizer's strategy has another number
            of workers than `num_workers`.
        """
        _check_workers(self.num_workers, getattr(optimizer, "_distribution_strategy", None))
        accum = ledger.accumulation_steps(optimizer)
        if accum != self._accum:
            raise ValueError(
                f"optimizer.gradient_accumulation_steps must be {self._accum} (physical batches per "
                f"lot of this PoissonLots), got {accum}"
            )
        optimizer.expected_lot_size = self.expected_lot_size
        optimizer.sampling_rate = self._q
        return optimizer

    @classmethod
    def from_dataset(cls, dataset: tf.data.Dataset, **kwargs) -> "PoissonLots":
        """Builds Poisson lots from an *unbatched* finite ``tf.data.Dataset``.

        Poisson sampling needs random access to every example, so the dataset
        (elements ``(x, y)`` or ``(x, y, sample_weight)``, one example each) is
        read once into memory. Its size N is counted while reading.

        Args:
          dataset: a finite dataset of single examples.
          **kwargs: the keyword arguments of :class:`PoissonLots`.

        Raises:
          ValueError: if the dataset is infinite or its elements are not
            ``(x, y)`` / ``(x, y, sample_weight)`` tuples.
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
        stacked = [tf.nest.map_structure(lambda *a: np.stack(a), *col) for col in columns]
        if len(stacked) == 3:
            if "sample_weight" in kwargs:
                raise ValueError("sample_weight given twice: in the dataset and as an argument")
            kwargs["sample_weight"] = stacked[2]
        return cls(stacked[0], stacked[1], **kwargs)


_LOTS_ATTR = "_keras_dpsgd_poisson_lots"


def lots_of(data: Any) -> Optional[PoissonLots]:
    """The :class:`PoissonLots` whose :meth:`~PoissonLots.dataset`, :meth:`~PoissonLots.as_py_dataset` or
    :meth:`~PoissonLots.distribute` made `data` (that object itself, not one derived from it by
    ``map``, ``batch``...), else None."""
    if isinstance(data, PoissonLotsPyDataset):
        return data._lots
    lots = getattr(data, _LOTS_ATTR, None)
    return lots if isinstance(lots, PoissonLots) else None


def is_lots_dataset(data: Any) -> bool:
    """True for a dataset made by :meth:`PoissonLots.dataset` or :meth:`PoissonLots.as_py_dataset`
    (lots are independent draws: fit's ``shuffle`` means nothing for them)."""
    return lots_of(data) is not None


def strategy_workers(strategy: Any) -> int:
    """The workers of a ``tf.distribute`` strategy (1 for one machine)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 1
    spec = resolver.cluster_spec().as_dict()
    return max(1, len(spec.get("worker", [])) + len(spec.get("chief", [])))


def _check_workers(num_workers: int, strategy: Any) -> None:
    """Refuses a sampler whose shards do not match the strategy's workers."""
    if strategy is None:
        return
    workers = strategy_workers(strategy)
    if workers != num_workers:
        raise ValueError(
            f"PoissonLots has num_workers={num_workers} but the optimizer's {type(strategy).__name__} runs "
            f"{workers} worker(s): each worker must sample its own shard (PoissonLots(..., "
            f"num_workers={workers}, worker_index=<this worker's index>)), so that the union of the workers' "
            "lots is one Poisson lot of the data set"
        )


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

    def __init__(self, lots: PoissonLots, num_lots: Optional[int] = None):
        super().__init__(workers=1, use_multiprocessing=False)
        _check_num_lots(num_lots)
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
            raise ValueError(
                f"workers must be 1 for Poisson lots, got {value!r}: several workers would draw lots out of "
                "order or, as processes, the same lots"
            )

    @property
    def use_multiprocessing(self) -> bool:
        return False

    @use_multiprocessing.setter
    def use_multiprocessing(self, value: bool) -> None:
        if value:
            raise ValueError(
                "use_multiprocessing must be False for Poisson lots, got True: each process would copy the "
                "sampler's generator and draw the same lots"
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

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
``gradient_accumulation_steps``; ``max_physical_batch_size`` picks them: see
"Memory").

What the timing reveals
-----------------------
Two paddings, one choice:

* ``pad_to_multiple_of=None`` (the default): every lot padded to the capacity
  R (about L + 6√L rows). Every step computes on the same number of rows
  whatever the lot's size, so the step's time and shapes say nothing about it
  (except in an overflow, probability ``overflow_probability`` per lot). It
  costs R/L in rows, falling as 6/√L: L = 64, 115 rows (1.8 times L); L = 256,
  354 rows (1.4 times). Measured, the DP step on a lot over the DP step on L
  rows (``benchmarks/padding.py``, quiet CPU): a small CNN 1.87 (L = 64) and
  1.48 (L = 256), an MLP 1.24 and 1.26.
* ``pad_to_multiple_of=m``: each lot padded to the next multiple of m rows
  (about m/2 rows of padding; m = ceil(√L): 67.6 rows on average at L = 64,
  264.4 at L = 256). Cheaper, but the batch's size, and with it the step's
  time, reveals the lot's size to within m to anyone who sees the shapes or
  the timing of the steps. The lot's size depends on whether an example was
  sampled, so that is a release the ε does not count: the ε covers what the
  training releases (the noised updates, the model, its checkpoints and logs),
  not a side channel of the machine it runs on. Use it where nobody outside
  the training sees its step times or batch shapes (a machine of your own,
  timings not published); keep the default otherwise. Under JAX (or
  ``jit_compile=True``) each distinct size compiles the step once more (about
  12√L/m sizes within 6 standard deviations); on CPU each new size builds its
  kernels once (oneDNN), so the first lots of a run cost more than the rest.

Either way the lots, the ledger and ε are the same, and the step is traced for
any batch size (the element spec's batch dimension is None): on CPU the DP step
traced so costs 3-16% more than one traced for exactly L rows, which is part
of what ``benchmarks/padding.py`` counts against the padding (its
``dynamic_batch_cost``). The host's work per lot
(drawing it, gathering and padding its rows in ``tf.data``) runs beside the
step: about 0.5 ms of CPU per lot at L = 64 (32x32x3 images) and L = 256
(784 features), the lot indices handed to ``tf.data`` a block of lots at a time.

Memory
------
The DP step's peak memory follows the rows one call computes on: padded to the
capacity R (about L + 6√L rows: 69 at L = 32), a lot costs about as much memory
as a non-private step on R rows (``benchmarks/memory.py``: 1.55x the peak of a
non-private step on L rows for a small BERT and a small Llama with LoRA; the DP
step on L rows: 1.12x and 1.14x). ``max_physical_batch_size=M`` bounds it by a
step on at most M rows, shapes still constant: each padded lot is cut into
k = ceil(R / M) physical batches of P = ceil(R / k) <= M rows (``physical_batch_size``
reads P, ``gradient_accumulation_steps`` reads k), their clipped sums accumulated
by the optimizer and released once, with one noise draw, divided by L::

    lots = PoissonLots(x, y, expected_lot_size=L, max_physical_batch_size=L)
    optimizer = DPSGDOptimizer(..., gradient_accumulation_steps=lots.gradient_accumulation_steps)

The same rows in all (k·P, less than k rows over R) in k calls per lot instead of
one (measured at L = 32, ``benchmarks/results/memory.json``: the DP step's peak
over non-private on 32 rows, BERT-base + LoRA 0.90x, ResNet50 frozen + head
1.09x, a Llama-style decoder + LoRA 0.91x); a lot of n examples fills its first batches (real rows first) and the rest
is padding, so some of the k batches may be all padding. The split reveals
nothing: k and P are functions of N, q, M and ``overflow_probability`` (of no
example), every lot has k batches of P rows, so the shapes, the number of calls
and their timing are those of every other lot, as without the split (an overflow
excepted: its batches are bigger, probability ``overflow_probability`` per lot;
with ``pad_to_multiple_of`` m each batch holds the next multiple of m above
ceil(n / k) rows instead, which reveals what that padding reveals, and exceeds M
only where m does not divide M). ``physical_batch_size=P`` instead fixes P
itself (k = ceil(R / P), k·P rows: up to P - 1 more). A partial lot (a ``fit``
that ends inside one) is never released: see ``gradient_accumulation_steps``.

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

The code: the sampling and padding over N examples (``_poisson.PoissonSampling``), how lots reach ``fit``
(``_lot_feeds``: the datasets' mark, the ``PyDataset``), and here :class:`PoissonLots`, its rows in memory and its
``tf.data`` pipelines; the rows on disk or in a stream: :mod:`keras_dpsgd.step.streaming`.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np
import tensorflow as tf

from keras_dpsgd.step._lot_feeds import LOTS_ATTR as _LOTS_ATTR
from keras_dpsgd.step._lot_feeds import PoissonLotsPyDataset, read_examples
from keras_dpsgd.step._lot_feeds import is_lots_dataset, lots_of  # noqa: F401 (the package reads them here)
from keras_dpsgd.step._poisson import PoissonSampling, check_num_lots, check_workers
from keras_dpsgd.step._poisson import strategy_workers  # noqa: F401 (the package reads it here)
from keras_dpsgd.dp.refusals import refuse

__all__ = ["PoissonLots"]


def _leaves(structure: Any) -> list:
    return tf.nest.flatten(structure)


def _as_numpy_structure(structure: Any, name: str) -> Any:
    if structure is None:
        raise ValueError(f"{name} must be an array or a nested structure of arrays, got None")
    return tf.nest.map_structure(np.asarray, structure)


class PoissonLots(PoissonSampling):
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
      max_physical_batch_size: M, the most rows a physical batch may hold (a bound on the step's memory;
        exclusive with `physical_batch_size`): each lot, padded to the capacity R, is split into
        `gradient_accumulation_steps` k = ceil(R / M) physical batches of ceil(R / k) <= M rows each (a
        multiple of `replicas_per_worker`), their clipped sums accumulated by the optimizer and released
        once (see "Memory" in the module docstring). None: see `physical_batch_size`.
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
        max_physical_batch_size: Optional[int] = None,
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
            max_physical_batch_size=max_physical_batch_size,
            max_lot_size=max_lot_size,
            overflow_probability=overflow_probability,
            pad_to_multiple_of=pad_to_multiple_of,
            seed=seed,
            num_workers=num_workers,
            worker_index=worker_index,
            replicas_per_worker=replicas_per_worker,
        )

    def lots(self, num_lots: Optional[int] = None) -> Iterator[tuple]:
        """Yields padded physical batches ``(x, y, sample_weight)`` as numpy arrays.

        Each lot yields `gradient_accumulation_steps` physical batches; real
        examples come first, then padding rows of zeros with weight 0.

        Args:
          num_lots: number of lots to draw; None for an endless stream.
        """
        check_num_lots(num_lots)
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
        check_num_lots(num_lots)
        self._refuse_shards("dataset")
        data = self._dataset(num_lots)
        # The dataset names its lots: fit of a private Keras 3 model takes shuffle=False (nothing to
        # shuffle), every DP fit records the rate of these lots (keras_dpsgd.step.fed_data), and the
        # callback guard reads their rows (validation data must not hold them: keras_dpsgd.step._held_out).
        setattr(data, _LOTS_ATTR, self)
        return data

    def _refuse_shards(self, method: str) -> None:
        if self.num_workers > 1:
            raise refuse(
                "lots-sharded-dataset",
                f"lots.{method}() with num_workers={self.num_workers}: under MultiWorkerMirroredStrategy the strategy "
                "would cut each worker's lot into as many parts as there are replicas in all and spread it over "
                "several steps, so a step would no longer be one Poisson lot; use fit(lots.distribute(strategy))",
            )

    def _dataset(self, num_lots: Optional[int]) -> tf.data.Dataset:
        # One tensor copy of the rows (no concatenated zero row: that would hold a third copy of the data set
        # while it is made, which the process's peak memory keeps).
        x = tf.nest.map_structure(tf.convert_to_tensor, self._x)
        y = tf.nest.map_structure(tf.convert_to_tensor, self._y)

        def gather(idx, w, real):
            # The real rows come first (padding rows, index N, after them): gather those, then pad with zeros (the
            # finite padding example). One copy of the batch, where gathering every row and masking the padding
            # took three (benchmarks/padding.py).
            padding = tf.shape(idx, out_type=tf.int64)[0] - real

            def take(a):
                rows = tf.gather(a, idx[:real])
                return tf.pad(
                    rows, [[0, padding]] + [[0, 0]] * (a.shape.rank - 1), constant_values=tf.zeros([], a.dtype)
                )

            return tf.nest.map_structure(take, x), tf.nest.map_structure(take, y), w

        indices = self._index_dataset(num_lots)
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
        check_num_lots(num_lots)
        check_workers(self.num_workers, strategy)
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
        check_num_lots(num_lots)
        self._refuse_shards("as_py_dataset")
        if self._accum != 1:
            raise refuse(
                "lots-physical-batches",
                f"as_py_dataset needs one physical batch per lot, got gradient_accumulation_steps={self._accum} "
                f"(physical_batch_size={self._physical}): Keras reads batches ahead to learn their shapes "
                "and skips them, so the physical batches would straddle two lots; use lots.dataset() (it "
                "accumulates exactly), or leave physical_batch_size None",
            )
        return PoissonLotsPyDataset(self, num_lots)

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
        stacked = read_examples(dataset)
        if len(stacked) == 3:
            if "sample_weight" in kwargs:
                raise ValueError("sample_weight given twice: in the dataset and as an argument")
            kwargs["sample_weight"] = stacked[2]
        return cls(stacked[0], stacked[1], **kwargs)

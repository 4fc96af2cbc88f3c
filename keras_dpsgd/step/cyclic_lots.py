"""Cyclic Poisson lots: the participation pattern the accounting of BandMF assumes (TensorFlow side).

Choquette-Choo et al. 2023 (arXiv:2306.08153; the cyclic Poisson sampling of their amplification theorem, see
:mod:`keras_dpsgd.accounting.bandmf`): the N examples are split into b parts, and the lot of step t is a Poisson
sample of part t mod b: each of its examples enters independently with probability q. An example then takes part in
at most ⌈n/b⌉ of n steps, any two of them at least b steps apart, so one participation moves only its own block of
b rows of C G for a strategy C with b bands.

**The split is random and secret** (as JAX Privacy's ``PartitionType.INDEPENDENT``): each example's part is drawn
uniformly and independently from a key of the sampler (its seed, else OS entropy), never from its position. A split
by position (example i in part i mod b) is not private under add/remove adjacency: removing one example moves every
later example to another part, so a data set whose examples alternate between two kinds releases, at every step, the
other kind's gradients (the release of the neighbour differs by far more than one example). With independent parts,
the other examples' parts have the same law with or without any one example, and the amplification theorem holds
for every fixed part of that example. The key is saved in the BandMF optimizer (``bandmf_partition_key``, with its
noise history: both are secrets of the run, see ``docs/bandmf.md``), so a resumed run keeps each example's part:
:meth:`CyclicPoissonLots.follow` adopts the optimizer's key (or gives it this sampler's, before its first step).

The part of a lot is tied to the step it feeds, not to how many lots were drawn: the first lot of each iteration
of a dataset of these lots is drawn from the part of the optimizer's step count (``noised_steps``) read by
:meth:`CyclicPoissonLots.follow`, which ``configure`` and every DP ``fit`` call before the iteration starts (at the
start of ``fit`` and of every epoch, before Keras makes the epoch's iterator: ``keras_dpsgd.step.fed_data``), in
the main thread while no step runs. Lots prefetched and dropped at the end of a ``fit`` therefore never shift the
cycle. (The count is not read from the data pipeline's thread: a running step may have counted itself before its
lot is read.) Without an anchor the sampler continues its own count.

Everything else (padding to a static shape with rows of weight 0, overflow buckets, a fixed or OS seed) is
:class:`keras_dpsgd.PoissonLots`'s, with one physical batch per lot and one worker. The default capacity is the
Binomial(N, q/b) quantile: a lot's size over the random split and the sampling.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np

from keras_dpsgd import _validate
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.step._poisson import _lot_capacity
from keras_dpsgd.step.lots import PoissonLots

__all__ = ["CyclicPoissonLots"]


class CyclicPoissonLots(PoissonLots):
    """Lots for BandMF: step t samples, at rate q, the examples of part t mod b, parts drawn at random (module
    docstring).

    Usage (Keras 3)::

        lots = CyclicPoissonLots(x, y, bands=4, expected_lot_size=256)
        optimizer = keras_dpsgd.keras3.BandMFSGDOptimizer(1.0, sigma, strategy=strategy, learning_rate=0.1)
        lots.configure(optimizer)  # q, the expected lot size, and the cycle follows the optimizer's steps
        model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=...)

    Args:
      x: inputs (as :class:`keras_dpsgd.PoissonLots`).
      y: targets.
      bands: b >= 1, the parts (the strategy's bands); 1 gives :class:`PoissonLots`' lots.
      sampling_rate: q in (0, 1], the probability that an example of the step's part enters its lot.
      expected_lot_size: L = q·N/b (the mean over the parts), in (0, N/b]; exactly one of the two.
      sample_weight: optional per-example weights (as :class:`keras_dpsgd.PoissonLots`).
      max_lot_size: the lot capacity; None for the Binomial(N, q/b) quantile with tail `overflow_probability`.
      overflow_probability: per-step probability that a lot exceeds the default capacity, in (0, 1).
      seed: None (OS entropy) or an integer (reproducible; whoever knows it knows every lot and the split).

    Raises:
      ValueError: on invalid arguments (the message names the argument), `bands` > N.
    """

    def __init__(
        self,
        x: Any,
        y: Any,
        *,
        bands: int,
        sampling_rate: Optional[float] = None,
        expected_lot_size: Optional[float] = None,
        sample_weight: Any = None,
        max_lot_size: Optional[int] = None,
        overflow_probability: float = 1e-9,
        seed: Optional[int] = None,
    ):
        super().__init__(x, y, sampling_rate=1.0, sample_weight=sample_weight, seed=seed)  # checks x, y, weights
        n = self._n
        b = _validate.integer_in_range(1, n, bands=bands)
        if (sampling_rate is None) == (expected_lot_size is None):
            raise ValueError(
                "exactly one of sampling_rate and expected_lot_size must be given, got "
                f"sampling_rate={sampling_rate!r}, expected_lot_size={expected_lot_size!r}"
            )
        if sampling_rate is not None:
            q = _validate.in_range(0, 1, "(]", sampling_rate=sampling_rate)
        else:
            q = _validate.in_range(0, n / b, "(]", expected_lot_size=expected_lot_size) * b / n
        overflow_probability = _validate.in_range(0, 1, "()", overflow_probability=overflow_probability)
        if max_lot_size is None:
            capacity = _lot_capacity(n, q / b, overflow_probability)
        else:
            capacity = _validate.integer_in_range(1, n, max_lot_size=max_lot_size)
        self._q, self._bands = q, b
        self._key: tuple = ()
        self._part_of = np.zeros(n, dtype=np.int64)
        if b > 1:  # b = 1 draws nothing here: its lots are PoissonLots' own, draw for draw
            self._set_key(tuple(int(k) for k in self._rng.integers(1, 2**31, size=2)))
        self._physical = self._capacity = capacity
        self._next_step = 0
        self._anchor: Optional[int] = None  # the step the next iteration's first lot feeds (follow)
        self._unanchored_start: Optional[int] = None  # the first step of an iteration that began without an anchor

    @property
    def bands(self) -> int:
        """b, the number of parts: each example is in the lots of one step in b."""
        return self._bands

    @property
    def expected_lot_size(self) -> float:
        """L = q·N/b: the mean lot size over the parts, the optimizer's normalizer."""
        return self._q * self._n / self._bands

    @property
    def partition_key(self) -> tuple:
        """The split's key (two integers in [1, 2³¹); () for b = 1): a secret of the run, like its lots."""
        return self._key

    @property
    def parts(self) -> np.ndarray:
        """The part of each example (a copy): uniform on 0..b−1, independent across examples."""
        return self._part_of.copy()

    def _set_key(self, key: tuple) -> None:
        self._key = tuple(int(k) for k in key)
        self._part_of = np.random.default_rng(list(self._key)).integers(self._bands, size=self._n)

    def part(self, step: int) -> np.ndarray:
        """The indices of the examples the lot of `step` samples: those of part `step` mod b."""
        return np.flatnonzero(self._part_of == int(step) % self._bands)

    def sample_indices(self) -> np.ndarray:
        """Draws the lot of the next step: a Poisson(q) sample of its part, in random order."""
        members = self.part(self._next_step)
        self._next_step += 1
        return self._rng.permutation(members[self._rng.random(len(members)) < self._q])

    def _index_batches(self, num_lots: Optional[int]) -> Iterator[tuple]:
        if self._anchor is not None:  # the cycle follows the steps the optimizer took, not the lots drawn
            self._next_step, self._anchor, self._unanchored_start = self._anchor, None, None
        else:
            self._unanchored_start = self._next_step
        yield from super()._index_batches(num_lots)

    def as_py_dataset(self, num_lots: Optional[int] = None) -> Any:
        """Refused for b > 1: Keras reads a ``PyDataset`` ahead (lots drawn, not trained on), which would shift
        the cycle against the steps; use :meth:`dataset`."""
        self._refuse_out_of_step("as_py_dataset", "Keras reads a PyDataset's batches ahead without training on them")
        return super().as_py_dataset(num_lots)

    def distribute(self, strategy: Any, num_lots: Optional[int] = None) -> Any:
        """Refused for b > 1: BandMF runs on one device (its noise history is not split across replicas)."""
        self._refuse_out_of_step("distribute", "BandMF's noise history is not split across replicas")
        return super().distribute(strategy, num_lots)

    def _refuse_out_of_step(self, method: str, why: str) -> None:
        if self._bands > 1:
            raise refuse(
                "bandmf-participation",
                f"CyclicPoissonLots(bands={self._bands}).{method}() is refused: {why}; use lots.dataset()",
            )

    def follow(self, optimizer: Any) -> None:
        """The next iteration's first lot feeds `optimizer`'s next step: its part is ``noised_steps`` mod b (read
        now; call it where no step runs, before the iteration starts). With a BandMF optimizer the split is the
        optimizer's: its ``bandmf_partition_key`` if set (a resumed run), else this sampler's, written there.

        Raises:
          ValueError: an iteration began without an anchor at another part than the optimizer's next step (a
            restored optimizer whose fit started drawing lots before ``configure``): its lots would break the cycle;
            or a BandMF optimizer that took steps without a split key (its parts are unknown).
        """
        position = int(optimizer.noised_steps.numpy())
        self._follow_split(optimizer, position)
        start = self._unanchored_start
        if start is not None and start % self._bands != position % self._bands:
            raise refuse(
                "bandmf-participation",
                f"CyclicPoissonLots began drawing lots at the part of step {start} but the optimizer's next step is "
                f"{position}: each example's steps would no longer be {self._bands} apart. Call "
                "lots.configure(optimizer) before fit (a restored optimizer too)",
            )
        self._anchor = position

    def _follow_split(self, optimizer: Any, position: int) -> None:
        variable = getattr(optimizer, "bandmf_partition_key", None)
        if variable is None or self._bands == 1:
            return
        key = tuple(int(k) for k in np.asarray(variable.numpy()).reshape(-1))
        if any(key):
            if key != self._key:
                self._set_key(key)  # the split the optimizer's earlier steps used
            return
        if position:
            raise refuse(
                "bandmf-participation",
                f"the BandMF optimizer took {position} steps on a split of the examples it did not record "
                "(bandmf_partition_key is unset): each example's next steps could fall less than "
                f"{self._bands} steps after its last; continue from the optimizer file that recorded its split",
            )
        variable.assign(np.asarray(self._key, dtype=np.int32))

    def configure(self, optimizer: Any) -> Any:
        """:meth:`PoissonLots.configure` (q and L), and the cycle follows `optimizer`'s steps; returns it.

        Raises:
          ValueError: the optimizer is a BandMF optimizer of another number of bands (its sensitivity needs
            participations at least its b steps apart), or :meth:`PoissonLots.configure`'s.
        """
        bands = getattr(optimizer, "bandmf_bands", None)
        if bands is not None and bands != self._bands:
            raise refuse(
                "bandmf-participation",
                f"CyclicPoissonLots(bands={self._bands}) cannot feed a BandMF optimizer of {bands} bands: its "
                f"sensitivity needs each example's steps at least {bands} apart; use bands={bands}",
            )
        super().configure(optimizer)
        self.follow(optimizer)
        return optimizer

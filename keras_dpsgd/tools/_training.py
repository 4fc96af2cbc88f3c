"""One training run for the memorization test: non-private or DP, with per-epoch accuracy."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from keras_dpsgd.tools import _stats


def _accuracy(model, x: np.ndarray, y: np.ndarray, batch: int = 1024) -> int:
    """Number of correct argmax predictions (inference mode)."""
    correct = 0
    for i in range(0, len(x), batch):
        logits = np.asarray(model(x[i : i + batch], training=False))
        correct += int(np.sum(np.argmax(logits, axis=-1) == y[i : i + batch]))
    return correct


@dataclasses.dataclass
class RunResult:
    """Per-epoch accuracies of one run.

    Attributes:
      name: "non-private" or "dp".
      train_accuracy: accuracy on the whole training set after each epoch
        (inference mode, not Keras' running average).
      train_lower_bound: one-sided Clopper–Pearson lower bound of each epoch's
        train accuracy at the report's confidence (pointwise per epoch).
      train_p_value: one-sided exact binomial p-value against chance per epoch.
      test_accuracy: accuracy on held-out data after each epoch (real-task mode).
      epsilon: ε of the run at the report's δ (None: not private / not on data).
      noise_multiplier: σ_eff of one noised step (DP run).
      noised_steps: number of noised steps (DP run).
    """

    name: str
    train_accuracy: list = dataclasses.field(default_factory=list)
    train_lower_bound: list = dataclasses.field(default_factory=list)
    train_p_value: list = dataclasses.field(default_factory=list)
    test_accuracy: list | None = None
    epsilon: float | None = None
    noise_multiplier: float | None = None
    noised_steps: int | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["epsilon"] is not None and math.isinf(d["epsilon"]):
            d["epsilon"] = "inf"
        return d


def train_run(
    name: str,
    build_model: Callable[[], Any],
    make_optimizer: Callable[[Any], Any],
    loss,
    train: tuple[np.ndarray, np.ndarray],
    *,
    epochs: int,
    batch_size: int,
    chance: float,
    confidence: float,
    rng: np.random.Generator,
    seeded: bool,
    poisson: bool,
    physical_batch_size: int | None = None,
    test: tuple[np.ndarray, np.ndarray] | None = None,
    callbacks: list | None = None,
    verbose: int = 0,
    front: Any = None,
) -> tuple[RunResult, Any]:
    """Trains a fresh model and records accuracy after each epoch.

    Args:
      make_optimizer: called with the run's `keras_dpsgd.step.lots.PoissonLots`
        (None for shuffled batches); returns the optimizer.
      poisson: feed Poisson-sampled lots of expected size `batch_size`
        (`PoissonLots`: the sampling the accountant assumes; DP runs), else
        shuffled batches of `batch_size`.
      physical_batch_size: Poisson runs only: rows per physical batch (lots
        are split into gradient-accumulation steps); None: one per lot.
      front: the Keras of the model (``keras_dpsgd.tools.front``); default the model's own.

    Returns:
      (RunResult, trained model, optimizer).
    """
    import time

    import tensorflow as tf

    from keras_dpsgd.ledger import is_dp_optimizer
    from keras_dpsgd.tools import front as _front

    x, y = train
    lots = None
    if poisson:
        from keras_dpsgd.step.lots import PoissonLots

        lots = PoissonLots(
            x,
            y,
            expected_lot_size=batch_size,
            physical_batch_size=physical_batch_size,
            seed=int(rng.integers(2**31 - 1)) if seeded else None,
        )
    optimizer = make_optimizer(lots)
    if lots is not None and hasattr(optimizer, "expected_lot_size"):
        lots.configure(optimizer)
    if seeded:  # the initial weights too: a seeded run is reproducible whatever ran before it
        _front.set_random_seed(int(rng.integers(2**31 - 1)))
    model = build_model()
    front = front or _front.of_model(model)
    if lots is not None and is_dp_optimizer(optimizer):
        model = front.private(model)  # Keras 3: the private train step; tf_keras: unchanged
    model.compile(optimizer=optimizer, loss=loss)
    keras = front.keras
    result = RunResult(name=name, test_accuracy=[] if test is not None else None)
    n = len(x)

    class _Track(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            c = _accuracy(self.model, x, y)
            result.train_accuracy.append(c / n)
            result.train_lower_bound.append(_stats.clopper_pearson_lower(c, n, confidence))
            result.train_p_value.append(_stats.binomial_p_value(c, n, chance))
            if test is not None:
                result.test_accuracy.append(_accuracy(self.model, *test) / len(test[0]))

    cbs = [_Track()] + list(callbacks or [])
    start = time.perf_counter()
    if lots is not None:
        model.fit(lots.dataset(), epochs=epochs, steps_per_epoch=lots.steps_per_epoch, callbacks=cbs, verbose=verbose)
    else:
        seed = int(rng.integers(2**31 - 1)) if seeded else None
        ds = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(n, seed=seed, reshuffle_each_iteration=True)
            .batch(batch_size)
            .prefetch(2)
        )
        model.fit(ds, epochs=epochs, callbacks=cbs, verbose=verbose)
    result.seconds = time.perf_counter() - start
    return result, model, optimizer

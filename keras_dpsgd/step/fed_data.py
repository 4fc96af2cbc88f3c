"""What a DP ``fit`` feeds its step, checked before the first step: the ledger records the lots that ran.

The accountant charges every step as a Poisson-sampled Gaussian mechanism at the optimizer's
``sampling_rate`` q (Abadi et al. 2016, Algorithm 1 and Section 3.1). A rate written on the
optimizer (by ``PoissonLots.configure``, ``make_private_with_epsilon``, its arguments, or a saved
model) is a claim about data the optimizer never sees; the data ``fit`` is fed is the fact. So at
the start of every ``fit`` of a DP optimizer, before any weight changes (whichever of these comes
first reaches :func:`check_fed_data`: ``make_train_function``, which ``fit`` calls before its first
step; the privacy callbacks' ``on_train_begin``; the trace of the step; every epoch start; the same
on Keras 3 with TensorFlow or JAX and on tf_keras):

* ``fit`` fed by :class:`keras_dpsgd.PoissonLots` (the object ``lots.dataset()``,
  ``lots.as_py_dataset()`` or ``lots.distribute()`` returned): the optimizer takes the rate and the
  expected lot size of *those* lots (``lots.configure(optimizer)``), with a warning when they differ
  from what it was told. The steps taken before keep their rate (the ledger closes them into a
  segment first); the new steps are recorded at the new q.
* anything else (arrays in fixed-size batches, a ``tf.data`` pipeline, a dataset derived from
  ``lots.dataset()`` by ``map`` or ``batch``, a generator, a ``PyDataset``) while the optimizer holds
  a Poisson rate: refused. Shuffled fixed-size batches are not the Poisson mechanism, and the
  Poisson ε at the claimed q is no proven bound for them (Chua et al. 2024). The one way past it
  is the explicit, warned statement :func:`keras_dpsgd.ledger.assume_poisson` (a sampler of the
  user's own), never saved with the model.
* anything else with no rate known (the optimizer was never configured): the documented fallback,
  q = B·k/N with a warning that this ε assumes Poisson sampling
  (:func:`keras_dpsgd.ledger.note_fit_sampling`).
* a call of the train step outside ``fit`` (``train_on_batch``, a custom training loop) with a rate
  known: refused, since nothing shows which data reach the step (a loop over ``lots.dataset()``
  says so with :func:`keras_dpsgd.ledger.assume_poisson`).
* a BandMF optimizer (``bandmf_bands`` b > 1, issue 42): only :class:`keras_dpsgd.CyclicPoissonLots` with
  ``bands=b`` fed to ``fit``, whose cycle then follows the optimizer's steps; anything else, ``assume_poisson``
  and steps outside ``fit`` included, is refused (its sensitivity needs each example's steps b apart).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import tensorflow as tf

from keras_dpsgd import ledger
from keras_dpsgd.step.cyclic_lots import CyclicPoissonLots
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.step.lots import PoissonLots, lots_of

__all__ = ["check_fed_data"]

_LOG = logging.getLogger("keras_dpsgd")

# The call named by the refusal where a model's train step runs with no fit (`check_fed_data(outside_fit=True)`).
_OUTSIDE_FIT = "train_on_batch (the train step called outside fit)"

_WAY_OUT = (
    "Feed fit the lots themselves: model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, "
    "epochs=...) with lots = keras_dpsgd.PoissonLots(x, y, expected_lot_size=...), or run.fit() after "
    "make_private_with_epsilon"
)


def _describe(frame: Any) -> str:
    """What the running fit is fed, in words."""
    x = frame.f_locals.get("x")
    if isinstance(x, tf.data.Dataset):
        return (
            "a tf.data.Dataset that PoissonLots.dataset() did not return (a dataset derived from it by map, "
            "batch, take... is not recognized either)"
        )
    n = ledger.fit_training_size(frame)
    if n is not None:
        batch = frame.f_locals.get("batch_size") or "the default 32"
        return f"arrays of {n} examples, shuffled into fixed-size batches (batch_size={batch})"
    return f"a {type(x).__name__} (data that keras_dpsgd did not sample)"


def _refuse(model: Any, refusal: ValueError) -> None:
    if model is not None:
        model.train_function = None  # a fit after the fix traces afresh (Keras 3 cannot retrace a failed trace)
    raise refusal


def _adopt(model: Any, optimizer: Any, lots: PoissonLots) -> None:
    """The optimizer takes the rate and lot size of the lots fit is fed (the steps before keep theirs)."""
    told_q, told_lot = getattr(optimizer, "sampling_rate", None), getattr(optimizer, "expected_lot_size", None)
    if told_q == lots.sampling_rate:
        return  # the rate is right (a normalizer set apart from it is post-processing: kept)
    if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
        _refuse(
            model,
            refuse(
                "lots-rate-under-strategy",
                f"fit is fed PoissonLots with q = {lots.sampling_rate:.6g} but the optimizer was told q = {told_q}: "
                "under a tf.distribute strategy the optimizer must be configured for these lots before fit: call "
                "lots.configure(optimizer) first",
            ),
        )
    if model is not None:
        ledger.attach(model, optimizer)  # the steps so far, at the rate they ran with
    with tf.init_scope():
        lots.configure(optimizer)  # refuses lots with another gradient_accumulation_steps
    if model is not None:
        ledger.attach(model, optimizer)  # the next steps at the lots' rate: a new segment now, not at the next read
    if told_q is not None and not math.isclose(told_q, lots.sampling_rate, rel_tol=1e-9):
        _LOG.warning(
            "keras_dpsgd: the optimizer was told q = %.6g (expected lot size %s), but fit is fed PoissonLots with "
            "q = %.6g (expected lot size %.6g): the ledger records the rate of the lots that run from now on (the "
            "steps taken before keep theirs), and the noised sum is divided by the new expected lot size.",
            told_q,
            f"{told_lot:.6g}" if told_lot is not None else "unknown",
            lots.sampling_rate,
            lots.expected_lot_size,
        )


def _unseen_data(model: Any, q: float) -> str:
    """The refusal of a step that runs outside fit (a custom loop where `model` is None) with a Poisson rate q."""
    subject = (
        "a custom training loop of a DP optimizer that"
        if model is None
        else f"{_OUTSIDE_FIT} of a DP model whose optimizer"
    )
    return (
        f"{subject} holds a Poisson sampling rate q = {q:.6g} is refused: keras_dpsgd cannot see which data reach "
        "the step outside fit, so the ledger could not record the rate of the lots that ran. "
        f"{_WAY_OUT}; or, if the steps are fed lots.dataset() (or a Poisson sampler of your own) at that rate, say "
        "so with keras_dpsgd.ledger.assume_poisson(optimizer)."
    )


def _bandmf_lots(model: Any, optimizer: Any, lots: Any, bands: int, fed: str) -> None:
    """A BandMF optimizer of b > 1 bands takes cyclic lots of b parts only, whose cycle then follows its steps."""
    if isinstance(lots, CyclicPoissonLots) and lots.bands == bands:
        with tf.init_scope():  # at trace time too: the count before this fit's first step
            lots.follow(optimizer)
        return
    _refuse(
        model,
        refuse(
            "bandmf-participation",
            f"{type(optimizer).__name__} has a strategy of {bands} bands: its sensitivity and its accounting need each "
            f"example's steps at least {bands} apart, which {fed} does not guarantee. Feed fit "
            f"keras_dpsgd.CyclicPoissonLots(x, y, bands={bands}, expected_lot_size=...).dataset() "
            "(lots.configure(optimizer) first); keras_dpsgd.ledger.assume_poisson does not apply to BandMF",
        ),
    )


def check_fed_data(model: Any, optimizer: Any, *, outside_fit: bool = False) -> None:
    """Checks the data `model`'s running fit feeds `optimizer`'s step (module docstring), before its first step.

    Args:
      model: the model whose step `optimizer` runs (None: a custom loop).
      optimizer: its optimizer (nothing is checked unless it is a DP optimizer).
      outside_fit: True where the caller may run the step with no fit running (``train_on_batch``, the
        trace of a custom loop's step): the step is then refused while the optimizer holds a Poisson rate.

    Raises:
      ValueError: fit is fed data other than Poisson lots while the optimizer holds a Poisson rate, the
        lots have another ``gradient_accumulation_steps`` than the optimizer, or (`outside_fit`) the step
        runs outside fit with a Poisson rate.
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # tf_keras's LossScaleOptimizer wraps it
    if not ledger.is_dp_optimizer(optimizer):
        return
    q = getattr(optimizer, "sampling_rate", None)
    bands = getattr(optimizer, "bandmf_bands", 1)
    frame = None if model is None else ledger.fit_frame(model)
    if frame is None:
        if outside_fit and bands > 1:
            _bandmf_lots(model, optimizer, None, bands, "a step outside fit (train_on_batch, a custom loop)")
        if outside_fit and q is not None and not ledger.assumes_poisson(optimizer):
            _refuse(model, refuse("step-outside-fit", _unseen_data(model, q)))
        return
    lots = lots_of(frame.f_locals.get("x"))
    if bands > 1:
        _bandmf_lots(model, optimizer, lots, bands, "PoissonLots" if lots is not None else _describe(frame))
    if lots is not None:
        _adopt(model, optimizer, lots)
        return
    if q is not None and not ledger.assumes_poisson(optimizer):
        _refuse(
            model,
            refuse(
                "fit-not-on-lots",
                f"fit of a DP model on {_describe(frame)} is refused: the optimizer holds the Poisson sampling rate "
                f"q = {q:.6g} (set by PoissonLots.configure, make_private_with_epsilon, its sampling_rate argument or "
                "a saved model), and these batches are not Poisson lots drawn at that rate: epsilon at q would be no "
                f"proven bound for them (shuffled fixed-size batches are a different mechanism). {_WAY_OUT}. (For a "
                "sampler of your own, keras_dpsgd.ledger.assume_poisson(optimizer) states, unchecked, that its batches "
                "are Poisson lots at q.)",
            ),
        )
    ledger.note_fit_sampling(model, optimizer)  # no rate known: q = B·k/N, with its warning

"""The privacy ledger of a training run: every access to the data, resumable.

A model's ledger holds (1) the events of every layer that declares a
``privacy_events`` property (e.g. DP-PCA), found recursively through nested
models and layers, and (2) the DP-SGD steps of its optimizer, one
:class:`PoissonSampledGaussianEvent` per segment of constant (q, σ_eff)
(Abadi et al. 2016, Algorithm 1: each noised step is a sub-sampled Gaussian
mechanism with sampling ratio q and noise multiplier σ).

The state and its transitions are pure (:mod:`keras_dpsgd.dp.ledger_state`, one
schema, no TensorFlow); :mod:`keras_dpsgd.ledger._keras_io` does the I/O: the
string variables that hold the state, the optimizer's counter and worst-case
bounds, attaching to the model and saving. This module holds the public
queries (:func:`model_privacy_ledger`, :func:`model_epsilon`,
:func:`steps_remaining`) and re-exports what the other modules use.

The ledger is the model's. The DP step attaches it to the model it trains
when it is traced (no callback needed); every save brings it up to date
first, whatever the callback order; a model compiled again with a new DP
optimizer adds the new steps to the old ones.

Resuming. The step count is the optimizer's ``noised_steps`` variable; the
segments (runs of steps with one (q, σ)) live in a string variable of a small
``tf.Module`` attached to the optimizer and to the model (attribute
``_dpsgd_ledger_state``; a checkpoint dependency, never one of the model's
weights). What each way of saving keeps:

* ``tf.train.Checkpoint``, ``model.save_weights(path)`` with a TF-format path
  (no ``.h5``), ``ModelCheckpoint(save_weights_only=True)`` to such a path,
  ``BackupAndRestore``: everything; resumed training continues ε exactly.
* SavedModel (``model.save(directory)``, ``ModelCheckpoint`` with full models
  to a directory): the model's copy of the ledger (steps and segments, as of
  the save). tf_keras does not restore the optimizer's variables, so
  ``noised_steps`` restarts at 0 and the new steps are added on top.
* ``.keras`` and full ``.h5`` models: the optimizer's variables, not the
  segments. Besides ``noised_steps`` the optimizer keeps, as variables, the
  worst case the ledger has charged so far: the largest q
  (``ledger_max_sampling_rate``) and the smallest σ_eff
  (``ledger_min_noise_multiplier``). After such a load every step taken so far
  is charged at (max q, min σ) over those and the current values, which never
  under-reports ε (the sub-sampled Gaussian's ε grows with q and shrinks with
  σ); a run that never changed (q, σ) gets exactly the ε of a checkpointed run.
  Where the ledger holds more than the optimizer's counter (steps of an
  earlier optimizer: compiled again, or loaded from a SavedModel) these saves
  are refused. For an exact ledger after changing q or σ, save with checkpoints.
* tf_keras h5 weights (``save_weights("w.h5")``, ``ModelCheckpoint("w.h5",
  save_weights_only=True)``): the layers' weights only, no ledger: refused
  (the callback at the start of ``fit``), since a run resumed from them
  would restart ε at 0.
* Keras 3 (``keras_dpsgd.keras3``): ``.keras`` files and ``.weights.h5``
  weights (``model.save``, ``save_weights``, ``ModelCheckpoint``,
  ``BackupAndRestore``) keep the optimizer's variables and its copy of the
  ledger (a Keras 3 holder saves its state through ``save_own_variables``),
  which also holds an earlier optimizer's steps (the model compiled again:
  the save attaches the ledger first): resumed training continues ε exactly.

Never saved: ``nonfinite_examples`` (an un-noised count over the private
data, a local diagnostic outside the ledger) and incomplete lots (discarded,
see :mod:`keras_dpsgd.tf_keras._sanitizer`).

A checkpoint restored before the state is attached is applied when it is
attached (deferred restoration). Steps taken after the last checkpoint of a
killed run are not in the restored ledger: their results died with the
process and are not part of the released model.

Changing q or σ during training is detected at each ledger read (every batch
with WithinLimit, every epoch with PrivacyLogger) and at every save. Steps taken between the last read under the old values
and the first read under the new ones cannot be attributed exactly; they are
recorded with the worst case of both (larger q, smaller σ), which never
under-reports ε (the sub-sampled Gaussian's ε grows with q and shrinks with σ).

Sampling. The accountant assumes Poisson sampling (:mod:`keras_dpsgd.step.lots`
explains the difference from shuffled fixed-size batches). The rate recorded is
that of the lots ``fit`` is fed (:mod:`keras_dpsgd.step.fed_data`: a fit on
``PoissonLots.dataset()`` sets the optimizer's rate to those lots'; other data
while the optimizer holds a rate are refused). When the optimizer knows no
sampling rate, q = batch_size · gradient_accumulation_steps / N is used and a
warning says, once, that this ε assumes Poisson sampling.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import tensorflow as tf

from keras_dpsgd import _validate
from keras_dpsgd._frames import fit_frame
from keras_dpsgd.ledger._keras_io import _FIT_SAMPLING_ATTR, _fit_sampling, _read_state
from keras_dpsgd.ledger._keras_io import (  # noqa: F401 (keras_dpsgd.ledger.X: what the other modules use)
    BOUND_VARIABLES,
    LedgerState,
    add_bound_variables,
    attach,
    discard_partial_lot,
    is_dp_optimizer,
    is_h5,
    is_keras3,
    ledger_state_holders,
    noised_steps,
    on_attach,
    note_sampling_rate_change,
    recorded_sampling_rate,
    recorded_releases,
    refresh_ledger_offset,
    refuse_h5_weights,
    refuse_lost_history,
    saving_model,
    step_noise_multipliers,
    sync_ledger_state,
)
from keras_dpsgd.dp import ledger_state as S
from keras_dpsgd.accounting import (
    DEFAULT_ORDERS,
    GaussianEvent,
    PoissonSampledComposedGaussianEvent,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    RdpAccountant,
    TuningEvent,
    check_delta,
    compute_epsilon,
    default_delta,
    event_from_dict,
    max_steps_within_budget,
)
from keras_dpsgd.accounting.tuning import rdp_trial
from keras_dpsgd.accounting.planning import DEFAULT_DELTA_RULE

__all__ = [
    "LedgerState",
    "accumulation_steps",
    "assume_poisson",
    "assumes_poisson",
    "attach",
    "check_trial",
    "fit_frame",
    "fit_training_size",
    "is_dp_optimizer",
    "layer_events",
    "ledger_state_holders",
    "model_epsilon",
    "model_privacy_ledger",
    "note_fit_sampling",
    "noised_steps",
    "optimizer_events",
    "record_search",
    "recorded_sampling_rate",
    "refuse_lost_history",
    "resolve_delta",
    "resolve_num_examples",
    "resolve_sampling_rate",
    "saving_model",
    "steps_remaining",
    "sync_ledger_state",
]


_LOG = logging.getLogger("keras_dpsgd")
_WARNED: set = set()
DPSGD_LABEL = S.DPSGD_LABEL


def _warn_once(key: Any, message: str, *args) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        _LOG.warning(message, *args)


def _int_arg(value: Any, name: str) -> Optional[int]:
    return None if value is None else _validate.integer_at_least(1, **{name: value})


def fit_training_size(frame: Any) -> Optional[int]:
    """N of a running fit's training data given as arrays (after ``validation_split``), or None.

    `frame`: the frame of ``fit`` (:func:`fit_frame`); fit has already split x, so its local x is
    the training part. None for a dataset, a generator or a PyDataset (no known size).
    """
    x = frame.f_locals.get("x") if frame is not None else None
    if x is None or isinstance(x, tf.data.Dataset):
        return None
    leaves = tf.nest.flatten(x)
    if not all(hasattr(leaf, "shape") for leaf in leaves):  # arrays, tensors, data frames
        return None
    shape = tuple(leaves[0].shape)
    return int(shape[0]) if shape and shape[0] is not None else None


# Keras fit's batch size when `batch_size` is None and the data are arrays (both Kerases).
_KERAS_DEFAULT_BATCH_SIZE = 32


def accumulation_steps(optimizer: Any) -> int:
    """The optimizer's gradient_accumulation_steps k (physical batches per lot; 1 if it has none)."""
    return int(getattr(optimizer, "gradient_accumulation_steps", 1) or 1)


def _warn_poisson_assumed(q: float, how: str) -> None:
    _warn_once(
        ("poisson-assumed", q),
        "keras_dpsgd: the optimizer's sampling_rate is unknown (no PoissonLots.configure), so epsilon is "
        "computed with q = %s = %g, which ASSUMES POISSON SAMPLING. Shuffled fixed-size batches (plain "
        "fit(x, y, batch_size=B)) are a different mechanism for which this epsilon is not a proven bound; "
        "train on keras_dpsgd.PoissonLots for an honest one.",
        how,
        q,
    )


_ASSUMED_ATTR = "_dpsgd_assume_poisson"


def assume_poisson(optimizer: Any) -> Any:
    """States, unchecked, that the data `optimizer`'s fits are fed are Poisson lots at its ``sampling_rate``.

    An opt-in, for data keras_dpsgd did not sample (a sampler of your own; arrays fed in fixed-size
    batches, which are *not* Poisson lots): without it, a fit of an optimizer that holds a sampling
    rate on anything but :class:`keras_dpsgd.PoissonLots` is refused (:mod:`keras_dpsgd.step.fed_data`).
    With it, ε is computed at q as if the batches were Poisson lots, which is no proven bound for
    shuffled fixed-size batches (Chua et al. 2024); a warning says so. The statement is not saved: a
    loaded optimizer is refused again until it is made again.

    Returns:
      `optimizer`.
    """
    if not is_dp_optimizer(optimizer):
        raise TypeError(f"optimizer must be a keras_dpsgd DP optimizer, got {type(optimizer).__name__}")
    setattr(optimizer, _ASSUMED_ATTR, True)
    _LOG.warning(
        "keras_dpsgd: assume_poisson(%s): the data its fits are fed are taken, unchecked, for Poisson lots at its "
        "sampling_rate; epsilon then ASSUMES POISSON SAMPLING and is no proven bound for shuffled fixed-size "
        "batches. Train on keras_dpsgd.PoissonLots for an honest one.",
        type(optimizer).__name__,
    )
    return optimizer


def assumes_poisson(optimizer: Any) -> bool:
    """True after :func:`assume_poisson` (`optimizer`)."""
    return bool(getattr(optimizer, _ASSUMED_ATTR, False))


def note_fit_sampling(model: Any, optimizer: Any) -> None:
    """Records q = B · k / N of a running ``fit(x, y, batch_size=B)`` on arrays, where the optimizer
    does not know its sampling rate (no ``PoissonLots.configure``).

    Called by :func:`keras_dpsgd.step.fed_data.check_fed_data` (when the DP step is traced, at every
    fit's ``make_train_function``, at every epoch start of fit and by the privacy callbacks'
    ``on_train_begin``, before the fit's first step) for data other than Poisson lots. The ledger then records the fit's steps at
    that q (a new fit with another q starts a new segment; a fit whose data have no known size
    records its steps at the reader's q, as before), and ``model_epsilon(model)`` needs neither
    ``num_examples`` nor ``batch_size``. A warning says, once, that this ε assumes Poisson sampling.
    """
    if not is_dp_optimizer(optimizer) or getattr(optimizer, "sampling_rate", None) is not None:
        return
    frame = fit_frame(model)
    if frame is None:
        return
    n = fit_training_size(frame)
    batch = frame.f_locals.get("batch_size") or _KERAS_DEFAULT_BATCH_SIZE
    k = accumulation_steps(optimizer)
    sampling = None
    if n is not None and isinstance(batch, int) and batch >= 1:
        sampling = (n, batch, min(1.0, batch * k / n))
    previous = _fit_sampling(optimizer)
    if sampling == previous:
        return
    if previous is not None and model is not None:
        attach(model, optimizer)  # the earlier fit's steps, at its q
        if sampling is None:
            _close_segment(model, optimizer)  # the steps of this fit: at the reader's q
    setattr(optimizer, _FIT_SAMPLING_ATTR, sampling)
    if sampling is not None:
        _warn_poisson_assumed(
            sampling[2],
            f"batch_size * gradient_accumulation_steps / N = {batch} * {k} / {n} (fit's batch size and training set)",
        )
        if model is not None:
            attach(model, optimizer)


def _close_segment(model: Any, optimizer: Any) -> None:
    with tf.init_scope():
        for holder in ledger_state_holders(model, optimizer):
            holder.state.assign(S.dumps(S.close_segment(_read_state(holder))))


def resolve_num_examples(optimizer: Any, num_examples: Optional[int] = None) -> Optional[int]:
    """N: `num_examples`, else expected_lot_size / sampling_rate of a configured optimizer, else
    the training set of the optimizer's last ``fit`` on arrays."""
    n = _int_arg(num_examples, "num_examples")
    if n is not None:
        return n
    lot = getattr(optimizer, "expected_lot_size", None)
    q = getattr(optimizer, "sampling_rate", None)
    if lot is not None and q is not None:
        return int(round(float(lot) / float(q)))
    sampling = _fit_sampling(optimizer)
    return None if sampling is None else sampling[0]


def resolve_sampling_rate(
    optimizer: Any, *, num_examples: Optional[int] = None, batch_size: Optional[int] = None
) -> float:
    """q of the optimizer's steps: its `sampling_rate`, else (B · accumulation) / N with a warning.

    B and N: `batch_size` and `num_examples` where given, and fit's own where the optimizer's
    last ``fit`` was on arrays (:func:`note_fit_sampling`); with both, the larger q.

    Raises:
      ValueError: if q is unknown and num_examples or batch_size is missing.
    """
    q = getattr(optimizer, "sampling_rate", None)
    if q is not None:
        return float(q)
    n = _int_arg(num_examples, "num_examples")
    b = _int_arg(batch_size, "batch_size")
    fitted = _fit_sampling(optimizer)
    if n is None or b is None:
        if fitted is not None:
            return fitted[2]
        raise ValueError(
            "the optimizer's sampling_rate is unknown and its fit's data have no known size: train on "
            "keras_dpsgd.PoissonLots and call lots.configure(optimizer), or pass num_examples and batch_size "
            f"(then Poisson sampling is assumed), got num_examples={num_examples!r}, batch_size={batch_size!r}"
        )
    k = accumulation_steps(optimizer)
    q = min(1.0, b * k / n)
    _warn_poisson_assumed(q, f"batch_size * gradient_accumulation_steps / N = {b} * {k} / {n}")
    return q if fitted is None else max(q, fitted[2])


def step_event(q: float, noise_multipliers: Sequence[float], count: int, label: str = DPSGD_LABEL):
    """`count` steps at q: one Gaussian release (flat clipping) or a composition of several."""
    if len(noise_multipliers) == 1:
        return PoissonSampledGaussianEvent(q, noise_multipliers[0], count=count, label=label)
    return PoissonSampledComposedGaussianEvent(q, tuple(noise_multipliers), count=count, label=label)


def optimizer_events(model: Any, *, num_examples: Optional[int] = None, batch_size: Optional[int] = None) -> list:
    """The privacy events of the training steps of the model's optimizer so far.

    A DP optimizer's noised steps become PoissonSampledGaussianEvents (one per
    (q, σ_eff) segment). A non-private optimizer that has taken steps touched
    the data without noise: recorded as a noiseless Gaussian event (ε = ∞).
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return []
    if not is_dp_optimizer(optimizer):
        iterations = int(optimizer.iterations.numpy()) if hasattr(optimizer, "iterations") else 0
        if iterations:
            return [GaussianEvent(0.0, count=iterations, label="non-private training")]
        return []
    sigma = float(optimizer.effective_noise_multiplier)
    attach(model, optimizer)
    data = sync_ledger_state(model, recorded_sampling_rate(optimizer), sigma)
    q = None  # the reader's q: needed only for steps recorded without one
    if (
        num_examples is not None
        or batch_size is not None
        or any(s["sampling_rate"] is None and s["count"] for s in data["segments"])
    ):
        q = resolve_sampling_rate(optimizer, num_examples=num_examples, batch_size=batch_size)
    searches = [event_from_dict(e) for e in S.searches(data)]
    return searches + [step_event(*segment) for segment in S.events(data, q)]


def check_trial(model: Any, event: TuningEvent) -> None:
    """Refuses a model whose ledger spends more than one trial of the search `event` may, at some RDP order.

    A search's bound (Papernot & Steinke 2022) holds only if every trial is within one RDP bound (their
    Sec. 3.3): the model's whole ledger (its layers' events and its optimizer's steps) is composed at
    :data:`~keras_dpsgd.accounting.DEFAULT_ORDERS` and must not exceed the search's trial curve
    (:func:`keras_dpsgd.accounting.tuning.rdp_trial`) at any of them. A model whose layers release too
    (DP-PCA, ...) or that trained more than planned is refused.

    Raises:
      TypeError: `event` is not a TuningEvent.
      ValueError: naming the order where the model's RDP exceeds the trial's.
    """
    if not isinstance(event, TuningEvent):
        raise TypeError(f"event must be a TuningEvent, got {type(event).__name__}")
    ledger = model_privacy_ledger(model)
    used = RdpAccountant(DEFAULT_ORDERS).compose(ledger).rdp
    bound = rdp_trial(event, DEFAULT_ORDERS)
    if not np.all(used <= bound):
        with np.errstate(invalid="ignore"):  # ∞ − ∞ at orders where both are ∞
            worst = int(np.argmax(np.where(used <= bound, -np.inf, np.nan_to_num(used - bound, nan=np.inf))))
        raise ValueError(
            f"the model's ledger ({len(ledger)} events) spends more than one trial of the search may: RDP "
            f"{used[worst]:.6g} > {bound[worst]:.6g} at order {DEFAULT_ORDERS[worst]:g}; a trial runs only its "
            "planned DP-SGD steps (no layer that releases, no training before or after)"
        )


def record_search(model: Any, event: TuningEvent) -> None:
    """Records that `model` is the released (best) trial of the hyperparameter search `event`.

    From now on the model's ledger charges the whole search (:class:`~keras_dpsgd.accounting.TuningEvent`,
    Papernot & Steinke 2022) instead of its optimizer's steps so far, which the search covers; steps taken
    later are charged as before. The record lives in the ledger's state, so it travels with the model
    wherever the ledger does (checkpoints, SavedModels, Keras 3 files); a tf_keras ``.keras``/h5 model,
    which keeps only the optimizer's counter, is refused (:func:`refuse_lost_history`).

    Fail closed: the model must be within one trial of the search (:func:`check_trial`).

    Raises:
      TypeError: `event` is not a TuningEvent.
      ValueError: the model has no DP optimizer, or its ledger exceeds the search's trial bound.
    """
    optimizer = getattr(model, "optimizer", None)
    if not is_dp_optimizer(optimizer):
        raise ValueError(f"the model's optimizer must be a keras_dpsgd DP optimizer, got {type(optimizer).__name__}")
    check_trial(model, event)
    with tf.init_scope():
        holders = ledger_state_holders(model, optimizer)
        state = S.record_search(S.merge(*[_read_state(h) for h in holders]), event.to_dict())
        for holder in holders:
            holder.state.assign(S.dumps(state))


def _releasing_layers(model: Any) -> list:
    """(layer, its events) of every layer (recursively, the model included) with `privacy_events`."""
    found, seen = [], set()
    layers = model._flatten_layers(include_self=True, recursive=True) if hasattr(model, "_flatten_layers") else [model]
    for layer in layers:
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        declared = getattr(layer, "privacy_events", None)
        if declared:
            found.append((layer, declared))
    return found


def refuse_shared_layer_seeds(model: Any) -> None:
    """Refuses a model whose ledger holds releases of two layers adapted with one seed (issue 37.4).

    A seeded DP preprocessing layer draws the noise of its k-th adapt from (seed, k)
    (``keras_dpsgd.preprocessing.adapt``): two such layers with one seed drew the same noise for their
    first adapts, which the ledger would count as independent releases.

    Raises:
      ValueError: naming both layers and the seed.
    """
    by_seed = {}
    for layer, _ in _releasing_layers(model):
        seed = getattr(layer, "seed", None)
        if not isinstance(seed, int) or isinstance(seed, bool):
            continue
        if seed in by_seed:
            raise ValueError(
                f"layers {by_seed[seed].name!r} and {layer.name!r} of this model were adapted with the same seed "
                f"({seed}): a seeded layer draws the noise of its k-th adapt from (seed, k), so both released the "
                "same noise, which epsilon would count as independent releases. Give each DP layer its own seed "
                "(or none: OS entropy) and adapt them again"
            )
        by_seed[seed] = layer


def layer_events(model: Any) -> list:
    """Events of every layer (recursively, the model included) with a `privacy_events` property.

    Raises:
      ValueError: two of these layers adapted with one seed (:func:`refuse_shared_layer_seeds`).
    """
    refuse_shared_layer_seeds(model)
    return [event for _, declared in _releasing_layers(model) for event in declared]


def model_privacy_ledger(
    model: Any,
    *,
    num_examples: Optional[int] = None,
    batch_size: Optional[int] = None,
    extra_events: Iterable = (),
) -> PrivacyLedger:
    """Every recorded access to the data by `model`: its layers' events, then its optimizer's steps.

    Args:
      model: a tf_keras model (compiled or not).
      extra_events: events of data accesses outside the model (e.g. a DP-PCA
        layer applied to the data before fit), placed first.
      num_examples: N, needed only when the optimizer's sampling_rate is unknown.
      batch_size: the physical batch size given to fit, idem (Poisson sampling is then assumed and
        a warning says so once).

    Returns:
      A PrivacyLedger whose DP-SGD events carry the label "dp-sgd".

    Raises:
      ValueError: if the optimizer's sampling_rate is unknown and num_examples or batch_size is missing.
    """
    events = list(extra_events) + layer_events(model)
    events.extend(optimizer_events(model, num_examples=num_examples, batch_size=batch_size))
    return PrivacyLedger(events)


def resolve_delta(delta: Optional[float], num_examples: Optional[int]) -> float:
    """δ, or the default min(1/N^1.1, 1/(10·N)) (announced once); refuses δ >= 1/N when N is known.

    Raises:
      ValueError: if δ is None and N unknown, or δ >= 1/N.
    """
    if delta is None:
        if num_examples is None:
            raise ValueError(
                "target_delta is None and num_examples is unknown: give target_delta or num_examples "
                "(the default delta is min(1/N^1.1, 1/(10·N)))"
            )
        delta = default_delta(num_examples)
        _warn_once(
            ("delta", num_examples), "keras_dpsgd: delta = %s = %.3g (N = %d).", DEFAULT_DELTA_RULE, delta, num_examples
        )
        return delta
    if num_examples is not None:
        return check_delta(delta, num_examples)
    return float(delta)


def model_epsilon(
    model: Any,
    *,
    target_delta: Optional[float] = None,
    num_examples: Optional[int] = None,
    batch_size: Optional[int] = None,
    extra_events: Iterable = (),
    accountant: str = "rdp",
) -> tuple[float, float]:
    """(ε, δ) spent so far by `model` (all its ledger events composed).

    Arguments as for :func:`model_privacy_ledger` and :func:`resolve_delta`.
    """
    n = resolve_num_examples(getattr(model, "optimizer", None), num_examples)
    delta = resolve_delta(target_delta, n)
    ledger = model_privacy_ledger(model, num_examples=n, batch_size=batch_size, extra_events=extra_events)
    if not ledger.events:
        return 0.0, delta
    return compute_epsilon(ledger, delta, accountant=accountant), delta


def steps_remaining(
    model_or_ledger: Any,
    *,
    target_epsilon: float,
    target_delta: Optional[float] = None,
    sampling_rate: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    num_examples: Optional[int] = None,
    batch_size: Optional[int] = None,
    extra_events: Iterable = (),
    accountant: str = "rdp",
) -> int:
    """How many more DP-SGD steps keep ε <= target_epsilon (Abadi et al. 2016, "while within_limit").

    Args:
      model_or_ledger: a model (its ledger, q and σ_eff come from it and its optimizer) or a
        PrivacyLedger (then `sampling_rate` and `noise_multiplier` are required).
      target_epsilon: the budget ε.
      target_delta: δ; default min(1/N^1.1, 1/(10·N)) (N from num_examples or the configured optimizer).
      sampling_rate: q of the future steps (overrides the optimizer's).
      noise_multiplier: σ of the future steps (overrides the optimizer's).
      num_examples: as for :func:`model_privacy_ledger`.
      batch_size: as for :func:`model_privacy_ledger`.
      extra_events: as for :func:`model_privacy_ledger` (added to a given PrivacyLedger too).
      accountant: "rdp", "moments" or "pld".

    Returns:
      The largest k >= 0 with ε(ledger + k steps) <= target_epsilon.
    """
    if isinstance(model_or_ledger, PrivacyLedger):
        if sampling_rate is None or noise_multiplier is None:
            raise ValueError(
                "sampling_rate and noise_multiplier are required with a PrivacyLedger, got "
                f"sampling_rate={sampling_rate!r}, noise_multiplier={noise_multiplier!r}"
            )
        ledger = PrivacyLedger(list(extra_events) + list(model_or_ledger.events))
        n = _int_arg(num_examples, "num_examples")
    else:
        optimizer = getattr(model_or_ledger, "optimizer", None)
        if not is_dp_optimizer(optimizer):
            raise ValueError(
                f"the model's optimizer must be a keras_dpsgd DP optimizer, got {type(optimizer).__name__}"
            )
        n = resolve_num_examples(optimizer, num_examples)
        ledger = model_privacy_ledger(model_or_ledger, num_examples=n, batch_size=batch_size, extra_events=extra_events)
        if sampling_rate is None:
            sampling_rate = resolve_sampling_rate(optimizer, num_examples=n, batch_size=batch_size)
        if noise_multiplier is None:
            noise_multiplier = float(optimizer.effective_noise_multiplier)
    delta = resolve_delta(target_delta, n)
    return max_steps_within_budget(
        target_epsilon=target_epsilon,
        target_delta=delta,
        sampling_rate=sampling_rate,
        noise_multiplier=noise_multiplier,
        prior_events=ledger.events,
        accountant=accountant,
    )

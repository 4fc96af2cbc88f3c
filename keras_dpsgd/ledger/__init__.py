"""The privacy ledger of a training run: every access to the data, resumable.

A model's ledger holds (1) the events of every layer that declares a
``privacy_events`` property (e.g. DP-PCA), found recursively through nested
models and layers, and (2) the DP-SGD steps of its optimizer, one
:class:`PoissonSampledGaussianEvent` per segment of constant (q, σ_eff)
(Abadi et al. 2016, Algorithm 1: each noised step is a sub-sampled Gaussian
mechanism with sampling ratio q and noise multiplier σ).

The state and its transitions are pure (:mod:`keras_dpsgd.ledger._state`, one
schema, no TensorFlow); this module does the I/O: the string variables that
hold the state, the optimizer's counter and worst-case bounds, attaching to
the model and saving.

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
see :mod:`keras_dpsgd.step._sanitizer`).

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
explains the difference from shuffled fixed-size batches). When the optimizer
does not know its sampling rate (it was not configured by
``PoissonLots.configure``), q = batch_size · gradient_accumulation_steps / N is
used and a warning says, once, that this ε assumes Poisson sampling.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import weakref
from typing import Any, Iterable, Optional, Sequence

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from keras_dpsgd.ledger import _state as S
from keras_dpsgd import _validate
from keras_dpsgd.accounting import (
    GaussianEvent,
    PoissonSampledComposedGaussianEvent,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    check_delta,
    compute_epsilon,
    composed_noise_multiplier,
    default_delta,
    max_steps_within_budget,
)

__all__ = [
    "LedgerState",
    "accumulation_steps",
    "attach",
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
_STATE_ATTR = "_dpsgd_ledger_state"
DPSGD_LABEL = S.DPSGD_LABEL


def _warn_once(key: Any, message: str, *args) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        _LOG.warning(message, *args)


class LedgerState(tf.Module):
    """Checkpointable record of the DP-SGD segments of a run.

    Holds one scalar string variable (``state``) with the JSON of a
    :mod:`keras_dpsgd.ledger._state` state (its segments and the last step
    count read). q is None where the optimizer does not know it (no
    ``PoissonLots.configure``): the reader's assumption (B · k / N) is used.

    Every save (checkpoint, SavedModel) first brings the state up to date
    from the optimizer's counter (``_trackable_children`` runs at save time),
    so a saved ledger is never stale, whatever the callback order.
    """

    def __init__(self, name: str = "dpsgd_ledger_state"):
        super().__init__(name=name)
        with tf.init_scope():
            self.state = _local_string_variable("segments")
        self._refresh = None  # set by `attach`: syncs the state from the live counters
        self._trainer = None  # set by `attach` on the model's copy: returns its last DP optimizer
        self._model = None  # set by `attach` on the optimizer's copy: returns the model it trains

    def _trackable_children(self, *args, **kwargs):
        if self._refresh is not None:
            self._refresh()
        return super()._trackable_children(*args, **kwargs)


def _local_string_variable(name: str) -> tf.Variable:
    """An empty string tf.Variable of this process, never a distributed one.

    Under a ``tf.distribute`` strategy every worker keeps its own copy, written from the same
    counters (MultiWorkerMirroredStrategy cannot broadcast a string initial value).
    """
    if not tf.distribute.has_strategy():
        return tf.Variable("", dtype=tf.string, trainable=False, name=name)
    # The class itself (not tf.Variable) bypasses the strategy's variable creator.
    return resource_variable_ops.ResourceVariable("", dtype=tf.string, trainable=False, name=name)


def _read_state(holder: Any) -> dict:
    return S.loads(holder.state.numpy().decode("utf-8"))


def is_keras3(obj: Any) -> bool:
    """True if `obj` is a Keras 3 object (``import keras``), False for tf_keras."""
    return any(k.__module__.startswith("keras.") for k in type(obj).__mro__)


_KERAS3_HOLDER: list = []


def _holder_class(owner: Any) -> type:
    """LedgerState, or on Keras 3 its subclass that ``.keras`` and ``.weights.h5`` files keep.

    Keras 3 saves an object's state through ``save_own_variables`` of the
    ``KerasSaveable`` attributes it walks (not ``tf.train.Checkpoint``): the
    Keras 3 holder writes its JSON there as bytes, so the segments travel
    with the optimizer and the model through ``model.save``,
    ``save_weights``, ``ModelCheckpoint`` and ``BackupAndRestore``.
    """
    if not is_keras3(owner):
        return LedgerState
    if not _KERAS3_HOLDER:
        import numpy as np

        # Keras 3 walks only KerasSaveable attributes when saving; it publishes no other hook.
        from keras.src.saving.keras_saveable import KerasSaveable

        class Keras3LedgerState(LedgerState, KerasSaveable):
            def _obj_type(self):
                # Keras accepts only its own kinds here; "Loss" skips what a Loss has, and no
                # attribute of this holder is a KerasSaveable: only save_own_variables runs.
                return "Loss"

            def save_own_variables(self, store):
                if self._refresh is not None:
                    self._refresh()
                store["segments"] = np.frombuffer(self.state.numpy(), dtype=np.uint8)

            def load_own_variables(self, store):
                if "segments" in store:  # files written before the ledger was saved on Keras 3 have none
                    raw = np.asarray(store["segments"], dtype=np.uint8).tobytes()
                    S.loads(raw.decode("utf-8"))  # refuses what is not a ledger state
                    self.state.assign(raw)

        _KERAS3_HOLDER.append(Keras3LedgerState)
    return _KERAS3_HOLDER[0]


def ledger_state_holders(model: Any, optimizer: Any) -> list:
    """The state holders of a run, attached on first use to the optimizer and to the model.

    Two copies because Keras saves them differently: checkpoints keep both,
    a SavedModel keeps the model's (and loses the optimizer's variables), the
    .keras format keeps the optimizer's noised_steps only.
    """
    holders = []
    for owner in (optimizer, model):
        if owner is None:
            continue
        holder = getattr(owner, _STATE_ATTR, None)
        if holder is not None and not isinstance(getattr(holder, "state", None), tf.Variable):
            raise ValueError(f"{type(owner).__name__}.{_STATE_ATTR} must hold a string tf.Variable 'state'")
        if not isinstance(holder, LedgerState):
            with tf.init_scope():
                revived, holder = holder, _holder_class(owner)()
                if revived is not None:
                    # Loaded from a SavedModel as a plain object: keep its state in a LedgerState,
                    # which refreshes itself at the next save.
                    holder.state.assign(revived.state)
                _hold(owner, holder)  # also applies a pending (deferred) restore
            # tf_keras optimizers cache their checkpoint children on the first
            # save or restore; a holder attached after that must join the cache
            # or it would silently be left out of later checkpoints.
            cached = getattr(owner, "_coalesced_children", None)
            if isinstance(cached, dict):
                cached[_STATE_ATTR] = holder
        holders.append(holder)
    return holders


def _hold(owner: Any, holder: LedgerState) -> None:
    """Sets ``owner._dpsgd_ledger_state``: a checkpoint dependency of `owner`, never one of its weights.

    A tf_keras model counts every ``tf.Module`` set as its attribute among its weights, so the
    ledger would show in ``model.weights``/``get_weights()`` (a bytes array), break
    ``set_weights`` from a plain model's list and go into h5 weight files. There it is tracked for
    checkpoints and SavedModels only (``_track_trackable``), out of Keras's weight lists.
    """
    if not hasattr(owner, "_self_tracked_trackables"):  # Keras 3 and the optimizers: no such weight list
        setattr(owner, _STATE_ATTR, holder)
        return
    if getattr(owner, _STATE_ATTR, None) is not None:
        delattr(owner, _STATE_ATTR)  # a holder revived from a SavedModel leaves Keras's weight lists
    object.__setattr__(owner, _STATE_ATTR, holder)
    owner._track_trackable(holder, name=_STATE_ATTR, overwrite=True)


def _refresh(model: Any, optimizer: Any) -> None:
    """Brings the saved copies up to date with the optimizer's counter (q as it knows it)."""
    sync_ledger_state(
        model,
        recorded_sampling_rate(optimizer),
        float(optimizer.effective_noise_multiplier),
        optimizer=optimizer,
    )


def _refresher(model: Any, optimizer: Any, keep: bool):
    """A refresh of `model`'s ledger from `optimizer`, holding it alive if `keep`.

    The model's copy keeps its last optimizer alive: after a new compile the
    old optimizer's steps must still be folded into the history (at the next
    save, read or step), not lost with it.
    """
    model_ref = weakref.ref(model) if model is not None else (lambda: None)
    optimizer_ref = (lambda: optimizer) if keep else weakref.ref(optimizer)

    def refresh():
        opt = optimizer_ref()
        if opt is not None:
            _refresh(model_ref(), opt)

    return refresh, optimizer_ref


def attach(model: Any, optimizer: Any) -> None:
    """Makes the ledger a property of `model`: called by the DP step when it is traced.

    Attaches both copies of the state, keeps them current at every save, and
    when `model` was trained by another DP optimizer before (compiled again),
    first closes that optimizer's steps into the model's copy, so a new
    optimizer adds to the history instead of replacing it. Readers of the
    ledger call it too.
    """
    if not is_dp_optimizer(optimizer):
        return
    with tf.init_scope():
        holders = ledger_state_holders(model, optimizer)
        if model is not None:
            model_holder = holders[-1]
            previous = model_holder._trainer() if model_holder._trainer is not None else None
            if previous is not None and previous is not optimizer:
                _refresh(model, previous)
            model_holder._refresh, model_holder._trainer = _refresher(model, optimizer, keep=True)
            _guard_saves(model)
            from keras_dpsgd.step import _callback_guard  # imports this module: late

            _callback_guard.watch_fits(model)
        holders[0]._refresh, _ = _refresher(model, optimizer, keep=False)
        if model is not None:
            holders[0]._model = weakref.ref(model)
        _refresh(model, optimizer)


def refuse_h5_weights(where: str) -> None:
    """Refuses tf_keras h5 weights of a model with a ledger: they hold the layers' weights only.

    A run resumed from them would restart ε at 0 (issue 25.6), so the save is refused, not warned.

    Raises:
      ValueError: always, naming `where` and the formats that keep the ledger.
    """
    raise ValueError(
        f"{where} is refused: h5 weights hold the layers' weights only, not the privacy ledger nor the "
        "optimizer's noised_steps, so a run resumed from them would restart epsilon at 0. Save TF-format "
        "weights (a path without .h5), a tf.train.Checkpoint, BackupAndRestore or a SavedModel (model.save("
        "directory)), which keep the whole ledger, or a .keras model (its counter and worst case); for "
        "inference, model.get_weights() holds the layers' weights only"
    )


def is_h5(path: str, kwargs: dict) -> bool:
    """True if a tf_keras save to `path` with these keyword arguments writes an h5 file."""
    return path.endswith((".h5", ".hdf5")) or kwargs.get("save_format") in ("h5", "hdf5")


def _guard_saves(model: Any) -> None:
    """Wraps `model.save_weights` and `model.save` (instance attributes) where h5 loses the ledger.

    tf_keras h5 weights: refused (:func:`refuse_h5_weights`). A full h5 model keeps what
    ``.keras`` keeps (the optimizer's counter): refused when the ledger holds
    more (see :func:`refuse_lost_history`).
    """
    if "save_weights" in vars(model):
        return
    save_weights, save = model.save_weights, model.save

    def guarded_save_weights(filepath, *args, **kwargs):
        # Keras 3's .weights.h5 is its native format: it keeps the optimizer and the ledger.
        if is_h5(str(filepath), kwargs) and not is_keras3(model):
            refuse_h5_weights(f"save_weights({str(filepath)!r})")
        return save_weights(filepath, *args, **kwargs)

    def guarded_save(filepath, *args, **kwargs):
        if is_h5(str(filepath), kwargs) and is_dp_optimizer(getattr(model, "optimizer", None)):
            refuse_lost_history(model, model.optimizer, "an h5 file")
        return save(filepath, *args, **kwargs)

    object.__setattr__(model, "save_weights", guarded_save_weights)
    object.__setattr__(model, "save", guarded_save)


def _calling_frame(matches, max_depth: int):
    """The nearest frame up the call stack (below the caller's caller) for which `matches(frame)`.

    The one stack walk of the ledger. Keras offers no supported way to learn,
    from inside an optimizer's ``save_own_variables``, which model is being
    saved (a ``.keras`` save walks the model's children without passing the
    model down), nor to read the running ``fit``'s arguments (its
    data_handler's steps per epoch, validation_split) from a callback or the
    optimizer; these two reads are the only ones that look up the stack.
    """
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return None
        if matches(frame):
            return frame
        frame = frame.f_back
    return None


def _trains(obj: Any, optimizer: Any) -> bool:
    return (
        obj is not None
        and obj is not optimizer
        and getattr(obj, "optimizer", None) is optimizer
        and hasattr(obj, "fit")
    )


def saving_model(optimizer: Any, max_depth: int = 24) -> Any:
    """The model being saved with `optimizer`, or None.

    The model the ledger attached the optimizer to (its DP step was traced);
    else, for an optimizer that never stepped, a ``model`` or ``self`` up the
    call stack (see :func:`_calling_frame`).
    """
    holder = getattr(optimizer, _STATE_ATTR, None)
    attached = holder._model() if getattr(holder, "_model", None) is not None else None
    if _trains(attached, optimizer):
        return attached
    frame = _calling_frame(lambda f: any(_trains(f.f_locals.get(n), optimizer) for n in ("model", "self")), max_depth)
    if frame is None:
        return None
    return next(frame.f_locals[n] for n in ("model", "self") if _trains(frame.f_locals.get(n), optimizer))


def refuse_lost_history(model: Any, optimizer: Any, where: str) -> None:
    """Refuses a save that keeps only the optimizer's counter when the ledger holds more.

    ``.keras`` and full h5 files keep the optimizer's variables (noised_steps,
    the worst-case bounds), not the ledger's segments: steps of an earlier
    optimizer (the model was compiled again, or loaded from a SavedModel)
    would be lost and a resumed ε under-reported.

    Raises:
      ValueError: if the ledger holds steps that the optimizer's counter does not.
    """
    attach(model, optimizer)
    holder = getattr(optimizer, _STATE_ATTR, None)
    if holder is None:
        return
    with tf.init_scope():
        earlier = S.earlier_steps(_read_state(holder))
    if earlier > 0:
        raise ValueError(
            f"cannot save the privacy ledger to {where}: it keeps only the optimizer's noised_steps, and "
            f"the model's ledger also holds {earlier} steps of an earlier optimizer (the model was compiled "
            "again, or loaded from a SavedModel); a run resumed from it would under-report epsilon. Save "
            "a SavedModel (model.save(directory)) or a tf.train.Checkpoint, which keep the whole ledger"
        )


# The optimizer variables that keep the ledger's worst case where its segments are not saved (a
# .keras file): (name, initial value), in the order they are saved. 0 and inf: nothing charged yet.
BOUND_VARIABLES = (("ledger_max_sampling_rate", 0.0), ("ledger_min_noise_multiplier", math.inf))


def add_bound_variables(optimizer: Any) -> list:
    """Makes `optimizer`'s saved worst-case bounds [largest q charged, smallest σ_eff charged].

    Made with the optimizer's own ``add_variable`` (tf_keras or Keras 3), so that its Keras saves
    them with its other variables (``.keras``, h5, checkpoints); the front end keeps them under its
    attribute names (the checkpoint keys) and exposes them as ``ledger_max_sampling_rate`` and
    ``ledger_min_noise_multiplier`` (tf.Variables), which the ledger reads and widens.
    """

    def constant(value: float):
        return lambda shape, dtype=None: tf.fill(shape, tf.constant(value, tf.float64))

    return [
        optimizer.add_variable(shape=(), dtype="float64", initializer=constant(value), name=name)
        for name, value in BOUND_VARIABLES
    ]


def _bound_variables(optimizer: Any) -> Optional[tuple]:
    """The optimizer's (largest q, smallest σ) variables, or None if it has none."""
    q_max = getattr(optimizer, "ledger_max_sampling_rate", None)
    sigma_min = getattr(optimizer, "ledger_min_noise_multiplier", None)
    if isinstance(q_max, tf.Variable) and isinstance(sigma_min, tf.Variable):
        return q_max, sigma_min
    return None


def _read_bounds(variables: Optional[tuple]) -> Optional[tuple]:
    return None if variables is None else tuple(float(v.numpy()) for v in variables)


def _write_bounds(variables: Optional[tuple], values: Optional[tuple]) -> None:
    if variables is None:
        return
    for variable, value in zip(variables, values):
        if float(variable.numpy()) != value:
            variable.assign(value)


def note_sampling_rate_change(optimizer: Any, previous_sampling_rate: float) -> None:
    """Keeps the steps already taken at `previous_sampling_rate` charged at least at it.

    Called by a DP optimizer's ``sampling_rate`` setter when a known q
    changes. The ledger charges steps it has not attributed to a segment at
    the worst case in the optimizer's saved bounds, so a change of q before
    the ledger was ever read cannot under-report ε.
    """
    variables = _bound_variables(optimizer)
    if variables is None or not is_dp_optimizer(optimizer) or noised_steps(optimizer) == 0:
        return
    with tf.init_scope():
        sigma = float(optimizer.effective_noise_multiplier)
        _write_bounds(variables, S.widen_bounds(_read_bounds(variables), previous_sampling_rate, sigma))


def discard_partial_lot(optimizer: Any, where: str = "") -> int:
    """Drops `optimizer`'s incomplete lot, if it keeps one; returns its batches (0 if none).

    A discarded lot was never released (no noise drawn, no update): the
    ledger does not change (:func:`keras_dpsgd.ledger._state.discard_partial_lot`).
    """
    discard = getattr(optimizer, "discard_partial_lot", None)
    return int(discard(where)) if discard is not None else 0


def fit_frame(model: Any, max_depth: int = 64):
    """The frame of the running ``Model.fit`` of `model` (its locals: x, data_handler, ...), or None.

    Keras gives neither callbacks nor the optimizer the fit's data; the call
    stack is searched for ``fit``'s frame (see :func:`_calling_frame`). Under a
    ``tf.distribute.MirroredStrategy`` the train step is traced in one thread per
    replica, while ``fit`` runs in the thread that called it: from another thread,
    the other threads' stacks are searched too (deeper: ``fit`` waits below the
    tracing frames there).
    """
    matches = lambda f: f.f_code.co_name == "fit" and f.f_locals.get("self") is model  # noqa: E731
    frame = _calling_frame(matches, max_depth)
    if frame is not None or threading.current_thread() is threading.main_thread():
        return frame
    for top in sys._current_frames().values():
        for _ in range(4 * max_depth):
            if top is None or matches(top):
                break
            top = top.f_back
        if top is not None:
            return top
    return None


def is_dp_optimizer(optimizer: Any) -> bool:
    """True if `optimizer` counts noised steps (a keras_dpsgd DP optimizer)."""
    return optimizer is not None and hasattr(optimizer, "noised_steps")


def noised_steps(optimizer: Any) -> int:
    """The optimizer's count of noised steps (lots), as an int."""
    return int(optimizer.noised_steps.numpy())


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
_FIT_SAMPLING_ATTR = "_dpsgd_fit_sampling"


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


def note_fit_sampling(model: Any, optimizer: Any) -> None:
    """Records q = B · k / N of a running ``fit(x, y, batch_size=B)`` on arrays, where the optimizer
    does not know its sampling rate (no ``PoissonLots.configure``).

    Called when the DP step is traced, at every epoch start of fit and by the privacy callbacks'
    ``on_train_begin``, before the fit's first step. The ledger then records the fit's steps at
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


def _fit_sampling(optimizer: Any) -> Optional[tuple]:
    return getattr(optimizer, _FIT_SAMPLING_ATTR, None)


def recorded_sampling_rate(optimizer: Any) -> Optional[float]:
    """q the ledger records for the optimizer's steps: its sampling_rate, else the running or last
    fit's B · k / N (:func:`note_fit_sampling`), else None (the reader's q applies)."""
    q = getattr(optimizer, "sampling_rate", None)
    if q is not None:
        return q
    sampling = _fit_sampling(optimizer)
    return None if sampling is None else sampling[2]


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


def step_noise_multipliers(optimizer: Any, noise_multiplier: Optional[float] = None) -> tuple:
    """The noise multipliers of the Gaussian releases of one of `optimizer`'s steps.

    The optimizer's ``release_noise_multipliers`` (one per clipping group,
    plus adaptive clipping's norm queries) where it has them and they compose
    to `noise_multiplier` (default: its ``effective_noise_multiplier``), else
    the one release ``(noise_multiplier,)``.
    """
    sigma = float(optimizer.effective_noise_multiplier) if noise_multiplier is None else float(noise_multiplier)
    releases = getattr(optimizer, "release_noise_multipliers", None)
    if releases and composed_noise_multiplier(releases) == sigma:
        return tuple(float(r) for r in releases)
    return (sigma,)


def step_event(q: float, noise_multipliers: Sequence[float], count: int, label: str = DPSGD_LABEL):
    """`count` steps at q: one Gaussian release (flat clipping) or a composition of several."""
    if len(noise_multipliers) == 1:
        return PoissonSampledGaussianEvent(q, noise_multipliers[0], count=count, label=label)
    return PoissonSampledComposedGaussianEvent(q, tuple(noise_multipliers), count=count, label=label)


def sync_ledger_state(
    model: Any,
    sampling_rate: Optional[float],
    noise_multiplier: float,
    *,
    steps: Optional[int] = None,
    optimizer: Any = None,
) -> dict:
    """Reads the optimizer's step count, closes a segment if (q, σ) changed; returns the state.

    `sampling_rate`: the optimizer's q, or None where it does not know it
    (then the segment keeps the q it has: None, the reader's assumption, or
    a known value). `noise_multiplier`: σ_eff of those steps (their releases:
    :func:`step_noise_multipliers`). `steps`: a step count read earlier under
    these (q, σ) (default: read now). `optimizer`: default ``model.optimizer``.

    The I/O around :func:`keras_dpsgd.ledger._state.advance`: of the two saved
    copies the one that recorded more steps wins (a lost copy never lowers
    ε); the optimizer's counter is new when its copy is empty (its state was
    not restored, e.g. from a SavedModel, or the model was compiled with a new
    optimizer); the optimizer's saved worst case (``.keras`` files keep it, not
    the segments) charges counted steps whose segments were lost.
    """
    optimizer = model.optimizer if optimizer is None else optimizer
    with tf.init_scope():
        holders = ledger_state_holders(model, optimizer)
        raw = [h.state.numpy() for h in holders]
        states = [_read_state(h) for h in holders]
        bound_variables = _bound_variables(optimizer)
        bounds = _read_bounds(bound_variables)
        sigma = float(noise_multiplier)
        data = S.advance(
            S.merge(*states),
            steps=noised_steps(optimizer) if steps is None else int(steps),
            sampling_rate=None if sampling_rate is None else float(sampling_rate),
            noise_multipliers=step_noise_multipliers(optimizer, sigma),
            counter_is_new=not raw[0],
            saved_worst_case=S.saved_worst_case(bounds, sampling_rate, sigma),
        )
        if bounds is not None:
            _write_bounds(bound_variables, S.fold_bounds(data, bounds))
        encoded = S.dumps(data)
        for holder, old in zip(holders, raw):
            if old.decode("utf-8") != encoded:
                holder.state.assign(encoded)
    return data


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
    return [step_event(*segment) for segment in S.events(data, q)]


def layer_events(model: Any) -> list:
    """Events of every layer (recursively, the model included) with a `privacy_events` property."""
    events, seen = [], set()
    layers = model._flatten_layers(include_self=True, recursive=True) if hasattr(model, "_flatten_layers") else [model]
    for layer in layers:
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        declared = getattr(layer, "privacy_events", None)
        if declared:
            events.extend(declared)
    return events


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
    """δ, or the default 1/N^1.1 (announced once); refuses δ >= 1/N when N is known.

    Raises:
      ValueError: if δ is None and N unknown, or δ >= 1/N.
    """
    if delta is None:
        if num_examples is None:
            raise ValueError(
                "target_delta is None and num_examples is unknown: give target_delta or num_examples "
                "(the default delta is 1/num_examples**1.1)"
            )
        delta = default_delta(num_examples)
        _warn_once(("delta", num_examples), "keras_dpsgd: delta = 1/N^1.1 = %.3g (N = %d).", delta, num_examples)
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
      target_delta: δ; default 1/N^1.1 (N from num_examples or the configured optimizer).
      sampling_rate, noise_multiplier: q and σ of the future steps (override the optimizer's).
      num_examples, batch_size, extra_events: as for :func:`model_privacy_ledger` (extra_events
        are added to a given PrivacyLedger too).
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

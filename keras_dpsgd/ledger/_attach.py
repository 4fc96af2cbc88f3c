"""Attaching the privacy ledger to the model it belongs to, and the guards of the model's saves and compiles.

The DP step attaches the ledger when it is traced (so do its readers and the load of a DP optimizer); the model's
copy keeps its last DP optimizer alive, so that a new compile folds that optimizer's steps into the history. The
guards refuse a save that would lose the ledger (tf_keras h5 weights; ``.keras``/h5 files that keep only the
counter while the ledger holds more) and, before a compile, keep a plain optimizer's steps.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import tensorflow as tf

from keras_dpsgd._frames import calling_frame
from keras_dpsgd.dp import ledger_state as S
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.ledger._holders import (
    _STATE_ATTR,
    LedgerState,
    _read_state,
    is_dp_optimizer,
    is_keras3,
    ledger_state_holders,
    on_load,
    write_ledger_offset,
)
from keras_dpsgd.ledger._plain_steps import record_plain_steps
from keras_dpsgd.ledger._sync import _refresh


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


# What watches a model's fits once a ledger is attached to it: the DP step's check of the running fit's callbacks
# (``keras_dpsgd.step._callback_guard.watch_fits``, registered by ``step._settings``, which every DP optimizer's
# class imports: the step is above the ledger, so the ledger calls it through this list).
_ON_ATTACH: list[Callable[[Any], None]] = []


def on_attach(hook: Callable[[Any], None]) -> None:
    """Calls ``hook(model)`` whenever a DP optimizer's ledger is attached to `model` (:func:`attach`)."""
    if hook not in _ON_ATTACH:
        _ON_ATTACH.append(hook)


def attach(model: Any, optimizer: Any, *, loading: bool = False) -> None:
    """Makes the ledger a property of `model`: called by the DP step when it is traced.

    Attaches both copies of the state, keeps them current at every save, and
    when `model` was trained by another DP optimizer before (compiled again),
    first closes that optimizer's steps into the model's copy, so a new
    optimizer adds to the history instead of replacing it. Readers of the
    ledger call it too, and the load of a DP optimizer (``loading=True``: the copies are
    linked only; the counters are read, and a fit's start checked by :func:`on_attach`'s
    hooks, at the first read or step), so that a model compiled again right after a load
    keeps the loaded history.
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
            _guard_compiles(model)
            for hook in () if loading else _ON_ATTACH:
                hook(model)
        holders[0]._refresh, _ = _refresher(model, optimizer, keep=False)
        if model is not None:
            holders[0]._model = weakref.ref(model)
        if not loading:
            _refresh(model, optimizer)


def _restored(optimizer: Any, state: dict) -> None:
    """After a Keras 3 file's ledger state is loaded into `optimizer`'s holder: the restored counter's position in
    the restored ledger, and the model being loaded (``compile=True``) attached, so that it keeps the history from
    now on (compiled again before any read or step, it still holds it: its copy keeps this optimizer alive)."""
    write_ledger_offset(optimizer, S.earlier_steps(state))
    model = saving_model(optimizer, max_depth=64)
    if model is not None:
        attach(model, optimizer, loading=True)


on_load(_restored)


def recorded_releases(model: Any) -> int:
    """The DP-SGD steps the model's ledger records (every optimizer's), its last optimizer's counted first.

    The position the next release of a new optimizer takes in the ledger: the one-call API derives the
    lots' seed from it (``keras_dpsgd._one_call``), as the noise keys are (:func:`write_ledger_offset`).
    """
    optimizer = getattr(model, "optimizer", None)
    if is_dp_optimizer(optimizer):
        attach(model, optimizer)
    holder = getattr(model, _STATE_ATTR, None)
    if not isinstance(holder, LedgerState):
        return 0
    with tf.init_scope():
        return S.recorded_steps(_read_state(holder))


def _trains(obj: Any, optimizer: Any) -> bool:
    return (
        obj is not None
        and obj is not optimizer
        and getattr(obj, "optimizer", None) is optimizer
        and hasattr(obj, "fit")
    )


@tf.autograph.experimental.do_not_convert
def saving_model(optimizer: Any, max_depth: int = 24) -> Any:
    """The model being saved with `optimizer`, or None.

    The model the ledger attached the optimizer to (its DP step was traced);
    else, for an optimizer that never stepped, a ``model`` or ``self`` up the
    call stack (see :func:`keras_dpsgd._frames.calling_frame`).
    """
    holder = getattr(optimizer, _STATE_ATTR, None)
    attached = holder._model() if getattr(holder, "_model", None) is not None else None
    if _trains(attached, optimizer):
        return attached
    frame = calling_frame(lambda f: any(_trains(f.f_locals.get(n), optimizer) for n in ("model", "self")), max_depth)
    if frame is None:
        return None
    return next(frame.f_locals[n] for n in ("model", "self") if _trains(frame.f_locals.get(n), optimizer))


def refuse_h5_weights(where: str) -> None:
    """Refuses tf_keras h5 weights of a model with a ledger: they hold the layers' weights only.

    A run resumed from them would restart ε at 0 (issue 25.6), so the save is refused, not warned.

    Raises:
      ValueError: always, naming `where` and the formats that keep the ledger.
    """
    raise refuse(
        "h5-weights",
        f"{where} is refused: h5 weights hold the layers' weights only, not the privacy ledger nor the "
        "optimizer's noised_steps, so a run resumed from them would restart epsilon at 0. Save TF-format "
        "weights (a path without .h5), a tf.train.Checkpoint, BackupAndRestore or a SavedModel (model.save("
        "directory)), which keep the whole ledger, or a .keras model (its counter and worst case); for "
        "inference, model.get_weights() holds the layers' weights only",
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


def _guard_compiles(model: Any) -> None:
    """Wraps `model.compile` (an instance attribute) so that a plain optimizer's steps outlive its compile.

    Compiled again, the model loses sight of its optimizer: the steps a plain (non-DP) optimizer took after DP
    training (noiseless: ε = ∞) are written into the model's copy of the ledger first
    (:func:`record_plain_steps`), whatever optimizer comes next.
    """
    if "compile" in vars(model):
        return
    compile_ = model.compile

    def guarded_compile(*args, **kwargs):
        record_plain_steps(model)
        return compile_(*args, **kwargs)

    object.__setattr__(model, "compile", guarded_compile)


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
        state = _read_state(holder)
        earlier = S.earlier_steps(state)
    if state["searches"]:
        raise refuse(
            "save-loses-history",
            f"cannot save the privacy ledger to {where}: it keeps only the optimizer's noised_steps, and the "
            "model's ledger also records the hyperparameter search it was selected by (a TuningEvent); a model "
            "loaded from it would under-report epsilon. Save a SavedModel (model.save(directory)) or a "
            "tf.train.Checkpoint, which keep the whole ledger",
        )
    if earlier > 0:
        raise refuse(
            "save-loses-history",
            f"cannot save the privacy ledger to {where}: it keeps only the optimizer's noised_steps, and "
            f"the model's ledger also holds {earlier} steps of an earlier optimizer (the model was compiled "
            "again, or loaded from a SavedModel); a run resumed from it would under-report epsilon. Save "
            "a SavedModel (model.save(directory)) or a tf.train.Checkpoint, which keep the whole ledger",
        )

"""Callbacks a DP ``fit`` refuses, before any weight changes (both Kerases).

Keras computes the training loss and metrics in ``logs`` on the private lots, without noise.
Printing them is a release the user sees and decides about (docs/privacy-model.md); a callback that *acts* on
them takes a decision on the private data that no noise covers and that ε does not count:

* ``EarlyStopping`` stops training (the stopping time is a function of the data) and, with
  ``restore_best_weights``, picks weights by it;
* ``ReduceLROnPlateau`` changes the learning rate;
* ``ModelCheckpoint(save_best_only=True)`` picks the weights it keeps;
* ``TerminateOnNaN`` stops on a non-finite training loss (the DP step already drops a
  non-finite example's gradient: ``nonfinite_examples`` counts them);
* any other callback with a ``monitor`` attribute (Keras's ``MonitorCallback`` and third-party
  ones): fail closed.

A monitor is allowed when it names a quantity that is not a function of the training set
without noise: ``val_*`` when the validation data is proven held out (``validation_data`` or
``validation_split``, no row of it a training row by content: :mod:`keras_dpsgd.step._held_out`,
issue 37.5; fail closed where the rows cannot be read) or what keras_dpsgd releases from its ledger or
with noise (``epsilon``, ``delta`` from ``PrivacyLogger``; ``clip_bound/*`` from
``ClipBoundsLogger``). Callbacks are found inside containers too (a ``CallbackList``, nested lists,
any callback holding a ``callbacks`` list). A callback of the user's own that reads ``logs`` is not
recognized.

tf_keras also refuses ``ModelCheckpoint(path.h5, save_weights_only=True)`` here: h5 weights
cannot carry the ledger (:func:`keras_dpsgd.ledger.refuse_h5_weights`), and a refusal at the
first save would come after an epoch of training.

The check reads ``fit``'s callback list from its frame (:func:`keras_dpsgd.ledger.fit_frame`):
Keras passes neither the list to the model nor the model's fit to the optimizer. It runs when
the DP step is traced (the first fit) and at every later ``fit`` (``make_train_function``, which
``fit`` calls before its first step).
"""

from __future__ import annotations

from typing import Any, Optional

import sys

import keras

from keras_dpsgd import ledger
from keras_dpsgd.step.fed_data import check_fed_data
from keras_dpsgd.step._held_out import validation_overlap
from keras_dpsgd.dp.refusals import refuse

__all__ = ["refuse_private_decisions", "watch_fits"]

RELEASED_MONITORS = ("epsilon", "delta")
RELEASED_PREFIXES = ("clip_bound/",)
VALIDATION_PREFIX = "val_"  # allowed on held-out validation data only


def _both(name: str) -> tuple:
    """Keras 3's callback class `name`, and tf_keras's once tf_keras is imported (no tf_keras callback before)."""
    tf_keras = sys.modules.get("tf_keras")
    own = getattr(keras.callbacks, name)
    return (own, getattr(tf_keras.callbacks, name)) if tf_keras is not None else (own,)


def is_released(monitor: str) -> bool:
    """True if `monitor` names a quantity keras_dpsgd releases with noise or from its ledger."""
    return monitor in RELEASED_MONITORS or monitor.startswith(RELEASED_PREFIXES)


def _decision(callback: Any) -> Optional[tuple]:
    """(monitored quantity, what the callback does with it) if it acts on a logged quantity, else None."""
    if isinstance(callback, _both("TerminateOnNaN")):
        return "loss", "stops training when it is NaN or infinite"
    monitor = getattr(callback, "monitor", None)
    if not isinstance(monitor, str) or is_released(monitor):
        return None
    if isinstance(callback, _both("ModelCheckpoint")):
        if not callback.save_best_only:
            return None  # saves every time: the monitor is never read
        return monitor, "chooses which weights it saves by it (save_best_only=True)"
    if isinstance(callback, _both("ReduceLROnPlateau")):
        return monitor, "changes the learning rate by it"
    if isinstance(callback, _both("EarlyStopping")):
        if callback.restore_best_weights:
            return monitor, "stops training and restores the weights by it (restore_best_weights=True)"
        return monitor, "stops training by it (the stopping time is then a function of the data)"
    return monitor, "acts on it"


def _listed(callbacks: Any, seen: Optional[set] = None) -> list:
    """Every callback in fit's local `callbacks`, looking inside containers: a CallbackList (Keras 3's,
    tf_keras's), lists and tuples, any callback that holds a ``callbacks`` list (the container itself too)."""
    seen = set() if seen is None else seen
    if callbacks is None or id(callbacks) in seen:
        return []
    seen.add(id(callbacks))
    if isinstance(callbacks, (list, tuple)):
        return [c for inner in callbacks for c in _listed(inner, seen)]
    inner = getattr(callbacks, "callbacks", None)
    found = [callbacks]
    if isinstance(inner, (list, tuple)):
        found += _listed(inner, seen)
    return found


def refuse_private_decisions(model: Any) -> None:
    """Refuses the callbacks of `model`'s running fit that act on the un-noised training logs.

    Raises:
      ValueError: naming the callback, its monitor and what to monitor instead.
    """
    frame = ledger.fit_frame(model)
    if frame is None:
        return
    tf_keras_model = not ledger.is_keras3(model)
    overlap = []  # computed once, for the first val_ decision
    for callback in _listed(frame.f_locals.get("callbacks")):
        if tf_keras_model and isinstance(callback, _both("ModelCheckpoint")) and callback.save_weights_only:
            if ledger.is_h5(str(callback.filepath), {}):
                model.train_function = None
                ledger.refuse_h5_weights(
                    f"{type(callback).__name__}({str(callback.filepath)!r}, save_weights_only=True)"
                )
        decision = _decision(callback)
        if decision is None:
            continue
        monitor, action = decision
        if monitor.startswith(VALIDATION_PREFIX):
            if not overlap:
                overlap.append(validation_overlap(frame.f_locals))
            if overlap[0] is None:
                continue  # held-out validation data
        model.train_function = None  # a fit after the fix traces afresh (Keras 3 cannot retrace a failed trace)
        if monitor.startswith(VALIDATION_PREFIX):
            raise refuse(
                "validation-not-held-out",
                f"{type(callback).__name__}(monitor={monitor!r}) is refused in a DP fit: the callback {action}, a "
                f"decision on the validation data without noise, and {overlap[0]}.",
            )
        raise refuse(
            "private-decision",
            f"{type(callback).__name__}(monitor={monitor!r}) is refused in a DP fit: {monitor!r} is computed on "
            f"the private training lots without noise, and the callback {action}, a decision on the private "
            "data that epsilon does not count. Monitor a 'val_' quantity computed on data outside the training "
            "set (validation_data=... or validation_split=...), or a quantity keras_dpsgd releases with noise "
            "('epsilon' from PrivacyLogger, 'clip_bound/...' from ClipBoundsLogger); or remove the callback.",
        )


def _refuse_before_fit(model: Any) -> None:
    """Every check of a DP fit's start: fit's callbacks, and releases of layers sharing a seed."""
    refuse_private_decisions(model)
    try:
        ledger.refuse_shared_layer_seeds(model)
    except ValueError:
        model.train_function = None  # a fit after the fix traces afresh
        raise


class _CheckedMakeTrainFunction:
    """`model.make_train_function`, which every ``fit`` calls before its first step: checks fit's callbacks."""

    def __init__(self, model: Any):
        self._model = model

    def __call__(self, *args, **kwargs):
        _refuse_before_fit(self._model)
        check_fed_data(self._model, self._model.optimizer, outside_fit=True)
        ledger.refresh_ledger_offset(self._model, getattr(self._model, "optimizer", None))
        return type(self._model).make_train_function(self._model, *args, **kwargs)


def watch_fits(model: Any) -> None:
    """Checks the running fit's callbacks now (the DP step is traced) and at every later fit of `model`."""
    if model is None:
        return
    _refuse_before_fit(model)
    if "make_train_function" not in vars(model):
        object.__setattr__(model, "make_train_function", _CheckedMakeTrainFunction(model))

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
without noise: ``val_*`` (computed by Keras on validation data, which is outside the training
set: ``validation_data`` or ``validation_split``; refused when ``validation_data`` holds fit's ``x``
itself) or what keras_dpsgd releases from its ledger or
with noise (``epsilon``, ``delta`` from ``PrivacyLogger``; ``clip_bound/*`` from
``ClipBoundsLogger``). A callback of the user's own that reads ``logs`` is not recognized.

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

__all__ = ["refuse_private_decisions", "watch_fits"]

RELEASED_MONITORS = ("epsilon", "delta")
RELEASED_PREFIXES = ("val_", "clip_bound/")


def _both(name: str) -> tuple:
    """Keras 3's callback class `name`, and tf_keras's once tf_keras is imported (no tf_keras callback before)."""
    tf_keras = sys.modules.get("tf_keras")
    own = getattr(keras.callbacks, name)
    return (own, getattr(tf_keras.callbacks, name)) if tf_keras is not None else (own,)


def is_released(monitor: str, validates_on_training_data: bool = False) -> bool:
    """True if `monitor` names a quantity that is no un-noised function of the training set.

    ``val_*`` is not when fit's validation data is its training data (the same object).
    """
    if validates_on_training_data and monitor.startswith("val_"):
        return False
    return monitor in RELEASED_MONITORS or monitor.startswith(RELEASED_PREFIXES)


def _validates_on_training_data(fit_locals: dict) -> bool:
    """True if fit's ``validation_data`` holds its training inputs ``x`` themselves."""
    validation, x = fit_locals.get("validation_data"), fit_locals.get("x")
    if validation is None or x is None:
        return False
    first = validation[0] if isinstance(validation, (tuple, list)) and validation else validation
    return first is x


def _decision(callback: Any, validates_on_training_data: bool) -> Optional[tuple]:
    """(monitored quantity, what the callback does with it) if it acts on the training logs, else None."""
    if isinstance(callback, _both("TerminateOnNaN")):
        return "loss", "stops training when it is NaN or infinite"
    monitor = getattr(callback, "monitor", None)
    if not isinstance(monitor, str) or is_released(monitor, validates_on_training_data):
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


def _listed(callbacks: Any) -> list:
    """The callbacks of fit's local `callbacks` (a CallbackList, a list, or None)."""
    if callbacks is None:
        return []
    inner = getattr(callbacks, "callbacks", callbacks)
    return list(inner) if isinstance(inner, (list, tuple)) else []


def refuse_private_decisions(model: Any) -> None:
    """Refuses the callbacks of `model`'s running fit that act on the un-noised training logs.

    Raises:
      ValueError: naming the callback, its monitor and what to monitor instead.
    """
    frame = ledger.fit_frame(model)
    if frame is None:
        return
    on_training_data = _validates_on_training_data(frame.f_locals)
    tf_keras_model = not ledger.is_keras3(model)
    for callback in _listed(frame.f_locals.get("callbacks")):
        if tf_keras_model and isinstance(callback, _both("ModelCheckpoint")) and callback.save_weights_only:
            if ledger.is_h5(str(callback.filepath), {}):
                model.train_function = None
                ledger.refuse_h5_weights(
                    f"{type(callback).__name__}({str(callback.filepath)!r}, save_weights_only=True)"
                )
        decision = _decision(callback, on_training_data)
        if decision is None:
            continue
        monitor, action = decision
        where = "data (validation_data is fit's x)" if monitor.startswith("val_") else "lots"
        model.train_function = None  # a fit after the fix traces afresh (Keras 3 cannot retrace a failed trace)
        raise ValueError(
            f"{type(callback).__name__}(monitor={monitor!r}) is refused in a DP fit: {monitor!r} is computed on "
            f"the private training {where} without noise, and the callback {action}, a decision on the private "
            "data that epsilon does not count. Monitor a 'val_' quantity computed on data outside the training "
            "set (validation_data=... or validation_split=...), or a quantity keras_dpsgd releases with noise "
            "('epsilon' from PrivacyLogger, 'clip_bound/...' from ClipBoundsLogger); or remove the callback."
        )


class _CheckedMakeTrainFunction:
    """`model.make_train_function`, which every ``fit`` calls before its first step: checks fit's callbacks."""

    def __init__(self, model: Any):
        self._model = model

    def __call__(self, *args, **kwargs):
        refuse_private_decisions(self._model)
        from keras_dpsgd.step._fed_data import OUTSIDE_FIT, check_fed_data  # imports the ledger: late

        check_fed_data(self._model, self._model.optimizer, outside_fit=OUTSIDE_FIT)
        return type(self._model).make_train_function(self._model, *args, **kwargs)


def watch_fits(model: Any) -> None:
    """Checks the running fit's callbacks now (the DP step is traced) and at every later fit of `model`."""
    if model is None:
        return
    refuse_private_decisions(model)
    if "make_train_function" not in vars(model):
        object.__setattr__(model, "make_train_function", _CheckedMakeTrainFunction(model))

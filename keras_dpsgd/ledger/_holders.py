"""The holders of the privacy ledger's state: string variables attached to the optimizer and to the model.

One JSON string (:mod:`keras_dpsgd.dp.ledger_state`) in a small ``tf.Module`` (:class:`LedgerState`; on Keras 3
a subclass its files keep), set as ``_dpsgd_ledger_state`` on the DP optimizer and on the model it trains: a
checkpoint dependency, never one of the model's weights. Also what tells a DP optimizer from a plain one and
reads its counter. The rest of the ledger's Keras I/O: :mod:`._bounds` (the worst case a ``.keras`` file keeps),
:mod:`._sync` (reading the counters into the state), :mod:`._plain_steps` (a plain optimizer's steps),
:mod:`._attach` (attaching the ledger to the model, the guards of its saves and compiles).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from keras_dpsgd.dp import ledger_state as S
from keras_dpsgd.dp.refusals import refuse


_STATE_ATTR = "_dpsgd_ledger_state"


class LedgerState(tf.Module):
    """Checkpointable record of the DP-SGD segments of a run.

    Holds one scalar string variable (``state``) with the JSON of a
    :mod:`keras_dpsgd.dp.ledger_state` state (its segments and the last step
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
        self._optimizer = None  # set on the optimizer's copy: returns the optimizer (a load sets its offset)

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


# What follows the load of a saved state into a DP optimizer's Keras 3 holder (``._attach``'s: the optimizer's
# ledger offset, and the model being loaded attached): above this module, so it registers itself here.
_ON_LOAD: list[Callable[[Any, dict], None]] = []


def on_load(hook: Callable[[Any, dict], None]) -> None:
    """Calls ``hook(optimizer, state)`` when a Keras 3 file's ledger state is loaded into `optimizer`'s holder."""
    if hook not in _ON_LOAD:
        _ON_LOAD.append(hook)


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
                    state = S.loads(raw.decode("utf-8"))  # refuses what is not a ledger state
                    self.state.assign(raw)
                    optimizer = self._optimizer() if self._optimizer is not None else None
                    if optimizer is not None:  # its offset; the model being loaded attached (._attach)
                        if not _ON_LOAD:  # keras_dpsgd.ledger registers it at import: never skipped silently
                            raise RuntimeError("keras_dpsgd.ledger._attach is not imported: the load cannot attach")
                        for hook in _ON_LOAD:
                            hook(optimizer, state)

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
            raise refuse(
                "foreign-ledger-state", f"{type(owner).__name__}.{_STATE_ATTR} must hold a string tf.Variable 'state'"
            )
        if not isinstance(holder, LedgerState):
            with tf.init_scope():
                revived, holder = holder, _holder_class(owner)()
                if revived is not None:
                    # Loaded from a SavedModel as a plain object: keep its state in a LedgerState,
                    # which refreshes itself at the next save.
                    holder.state.assign(revived.state)
                if is_dp_optimizer(owner):
                    holder._optimizer = weakref.ref(owner)
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


def is_dp_optimizer(optimizer: Any) -> bool:
    """True if `optimizer` counts noised steps (a keras_dpsgd DP optimizer)."""
    return optimizer is not None and hasattr(optimizer, "noised_steps")


def is_live_dp_optimizer(optimizer: Any) -> bool:
    """True for a DP optimizer whose steps the ledger can read (its counter and its σ_eff); False for a plain
    one and for the skeleton a tf_keras SavedModel loaded with ``compile=False`` revives (a
    ``RestoredOptimizer`` holding the counter only: the model's copy of the ledger holds its steps)."""
    return is_dp_optimizer(optimizer) and hasattr(optimizer, "effective_noise_multiplier")


def noised_steps(optimizer: Any) -> int:
    """The optimizer's count of noised steps (lots), as an int."""
    return int(optimizer.noised_steps.numpy())


def discard_partial_lot(optimizer: Any, where: str = "") -> int:
    """Drops `optimizer`'s incomplete lot, if it keeps one; returns its batches (0 if none).

    A discarded lot was never released (no noise drawn, no update): the
    ledger does not change (:func:`keras_dpsgd.dp.ledger_state.discard_partial_lot`).
    """
    discard = getattr(optimizer, "discard_partial_lot", None)
    return int(discard(where)) if discard is not None else 0


def write_ledger_offset(optimizer: Any, earlier: int) -> None:
    """Sets `optimizer`'s ledger offset: the releases its model's ledger recorded before its counter began.

    A seeded noise key is a function of (seed, offset + ``noised_steps``), the release's position in the
    model's ledger (``DPSettingsMixin._ledger_position``; the JAX step reads ``dp_ledger_offset``), so a
    new optimizer with the same seed continues the sequence of keys instead of repeating it (issue 37.4).
    Written at every sync of the ledger (each trace and fit of the DP step, every save and read) and when
    a saved ledger is loaded; an optimizer without the variable (not a keras_dpsgd one) is left alone.
    """
    variable = getattr(getattr(optimizer, "_dp", None), "ledger_offset", None)
    if variable is not None and int(variable.numpy()) != int(earlier):
        variable.assign(int(earlier))


def model_ledger_state(model: Any) -> Optional[dict]:
    """The state of the model's own copy of the ledger as saved, or None if the model holds none.

    A copy revived from a tf_keras SavedModel (a plain object holding the string variable) becomes a
    :class:`LedgerState` first, as at :func:`attach`.
    """
    if model is None or not isinstance(getattr(getattr(model, _STATE_ATTR, None), "state", None), tf.Variable):
        return None
    with tf.init_scope():
        return _read_state(ledger_state_holders(model, None)[0])

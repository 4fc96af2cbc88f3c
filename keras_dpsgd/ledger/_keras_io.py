"""The Keras I/O of the privacy ledger: the state holders and the save guards.

The string variables that hold the ledger's state (:mod:`keras_dpsgd.dp.ledger_state`), attached to the
optimizer and to the model; the optimizer's counter and saved worst-case bounds; the guards that
refuse a save which would lose the ledger; the fit sampling recorded on the optimizer. The public
queries are in :mod:`keras_dpsgd.ledger`, which re-exports what the other modules use from here.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from keras_dpsgd._frames import calling_frame
from keras_dpsgd.accounting import composed_noise_multiplier
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
                    state = S.loads(raw.decode("utf-8"))  # refuses what is not a ledger state
                    self.state.assign(raw)
                    optimizer = self._optimizer() if self._optimizer is not None else None
                    if optimizer is not None:  # the restored counter's position in the restored ledger
                        write_ledger_offset(optimizer, S.earlier_steps(state))
                        # The model being loaded (compile=True) keeps the history from now on: compiled again
                        # before any read or step, it still holds it (its copy keeps this optimizer alive).
                        model = saving_model(optimizer, max_depth=64)
                        if model is not None:
                            attach(model, optimizer, loading=True)

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


# Per model's copy of the ledger: each plain optimizer's `iterations` already written into it.
_PLAIN_RECORDED: "weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary]" = weakref.WeakKeyDictionary()


def _plain_recorded(model: Any) -> Any:
    holder = getattr(model, _STATE_ATTR, None)
    if not isinstance(holder, LedgerState):
        return {}
    return _PLAIN_RECORDED.setdefault(holder, weakref.WeakKeyDictionary())


def unrecorded_plain_steps(model: Any, optimizer: Any) -> int:
    """The steps of `model`'s plain (non-DP) `optimizer` not yet in the model's copy of the ledger; 0 for a DP one.

    All of its ``iterations`` when the copy holds none of them, or when the counter went back (reset).
    """
    if is_dp_optimizer(optimizer) or not hasattr(optimizer, "iterations"):
        return 0
    iterations = int(optimizer.iterations.numpy())
    recorded = _plain_recorded(model).get(optimizer, 0)
    return iterations - recorded if iterations >= recorded else iterations


def record_plain_steps(model: Any) -> None:
    """Writes the steps of `model`'s plain optimizer that its copy of the ledger lacks into it: noiseless, ε = ∞.

    Called before the model is compiled again (:func:`_guard_compiles`), when the optimizer is about to go out of
    sight. The last DP optimizer's steps are brought in first, so that the plain ones follow them
    (:func:`keras_dpsgd.dp.ledger_state.record_non_private`).
    """
    optimizer = getattr(model, "optimizer", None)
    holder = getattr(model, _STATE_ATTR, None)
    count = unrecorded_plain_steps(model, optimizer) if isinstance(holder, LedgerState) else 0
    if not count:
        return
    with tf.init_scope():
        trainer = ledger_trainer(model)
        if trainer is not None:
            _refresh(model, trainer)
        holder.state.assign(S.dumps(S.record_non_private(_read_state(holder), count)))
    _plain_recorded(model)[optimizer] = int(optimizer.iterations.numpy())


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
        return lambda shape, dtype=None: tf.fill(shape, tf.constant(value, dtype or "float64"))

    return [
        optimizer.add_variable(shape=(), dtype=_bound_dtype(optimizer), initializer=constant(value), name=name)
        for name, value in BOUND_VARIABLES
    ]


def _bound_dtype(optimizer: Any) -> str:
    """float64, or float32 on JAX without x64 (the ledger rounds it outward: :func:`_outward`)."""
    if is_keras3(optimizer):
        from keras_dpsgd import backends

        if backends.is_jax():
            import jax

            return "float64" if jax.config.jax_enable_x64 else "float32"
    return "float64"


def _bound_variables(optimizer: Any) -> Optional[tuple]:
    """The optimizer's (largest q, smallest σ) variables, or None if it has none."""
    q_max = getattr(optimizer, "ledger_max_sampling_rate", None)
    sigma_min = getattr(optimizer, "ledger_min_noise_multiplier", None)
    if all(hasattr(v, "assign") and hasattr(v, "numpy") for v in (q_max, sigma_min)):
        return q_max, sigma_min  # tf.Variables; Keras 3 variables on JAX
    return None


def _read_bounds(variables: Optional[tuple]) -> Optional[tuple]:
    return None if variables is None else tuple(float(v.numpy()) for v in variables)


def _outward(value: float, dtype: Any, up: bool) -> Any:
    """`value` in the variable's dtype, rounded away from an under-reported ε: q up, σ down.

    JAX without x64 keeps the float64 bounds in float32, whose nearest value may be a smaller q
    (or a larger σ) than the one charged.
    """
    if np.dtype(dtype) == np.float64 or not math.isfinite(value):
        return value
    rounded = np.float32(value)
    if (float(rounded) < value) if up else (float(rounded) > value):
        rounded = np.nextafter(rounded, np.float32(np.inf if up else -np.inf))
    return rounded


def _write_bounds(variables: Optional[tuple], values: Optional[tuple]) -> None:
    if variables is None:
        return
    for up, variable, value in zip((True, False), variables, values):
        value = _outward(value, getattr(variable.dtype, "as_numpy_dtype", variable.dtype), up)
        if float(variable.numpy()) != float(value):
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
    ledger does not change (:func:`keras_dpsgd.dp.ledger_state.discard_partial_lot`).
    """
    discard = getattr(optimizer, "discard_partial_lot", None)
    return int(discard(where)) if discard is not None else 0


def is_dp_optimizer(optimizer: Any) -> bool:
    """True if `optimizer` counts noised steps (a keras_dpsgd DP optimizer)."""
    return optimizer is not None and hasattr(optimizer, "noised_steps")


def noised_steps(optimizer: Any) -> int:
    """The optimizer's count of noised steps (lots), as an int."""
    return int(optimizer.noised_steps.numpy())


_FIT_SAMPLING_ATTR = "_dpsgd_fit_sampling"


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


def is_live_dp_optimizer(optimizer: Any) -> bool:
    """True for a DP optimizer whose steps the ledger can read (its counter and its σ_eff); False for a plain
    one and for the skeleton a tf_keras SavedModel loaded with ``compile=False`` revives (a
    ``RestoredOptimizer`` holding the counter only: the model's copy of the ledger holds its steps)."""
    return is_dp_optimizer(optimizer) and hasattr(optimizer, "effective_noise_multiplier")


def ledger_trainer(model: Any) -> Any:
    """The DP optimizer whose counter the model's ledger reads: ``model.optimizer`` if it is one, else the last
    DP optimizer attached to the model (its copy of the ledger keeps it alive: the model was compiled again with
    a plain optimizer), else None."""
    optimizer = getattr(model, "optimizer", None)
    if is_live_dp_optimizer(optimizer):
        return optimizer
    holder = getattr(model, _STATE_ATTR, None)
    trainer = getattr(holder, "_trainer", None)
    previous = trainer() if trainer is not None else None
    return previous if is_live_dp_optimizer(previous) else None


def model_ledger_state(model: Any) -> Optional[dict]:
    """The state of the model's own copy of the ledger as saved, or None if the model holds none.

    A copy revived from a tf_keras SavedModel (a plain object holding the string variable) becomes a
    :class:`LedgerState` first, as at :func:`attach`.
    """
    if model is None or not isinstance(getattr(getattr(model, _STATE_ATTR, None), "state", None), tf.Variable):
        return None
    with tf.init_scope():
        return _read_state(ledger_state_holders(model, None)[0])


def refresh_ledger_offset(model: Any, optimizer: Any) -> None:
    """Sets `optimizer`'s ledger offset from the ledger as it is now (no step counted): at each fit's start.

    A checkpoint restored between two fits of one compiled model (``load_weights``, ``tf.train.Checkpoint``)
    restores the counter and the ledger together, with no hook of ours: the offset is read again here.
    """
    holders = [getattr(o, _STATE_ATTR, None) for o in (optimizer, model)]
    holders = [h for h in holders if isinstance(h, LedgerState)]
    if holders and is_dp_optimizer(optimizer):
        with tf.init_scope():
            write_ledger_offset(optimizer, S.earlier_steps(S.merge(*[_read_state(h) for h in holders])))


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

    The I/O around :func:`keras_dpsgd.dp.ledger_state.advance`: of the two saved
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
            label=S.USER_LEVEL_LABEL if getattr(optimizer, "privacy_unit", None) == "user" else S.DPSGD_LABEL,
        )
        if bounds is not None:
            _write_bounds(bound_variables, S.fold_bounds(data, bounds))
        write_ledger_offset(optimizer, S.earlier_steps(data))
        encoded = S.dumps(data)
        for holder, old in zip(holders, raw):
            if old.decode("utf-8") != encoded:
                holder.state.assign(encoded)
    return data

"""Keras callbacks that report and bound the privacy spent by DP-SGD training.

* :class:`PrivacyLogger` writes ``epsilon`` and ``delta`` into the epoch logs,
  so they show in the progress bar, in ``History`` and in the TensorBoard
  callback, wherever it is listed in ``callbacks=`` (at the start of fit it
  moves itself ahead of the other callbacks).
* :class:`WithinLimit` stops training as soon as the next step would take ε
  above the target: Abadi et al. (2016)'s ``while within_limit`` loop. It
  counts every event in the model's ledger (e.g. DP-PCA) and stops mid-epoch.

Both read the model's ledger (:func:`keras_dpsgd.ledger.model_privacy_ledger`),
which is checkpointed with the optimizer, so a resumed run continues ε.
ε assumes Poisson sampling of the lots: see :mod:`keras_dpsgd.step.lots`.

The same classes serve both Kerases, and this module does not import tf_keras: each is a
``keras.callbacks.Callback`` (Keras 3) that also speaks the protocol tf_keras's ``CallbackList``
reads (``_implements_*_batch_hooks``, ``_supports_tf_logs``, ``_chief_worker_only``; tf_keras checks
no base class), and dispatches on the Keras of the model it is given (a Keras 3 model made private
with :func:`keras_dpsgd.keras3.make_private`, or a tf_keras model). The classes are fixed at
import: importing tf_keras before or after changes nothing.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import keras

from keras_dpsgd import _validate
from keras_dpsgd.ledger import (
    accumulation_steps,
    attach,
    fit_frame,
    fit_training_size,
    is_dp_optimizer,
    model_epsilon,
    recorded_sampling_rate,
    resolve_num_examples,
    resolve_sampling_rate,
    steps_remaining,
    sync_ledger_state,
)
from keras_dpsgd.step.fed_data import check_fed_data
from keras_dpsgd.dp.refusals import refuse

__all__ = ["PrivacyLogger", "WithinLimit"]


def _check_training_size(model: Any, optimizer: Any, num_examples: Optional[int]) -> None:
    """Refuses an N larger than fit's training set (validation_split): q = B/N would be too small.

    Only where q is derived from N (the optimizer's sampling_rate unknown).
    """
    if num_examples is None or getattr(optimizer, "sampling_rate", None) is not None:
        return
    frame = fit_frame(model)
    split = frame.f_locals.get("validation_split") if frame is not None else None
    if not split:
        return
    n_train = fit_training_size(frame)
    if n_train is None:
        raise refuse(
            "num-examples-above-split",
            f"validation_split={split!r} with num_examples={num_examples}: the size of the training split "
            "is unknown, so epsilon cannot be computed at q = B/N_train; split the data yourself and pass "
            "num_examples = the training set's size",
        )
    if num_examples > n_train:
        raise refuse(
            "num-examples-above-split",
            f"num_examples must be the size of the training set, at most {n_train} with "
            f"validation_split={split!r}, got num_examples={num_examples}: epsilon at q = B/N of the full "
            f"data is under-reported; pass num_examples={n_train}",
        )


def is_keras3_model(model: Any) -> bool:
    """True for a Keras 3 model (``keras.Model``), False for a tf_keras one."""
    return isinstance(model, keras.Model)


# tf_keras's CallbackList asks each callback which batch hooks it implements (it calls and times only those).
_BATCH_HOOKS = {
    "train": ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end"),
    "test": ("on_test_batch_begin", "on_test_batch_end"),
    "predict": ("on_predict_batch_begin", "on_predict_batch_end"),
}


class _PrivacyCallback(keras.callbacks.Callback):
    """A callback for both Kerases: Keras 3's base, plus what tf_keras's CallbackList reads of a callback."""

    def __init__(self, target_delta, num_examples, batch_size, extra_events, accountant):
        super().__init__()
        self.validation_data = None
        self._chief_worker_only = None
        self._supports_tf_logs = False
        self.target_delta = target_delta
        self.num_examples = None if num_examples is None else _validate.integer_at_least(1, num_examples=num_examples)
        self.batch_size = None if batch_size is None else _validate.integer_at_least(1, batch_size=batch_size)
        self.extra_events = tuple(extra_events)
        self.accountant = accountant

    def _optimizer(self):
        optimizer = getattr(self.model, "optimizer", None)
        if not is_dp_optimizer(optimizer):
            raise refuse(
                "callback-plain-optimizer",
                f"{type(self).__name__} needs a keras_dpsgd DP optimizer (one with noised_steps), got "
                f"{type(optimizer).__name__}: the model was compiled with a plain optimizer. After "
                "run = make_private_with_epsilon(...), compile with run.optimizer "
                "(run.model.compile(optimizer=run.optimizer, ...)); else make the optimizer private "
                "(keras_dpsgd.keras3.DPSGDOptimizer, keras_dpsgd.tf_keras.DPSGDOptimizer)",
            )
        return optimizer

    def _begin(self):
        """on_train_begin: checks N against fit's training set and attaches the ledger.

        Attaching now (not at the first read, an epoch later) applies a
        checkpoint restored by an earlier callback (BackupAndRestore) while
        its file still exists.
        """
        optimizer = self._optimizer()
        _check_training_size(self.model, optimizer, self.num_examples)
        check_fed_data(self.model, optimizer)  # the rate of the lots fit is fed, or a refusal
        attach(self.model, optimizer)
        # Before the first step: q must resolve (never an error after training).
        resolve_sampling_rate(optimizer, num_examples=self.num_examples, batch_size=self.batch_size)
        return optimizer

    def _epsilon(self) -> tuple[float, float]:
        return model_epsilon(
            self.model,
            target_delta=self.target_delta,
            num_examples=self.num_examples,
            batch_size=self.batch_size,
            extra_events=self.extra_events,
            accountant=self.accountant,
        )

    # tf_keras's callback protocol (``tf_keras.callbacks.Callback`` has these; Keras 3's does not).
    def _implements_hooks(self, kind: str) -> bool:
        """Whether this class overrides one of Keras's `kind` ("train", "test", "predict") batch hooks."""
        base = keras.callbacks.Callback
        return any(getattr(type(self), hook) is not getattr(base, hook) for hook in _BATCH_HOOKS[kind])

    def _implements_train_batch_hooks(self) -> bool:
        return self._implements_hooks("train")

    def _implements_test_batch_hooks(self) -> bool:
        return self._implements_hooks("test")

    def _implements_predict_batch_hooks(self) -> bool:
        return self._implements_hooks("predict")


class PrivacyLogger(_PrivacyCallback):
    """Writes the privacy spent so far, ``epsilon`` and ``delta``, into the epoch logs.

    ε is computed by the accountant over the model's whole ledger (every
    DP-SGD step since the start, resumed runs included, plus layer events
    such as DP-PCA) for δ = `target_delta`.

    Args:
      target_delta: δ; default min(1/N^1.1, 1/(10·N)) , announced once.
        δ >= 1/N is refused.
      num_examples: N; needed when the optimizer is not configured by
        ``PoissonLots.configure`` (which tells N through q and L).
      batch_size: the ``batch_size`` given to fit, used only when the
        optimizer's sampling_rate is unknown (then q = B/N, and a warning says
        that ε assumes Poisson sampling).
      extra_events: privacy events of data accesses outside the model (e.g.
        a DP-PCA layer applied to the data before fit); layers inside the
        model are found on their own.
      accountant: "rdp" (default), "moments" or "pld".
    """

    def __init__(
        self,
        target_delta: Optional[float] = None,
        *,
        num_examples: Optional[int] = None,
        batch_size: Optional[int] = None,
        extra_events: Iterable = (),
        accountant: str = "rdp",
    ):
        super().__init__(target_delta, num_examples, batch_size, extra_events, accountant)
        self.epsilon: Optional[float] = None
        self.delta: Optional[float] = None

    def on_train_begin(self, logs=None):
        self._begin()
        _run_first(self.model)

    def on_epoch_end(self, epoch, logs=None):
        self.epsilon, self.delta = self._epsilon()
        if logs is not None:
            logs["epsilon"] = self.epsilon
            logs["delta"] = self.delta


def _run_first(model: Any) -> None:
    """Puts the PrivacyLoggers first in the running fit's callback list (their order kept).

    Callbacks see the epoch logs in list order, and TensorBoard writes them in its own
    ``on_epoch_end``: a logger listed after it added ε too late. Called from ``on_train_begin``;
    the list is replaced, not changed in place, so the call that is running goes on as it was.
    """
    frame = fit_frame(model)
    callback_list = frame.f_locals.get("callbacks") if frame is not None else None
    listed = getattr(callback_list, "callbacks", None)
    if isinstance(listed, list):
        loggers = [c for c in listed if isinstance(c, PrivacyLogger)]
        callback_list.callbacks = loggers + [c for c in listed if not isinstance(c, PrivacyLogger)]


class WithinLimit(_PrivacyCallback):
    """Stops training before the step that would take ε above `target_epsilon`.

    At the start of every epoch (after restores done in
    ``on_train_begin``, e.g. by BackupAndRestore) and whenever q or σ_eff
    changes, it asks the accountant how many more steps fit in the budget
    given everything already in the model's ledger (:func:`steps_remaining`);
    after every batch it counts the optimizer's noised steps against that.
    Training stops as soon as the next step would not fit, so the final
    ε <= target_epsilon while one more step would exceed it (Abadi et al.
    2016, Algorithm 1 run "while within_limit"). It stops mid-epoch. If no
    step fits at the start, fit takes no step at all (the first batch runs a
    no-op in place of the train step).

    ``steps_per_execution`` = s > 1 (Keras runs s batches between callbacks):

    * Keras 3: exact. When fewer than s steps remain, the last execution runs
      exactly the remaining steps (a train function rebuilt once for them).
    * tf_keras: exact when s is a multiple of the gradient accumulation steps
      k (every execution starts a lot): the last execution runs the remaining
      lots' batches (the way tf_keras runs a short last execution of an epoch).
      Otherwise training stops when fewer than ceil(s / k) noised steps
      remain: the budget still holds, but a few affordable steps may be left
      unused.

    Args:
      target_epsilon: the budget ε > 0.
      target_delta: δ; default min(1/N^1.1, 1/(10·N)), announced once. δ >= 1/N is refused.
      num_examples: as for :class:`PrivacyLogger`.
      batch_size: as for :class:`PrivacyLogger`.
      extra_events: as for :class:`PrivacyLogger`.
      accountant: as for :class:`PrivacyLogger`.
      verbose: print a line when training is stopped.

    Attributes:
      stopped: True once this callback stopped a fit.
      remaining: steps still within the budget after the last check.
    """

    def __init__(
        self,
        target_epsilon: float,
        target_delta: Optional[float] = None,
        *,
        num_examples: Optional[int] = None,
        batch_size: Optional[int] = None,
        extra_events: Iterable = (),
        accountant: str = "rdp",
        verbose: int = 1,
    ):
        super().__init__(target_delta, num_examples, batch_size, extra_events, accountant)
        self.target_epsilon = _validate.in_range(0, math.inf, "(]", target_epsilon=target_epsilon)
        self.verbose = verbose
        self.stopped = False
        self.remaining: Optional[int] = None
        self._replaced: Optional[dict] = None  # what the last call swapped out (restored after it)
        self._params: Optional[tuple[float, float]] = None

    # ---------------------------------------------------------- bookkeeping
    def _current_params(self, optimizer) -> tuple[Optional[float], float]:
        """(q as the optimizer knows it, None if unknown; σ_eff); checks that q resolves."""
        n = resolve_num_examples(optimizer, self.num_examples)
        resolve_sampling_rate(optimizer, num_examples=n, batch_size=self.batch_size)
        return recorded_sampling_rate(optimizer), float(optimizer.effective_noise_multiplier)

    def _recompute_budget(self, optimizer) -> None:
        self._params = self._current_params(optimizer)
        self._budget = steps_remaining(
            self.model,
            target_epsilon=self.target_epsilon,
            target_delta=self.target_delta,
            num_examples=self.num_examples,
            batch_size=self.batch_size,
            extra_events=self.extra_events,
            accountant=self.accountant,
        )
        self._budget_start = int(optimizer.noised_steps.numpy())
        self._last_steps = self._budget_start
        self.remaining = self._budget

    def _steps_per_execution(self) -> int:
        if is_keras3_model(self.model):
            return int(self.model.steps_per_execution)
        spe = getattr(self.model, "_steps_per_execution", None)
        return int(spe.numpy()) if spe is not None else 1

    def _can_cut_calls(self, optimizer) -> bool:
        """True where a call can be cut to the steps that remain: Keras 3, or tf_keras with s % k == 0."""
        return is_keras3_model(self.model) or self._steps_per_execution() % accumulation_steps(optimizer) == 0

    def _steps_needed_per_call(self, optimizer) -> int:
        """Fewest noised steps the next call may take: 1 where the last call is cut to fit."""
        if self._can_cut_calls(optimizer):
            return 1
        return max(1, math.ceil(self._steps_per_execution() / accumulation_steps(optimizer)))

    def _stop(self) -> None:
        self.model.stop_training = True
        self.stopped = True
        if self.verbose:
            eps, delta = self._epsilon()
            print(
                f"WithinLimit: stopping training at epsilon = {eps:.4g} (delta = {delta:.3g}); one more "
                f"step would exceed the target epsilon = {self.target_epsilon:g}."
            )

    # ------------------------------------------------- the next call's steps
    def _skip_next_call(self) -> None:
        """Keras runs the next call even if stop_training is set now: a no-op step for it."""
        model = self.model

        def _skip_step(*args):
            if len(args) == 2:  # Keras 3 on JAX: train_function(state, iterator) -> (logs, state)
                return {}, args[0]
            return model.get_metrics_result()

        self._replaced = {"train_function": model.train_function}
        model.train_function = _skip_step

    def _shorten_next_call(self, batches: int) -> None:
        """The next call runs exactly `batches` (< steps_per_execution) batches."""
        model = self.model
        if is_keras3_model(model):
            self._replaced = {"train_function": model.train_function, "steps_per_execution": model.steps_per_execution}
            model.steps_per_execution = batches
            model.make_train_function(force=True)
        else:  # tf_keras's multi-step function reads this variable at run time
            variable = model._steps_per_execution
            self._replaced = {"spe_variable": int(variable.numpy())}
            variable.assign(batches)

    def _restore(self) -> bool:
        """Puts back what the last call swapped out; True if it did."""
        if self._replaced is None:
            return False
        replaced, self._replaced = self._replaced, None
        if "spe_variable" in replaced:
            self.model._steps_per_execution.assign(replaced["spe_variable"])
        if "steps_per_execution" in replaced:
            self.model.steps_per_execution = replaced["steps_per_execution"]
        if "train_function" in replaced:
            self.model.train_function = replaced["train_function"]
        return True

    # ------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None):
        self._begin()
        self.stopped = False
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        # Recomputed at the start of each epoch, after every callback's on_train_begin
        # (BackupAndRestore restores the ledger there), not in a batch hook: tf_keras
        # times those against the batch and warns when they are slow.
        self._epoch = epoch
        optimizer = self._optimizer()
        self._recompute_budget(optimizer)
        if self.remaining < self._steps_needed_per_call(optimizer):
            self._skip_next_call()
            self._stop()

    def on_train_batch_begin(self, batch, logs=None):
        optimizer = self._optimizer()
        if self._replaced is not None:
            return  # the no-op call after a stop
        if self._can_cut_calls(optimizer):
            batches = self.remaining * (1 if is_keras3_model(self.model) else accumulation_steps(optimizer))
            if 0 < batches < self._steps_per_execution():
                self._shorten_next_call(batches)

    def on_train_batch_end(self, batch, logs=None):
        if self._restore() and self.model.stop_training:
            return  # the no-op call after a stop
        optimizer = self.model.optimizer
        params = self._current_params(optimizer)
        if params != self._params:
            # Record the steps seen under the old (q, σ), then re-plan (the
            # steps since then are charged at the worst case of both).
            sync_ledger_state(self.model, *self._params, steps=self._last_steps)
            self._recompute_budget(optimizer)
        else:
            self._last_steps = int(optimizer.noised_steps.numpy())
            self.remaining = self._budget - (self._last_steps - self._budget_start)
        if self.remaining < self._steps_needed_per_call(optimizer) and not self._planned_end(batch):
            self._stop()

    def _planned_end(self, batch: int) -> bool:
        """True after the last batch fit planned: the budget ran out exactly there, nothing is stopped."""
        params = self.params or {}
        steps, epochs = params.get("steps"), params.get("epochs")
        return steps is not None and epochs is not None and batch + 1 >= steps and self._epoch + 1 >= epochs

    def on_epoch_end(self, epoch, logs=None):
        # Keep the saved copy of the ledger current (counts come from
        # noised_steps anyway; this narrows the window of a later (q, σ) change).
        if self._params is not None:
            sync_ledger_state(self.model, *self._params)

    def on_train_end(self, logs=None):
        self._restore()

"""The lot/release state machine of a private optimizer: one definition for both Kerases.

A private optimizer (tf_keras: ``keras_dpsgd.tf_keras._sanitizer.DPSanitizerMixin``; Keras 3:
``keras_dpsgd.keras3._optimizer.DPKeras3Mixin``) runs Abadi et al. 2016, Algorithm 1 on lots:

1-3. per-example gradients, clip, sum: ``_clipped_sum`` (through the per-example backend);
     with ``gradient_accumulation_steps`` = k > 1 the clipped sums of k batches are accumulated
     (``_take_batch``);
4-5. release, once per lot: noise N(0, σ_v² C_v²), divide by L (``add_noise``, ``normalize``:
     ``DPSettingsMixin``), count the step (``noised_steps``, hook ``on_noised_step``), add the
     regularization gradient (data-independent: no clip, no noise), mark the result as the only
     gradients the optimizer may apply (``_release``);
6.   apply the descent rule (post-processing), then start a new lot (``_reset_lot``).

An incomplete lot is never released nor carried into another lot: it is discarded
(``discard_partial_lot``) at every epoch start of ``fit``, at its end, before its first step and
on load (the rule is in ``keras_dpsgd.tf_keras._sanitizer``'s docstring, "Lots").

Under R > 1 replicas a lot is released with one cross-replica sum per batch
(``_release_lot_across_replicas``: noise σC/√R on the lot's last batch, zeros on the others; the
descent rule gated to the last batch by the front end).

Everything here runs inside the traced train step as TensorFlow ops (both front ends run on
TensorFlow). The front end supplies its hooks:

- ``_value(variable)``: an optimizer variable's value as a tensor;
- ``_bounds_variable(bounds)``: makes the saved ``clip_bounds`` variable;
- ``_apply_release(grads, variables)``: the descent rule on a release;
- ``_apply_lot_across_replicas(grads, tf_vars, complete)``: the same under R > 1, gated to a lot's end;
- ``_count_replica_lot(num_examples)``: what of the step count runs inside the lot's conditional
  under R > 1 (default: all of it, ``_count_release``);
- ``_fit_steps_per_epoch(model)``, ``_first_epoch_of_fit(model)``, ``_first_step_of_fit(model)``:
  what the running ``fit`` of `model` says (its own locals differ between the Kerases).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import tensorflow as tf

from keras_dpsgd import ledger
from keras_dpsgd.step import distribute as _distribute, _math as _step
from keras_dpsgd.step.fed_data import check_fed_data
from keras_dpsgd.step.settings import DPSettingsMixin

_LOG = logging.getLogger("keras_dpsgd")


class _EpochBoundary:
    """`model.reset_metrics`, which Keras fit calls at the start of every epoch.

    Installed by the DP optimizer on the model it trains (an instance
    attribute): when the call comes from ``fit``, the optimizer first closes
    the lot boundary (``_on_fit_epoch_begin``). Other callers (evaluate,
    train_on_batch) only reset the metrics.
    """

    def __init__(self, model: Any):
        self._model = model

    def __call__(self) -> None:
        model = self._model
        hook = getattr(model.optimizer, "_on_fit_epoch_begin", None)
        if hook is not None and ledger.fit_frame(model, max_depth=2) is not None:
            hook(model)
        return type(model).reset_metrics(model)


def resolve_bounds(l2_norm_clip: Any, names: Sequence[str]) -> list[float]:
    """One clip bound per trainable variable, in the order of `names` (the variables' names).

    None (per-example normalization): 1, the sensitivity of an example rescaled to norm < 1.
    """
    num = len(names)
    if l2_norm_clip is None:
        return [1.0] * num
    if isinstance(l2_norm_clip, float):
        return [l2_norm_clip] * num
    if isinstance(l2_norm_clip, list):
        if len(l2_norm_clip) != num:
            raise ValueError(
                f"l2_norm_clip must have one bound per trainable variable ({num}: "
                f"{list(names)}), got {len(l2_norm_clip)}"
            )
        return list(l2_norm_clip)
    names = list(names)
    keys = {}
    for name in names:
        short = name[:-2] if name.endswith(":0") else name
        key = name if name in l2_norm_clip else short
        if key not in l2_norm_clip:
            raise ValueError(
                f"l2_norm_clip has no bound for trainable variable {short!r}; keys: {sorted(l2_norm_clip)}"
            )
        keys[key] = True
    extra = sorted(set(l2_norm_clip) - set(keys))
    if extra:
        raise ValueError(
            f"l2_norm_clip names variables that are not trainable variables of the model: {extra}; variables: {names}"
        )
    return [l2_norm_clip[n] if n in l2_norm_clip else l2_norm_clip[n[:-2]] for n in names]


class LotReleaseMixin(DPSettingsMixin):
    """The lots and releases of a private optimizer (module docstring); the front end's mixin
    derives from it and supplies the hooks."""

    # --------------------------------------------------------- front-end hooks
    def _value(self, variable: Any) -> tf.Tensor:
        """The value of one of this optimizer's variables, as a tensor."""
        raise NotImplementedError

    def _bounds_variable(self, bounds: list[float]) -> Any:
        """Makes the saved ``clip_bounds`` variable, holding `bounds`."""
        raise NotImplementedError

    def _apply_release(self, grads: list[tf.Tensor], variables: Sequence[Any]) -> None:
        """Applies the descent rule to a release (`grads` came out of ``_release``)."""
        raise NotImplementedError

    def _apply_lot_across_replicas(self, grads: list[tf.Tensor], tf_vars: list, complete: tf.Tensor) -> None:
        """Under R > 1: the cross-replica sum of `grads` (every batch), the descent rule on a lot's end only."""
        raise NotImplementedError

    def _fit_steps_per_epoch(self, model: Any) -> int | None:
        """The steps per epoch of `model`'s running fit, or None."""
        raise NotImplementedError

    def _first_epoch_of_fit(self, model: Any) -> bool:
        """At an epoch's start: True for the first epoch of this fit."""
        raise NotImplementedError

    def _first_step_of_fit(self, model: Any) -> bool:
        """At trace time: True when the step is traced for the first step of `model`'s fit."""
        raise NotImplementedError

    # ------------------------------------------------------------------ setup
    def _build_lot(self, variables: Sequence[Any], names: Sequence[str]) -> None:
        """The step's variables, once the trainable `variables` (called `names`) are known: σ and C
        of each variable (``clip_bounds``, saved), and with k > 1 the lot being accumulated (saved;
        discarded on load, never resumed). Made in this order (the saved layout)."""
        bounds = resolve_bounds(self._dp.l2_norm_clip, names)
        sigmas = self._dp.noise_multiplier
        self._dp.sigmas = list(sigmas) if isinstance(sigmas, list) else [sigmas] * len(variables)
        self.clip_bounds = self._bounds_variable(bounds)
        if self._dp.accumulation > 1:
            self._accumulators = [self.add_variable_from_reference(v, "dp_accumulator") for v in variables]
            self._accum_batches = self.add_variable((), dtype="int64", name="dp_accumulated_batches")
            self._accum_examples = self.add_variable((), dtype="float32", name="dp_accumulated_examples")

    # ------------------------------------------------------------------- lots
    def discard_partial_lot(self, where: str = "") -> int:
        """Drops an incomplete lot (never released, no privacy spent); returns its batches.

        Counted in ``discarded_lots``/``discarded_batches`` and announced by a
        warning. Keras ``fit`` calls it at lot boundaries on its own.
        """
        if getattr(self, "_accum_batches", None) is None:
            return 0
        with tf.init_scope():
            batches = int(self._accum_batches.numpy())
            if batches == 0:
                return 0
            for acc in self._accumulators:
                acc.assign(tf.zeros_like(acc))
            self._accum_examples.assign(0.0)
            self._accum_batches.assign(0)
        self.discarded_lots += 1
        self.discarded_batches += batches
        _LOG.warning(
            "keras_dpsgd: discarded an incomplete lot (%d of %d batches) %s: it was never released "
            "(no noise drawn, no update applied) and is not carried into another lot.",
            batches,
            self._dp.accumulation,
            where,
        )
        return batches

    def _check_lot_alignment(self, model: Any) -> None:
        """With Poisson lots (known q), fit's steps_per_epoch must hold whole lots."""
        k = self._dp.accumulation
        steps = self._fit_steps_per_epoch(model)
        if self._dp.sampling_rate is not None and steps is not None and steps % k:
            raise ValueError(
                f"steps_per_epoch must be a multiple of gradient_accumulation_steps = {k} when the "
                f"sampling rate is known (Poisson lots), got {steps}: the incomplete lot at the end of "
                "every epoch would be discarded and shift every later lot of the stream; pass "
                "steps_per_epoch=lots.steps_per_epoch"
            )

    def _on_fit_epoch_begin(self, model: Any) -> None:
        """Called by fit at the start of every epoch (see `_watch_lot_boundaries`)."""
        check_fed_data(model, self)  # a later fit may feed other lots (or another q = B·k/N)
        self._check_lot_alignment(model)
        if self._first_epoch_of_fit(model):
            self.discard_partial_lot("left before this fit (interrupted, or restored mid-lot)")
            return
        if self.discard_partial_lot("at the end of an epoch") and self._dp.sampling_rate is not None:
            raise ValueError(
                "an epoch of fit ended inside a lot while the sampling rate is known (Poisson lots): "
                "the lots no longer align with the Poisson stream. Use steps_per_epoch=lots.steps_per_epoch "
                "and save BackupAndRestore checkpoints at epoch ends or every multiple of "
                f"gradient_accumulation_steps = {self._dp.accumulation} batches"
            )

    def _watch_lot_boundaries(self, model: Any, check_data: bool = True) -> None:
        """At trace time: the data fit feeds the step (``_fed_data.check_fed_data``, again at every
        epoch start; `check_data` False before fit runs, where there is no fit to read), and lots of
        `model`'s fit never cross an epoch or a fit."""
        if model is None:
            return
        if check_data:
            check_fed_data(model, self, outside_fit=True)
        if "reset_metrics" not in vars(model):
            object.__setattr__(model, "reset_metrics", _EpochBoundary(model))
        if self._dp.accumulation == 1:
            return
        self._check_lot_alignment(model)
        if self._first_step_of_fit(model):
            self.discard_partial_lot("left before this fit (interrupted, or restored mid-lot)")

    def finalize_variable_values(self, var_list):
        """Called by fit at its end: an incomplete last lot is discarded."""
        self.discard_partial_lot("at the end of fit")
        return super().finalize_variable_values(var_list)

    # ------------------------------------------------------ steps 1-3 of a batch
    def _clipped_sum(self, loss: tf.Tensor, tf_vars: list, tape: Any, model: Any) -> tuple[list, tf.Tensor]:
        """Steps 1-3 through the backend: Σ_i clip(g_i) of one batch, and the lot's realized size.

        Checks at trace time what data reach the step (``_fed_data.check_fed_data``: the rate of the
        fed lots, or a refusal; a custom loop with a Poisson rate is refused) and that the step writes no
        value of the batch outside the optimizer (``_refuse_batch_writes``); counts the examples zeroed for a non-finite gradient; calls
        the hook ``on_per_example_sq_norms``.
        """
        finite = []  # The non-finite mask, computed once from the backend's sq_norms.

        def factors(sq_norms):
            finite.append(_step.finite_rows(sq_norms))
            return self._clip_factors(sq_norms, finite[-1])

        check_fed_data(model, self, outside_fit=True)  # At trace time: a custom loop too (model None).
        summed, sq_norms = self._backend.clipped_sum(loss, tf_vars, tape, factors)
        self._refuse_batch_writes(loss, model)  # At trace time.
        nonfinite = tf.logical_not(finite[-1][:, 0])
        self.nonfinite_examples.assign_add(tf.reduce_sum(tf.cast(nonfinite, tf.int64)))
        self.on_per_example_sq_norms(sq_norms)
        # The lot's realized size over all replicas (one scalar all-reduce under a strategy).
        return summed, _distribute.global_sum(tf.cast(tf.shape(loss)[0], tf.float32))

    # ---------------------------------------------------- the lot's state machine
    def _take_batch(self, summed, num_examples, reg_grads, tf_vars: list, variables: Sequence[Any]) -> None:
        """One batch of a lot (k > 1): accumulates its clipped sum; on the lot's k-th batch,
        releases the lot (steps 4-5, once), applies it and starts a new lot."""
        for acc, s in zip(self._accumulators, summed):
            acc.assign_add(tf.cast(s, acc.dtype))
        self._accum_examples.assign_add(num_examples)
        self._accum_batches.assign_add(1)
        if _distribute.num_replicas() > 1:
            self._release_lot_across_replicas(tf_vars, reg_grads)
            return

        def release_lot():
            lot = self._release(self._lot_sums(), self._value(self._accum_examples), reg_grads, tf_vars)
            self._apply_release(lot, variables)
            return self._reset_lot()

        tf.cond(self._lot_complete(), release_lot, lambda: tf.constant(False))

    def _lot_sums(self) -> list[tf.Tensor]:
        """The accumulated clipped sums of the lot (this replica's share under a strategy)."""
        return [tf.cast(self._value(acc), tf.float32) for acc in self._accumulators]

    def _lot_complete(self) -> tf.Tensor:
        """True on the last batch of a lot (the same on every replica: each counts the batches)."""
        return self._value(self._accum_batches) >= self._dp.accumulation

    def _reset_lot(self) -> tf.Tensor:
        for acc in self._accumulators:
            acc.assign(tf.zeros_like(self._value(acc)))
        self._accum_examples.assign(0.0)
        self._accum_batches.assign(0)
        return tf.constant(True)

    def _release_lot_across_replicas(self, tf_vars: list, reg_grads) -> None:
        """Gradient accumulation under R > 1 replicas: one noise draw per global lot.

        The cross-replica sum is a synchronization point, which tf.distribute cannot run inside a
        ``tf.cond``: so every batch goes through it. Each replica holds its own partial sums and,
        on the lot's last batch only, releases them noised by σC/√R and divided by the global L
        (``_noised``, inside the conditional, with no synchronization); on other batches it
        contributes zeros. The front end applies the descent rule (and counts what synchronizes)
        on the last batch only (``_apply_lot_across_replicas``). The cost: one gradient all-reduce
        per batch instead of one per lot.
        """
        complete = self._lot_complete()

        def noised():
            lot, examples = self._lot_sums(), self._value(self._accum_examples)
            return self._noised(lot, examples, reg_grads, tf_vars, self._count_replica_lot)

        grads = tf.cond(complete, noised, lambda: [tf.zeros_like(v) for v in tf_vars])
        self._apply_lot_across_replicas(list(grads), tf_vars, complete)
        tf.cond(complete, self._reset_lot, lambda: tf.constant(False))

    # ------------------------------------------------------ steps 4-5 of a lot
    def _release(self, summed, num_examples, reg_grads, tf_vars: list) -> list[tf.Tensor]:
        """Steps 4-5, counted (``noised_steps``, hook ``on_noised_step``), pending for the apply."""
        return self._pending(self._noised(summed, num_examples, reg_grads, tf_vars, self._count_release))

    def _noised(self, summed, num_examples, reg_grads, tf_vars: list, count: Callable) -> list[tf.Tensor]:
        """Steps 4-5 on a lot's clipped sum (hooks ``add_noise``, ``normalize``), `count`ed, then the
        regularization gradient (no clip, no noise; computed identically on every replica, so each
        adds its 1/R share), in the variables' dtypes."""
        grads = self.normalize(self.add_noise(summed), num_examples)
        count(num_examples)
        if reg_grads is not None:
            grads = [g + tf.cast(_distribute.replica_share(r), g.dtype) for g, r in zip(grads, reg_grads)]
        return [tf.cast(g, v.dtype) for g, v in zip(grads, tf_vars)]

    def _count_release(self, num_examples: tf.Tensor) -> None:
        """A noised step: ``noised_steps`` + 1, then the hook ``on_noised_step``."""
        self.noised_steps.assign_add(1)
        self.on_noised_step(num_examples)

    def _count_replica_lot(self, num_examples: tf.Tensor) -> None:
        """Under R > 1, inside the lot's conditional: the count where it needs no synchronization."""
        self._count_release(num_examples)

    def _pending(self, grads: list[tf.Tensor]) -> list[tf.Tensor]:
        """Marks `grads` as the sanitized gradients the next apply may apply."""
        self._dp.pending[:] = grads
        return grads

    def _take_pending(self, grads: Sequence[Any], message: str) -> None:
        """Refuses a gradient that is not of the last release (a non-private step); clears the release."""
        pending = self._dp.pending
        for grad in grads:
            if grad is not None and not any(grad is g for g in pending):
                raise ValueError(message)
        del pending[:]

    # ------------------------------------------------ hooks for subclasses
    # Published extension points, the same on both Kerases: adaptive clipping and gradient canaries
    # use them. Anything a hook derives from the data is a release of its own, which must be noised
    # and charged (``release_noise_multipliers``). Steps 4-5 (``add_noise``, ``normalize``,
    # ``standard_normal``) are overridable too: ``DPSettingsMixin``.
    def on_per_example_sq_norms(self, sq_norms: tf.Tensor) -> None:
        """Hook: called once per batch (every batch of a lot) inside the traced step with
        ``sq_norms[i, v] = ||g_i[v]||²`` ([B, V]); the clip bounds in force are ``self.clip_bounds``.
        Whatever is derived from them is a release of its own that must be noised and recorded by
        the accountant. Default: nothing."""

    def on_noised_step(self, num_examples: tf.Tensor) -> None:
        """Hook: called once per noised step (once per lot), after the gradient's release and the
        ``noised_steps`` increment, with the lot's realized number of examples. Default: nothing."""

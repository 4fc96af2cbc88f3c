"""The lots and releases of a private optimizer on TensorFlow: one definition for both Kerases.

A private optimizer (tf_keras: ``keras_dpsgd.tf_keras._sanitizer.DPSanitizerMixin``; Keras 3:
``keras_dpsgd.keras3._optimizer.DPKeras3Mixin``) runs Abadi et al. 2016, Algorithm 1 on lots through the
DP core, ``keras_dpsgd.dp.step.private_step`` (``_private_step``): per-example gradients and clipped sum
from the per-example backend, clip factors, the lot of k batches (``keras_dpsgd.dp.lot``), noise and
normalization (the overridable hooks ``add_noise``, ``normalize`` of ``DPSettingsMixin``, over
``keras_dpsgd.dp.release``), the count (``noised_steps``, hook ``on_noised_step``). What is TensorFlow's
is here (:class:`_TFFront`): the lot in the optimizer's variables, ``tf.cond``, the regularization gradient
(data-independent: no clip, no noise), the release marked as the only gradients the optimizer may apply
(``_pending``), the descent rule (post-processing), tf.distribute.

An incomplete lot is never released nor carried into another lot: it is discarded
(``discard_partial_lot``) at every epoch start of ``fit``, at its end, before its first step and
on load (the rule is in ``keras_dpsgd.tf_keras._sanitizer``'s docstring, "Lots").

Under R > 1 replicas a lot is released with one cross-replica sum per batch
(``_TFFront.when_complete``: noise σC/√R on the lot's last batch, zeros on the others; the
descent rule gated to the last batch by the front end).

Everything here runs inside the traced train step as TensorFlow ops (both front ends run on
TensorFlow). The front end supplies its hooks:

- ``_value(variable)``: an optimizer variable's value as a tensor;
- ``_bounds_variable(bounds)``: makes the saved ``clip_bounds`` variable;
- ``_apply_release(grads, variables)``: the descent rule on a release;
- ``_apply_lot_across_replicas(grads, tf_vars, complete)``: the same under R > 1, gated to a lot's end;
- ``_count_replica_lot(num_examples)``: what of the step count runs inside the lot's conditional
  under R > 1 with k > 1 (default: all of it, ``_count_release``);
- ``_fit_steps_per_epoch(model)``, ``_first_epoch_of_fit(model)``, ``_first_step_of_fit(model)``:
  what the running ``fit`` of `model` says (its own locals differ between the Kerases).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import tensorflow as tf

from keras_dpsgd import ledger
from keras_dpsgd.dp import lot as dp_lot, step as dp_step
from keras_dpsgd.step import distribute as _distribute
from keras_dpsgd.step.fed_data import check_fed_data
from keras_dpsgd.step.settings import DPSettingsMixin
from keras_dpsgd.dp.refusals import refuse

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
            raise refuse(
                "lot-steps-per-epoch",
                f"steps_per_epoch must be a multiple of gradient_accumulation_steps = {k} when the "
                f"sampling rate is known (Poisson lots), got {steps}: the incomplete lot at the end of "
                "every epoch would be discarded and shift every later lot of the stream; pass "
                "steps_per_epoch=lots.steps_per_epoch",
            )

    def _on_fit_epoch_begin(self, model: Any) -> None:
        """Called by fit at the start of every epoch (see `_watch_lot_boundaries`)."""
        check_fed_data(model, self)  # a later fit may feed other lots (or another q = B·k/N)
        self._check_lot_alignment(model)
        if self._first_epoch_of_fit(model):
            self.discard_partial_lot("left before this fit (interrupted, or restored mid-lot)")
            return
        if self.discard_partial_lot("at the end of an epoch") and self._dp.sampling_rate is not None:
            raise refuse(
                "epoch-inside-lot",
                "an epoch of fit ended inside a lot while the sampling rate is known (Poisson lots): "
                "the lots no longer align with the Poisson stream. Use steps_per_epoch=lots.steps_per_epoch "
                "and save BackupAndRestore checkpoints at epoch ends or every multiple of "
                f"gradient_accumulation_steps = {self._dp.accumulation} batches",
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

    # ------------------------------------------------------ Algorithm 1, once per batch
    def _private_step(self, loss: tf.Tensor, tf_vars: list, tape: Any, model: Any, reg_grads, variables) -> list:
        """One batch through the DP core's Algorithm 1 (``keras_dpsgd.dp.step.private_step``).

        Lots of one batch: returns the release's gradients (pending for the front end's apply). Lots of
        k > 1 batches: accumulates the batch and, on the lot's k-th, releases, applies it and starts a new
        lot (under R > 1 replicas: ``_TFFront.when_complete``); returns None.

        Checks at trace time what data reach the step (``_fed_data.check_fed_data``: the rate of the fed lots,
        or a refusal; a custom loop with a Poisson rate is refused) and, once the backend has computed the
        clipped sum, that the step writes no value of the batch outside the optimizer (``_refuse_batch_writes``).
        """
        check_fed_data(model, self, outside_fit=True)  # At trace time: a custom loop too (model None).

        def clipped_sum(clip):
            summed = self._backend.clipped_sum(loss, tf_vars, tape, clip)[0]  # refuses a loss that is no [B] first
            # The lot's realized size over all replicas (one scalar all-reduce under a strategy).
            return summed, _distribute.global_sum(tf.cast(tf.shape(loss)[0], tf.float32))

        return dp_step.private_step(_TFFront(self, loss, model, reg_grads, tf_vars, variables), clipped_sum)

    def _lot_complete(self) -> tf.Tensor:
        """True on the last batch of a lot (the same on every replica: each counts the batches)."""
        return self._value(self._accum_batches) >= self._dp.accumulation

    def _finish(self, grads: list, reg_grads, tf_vars: list) -> list[tf.Tensor]:
        """A release's gradients plus the regularization gradient (no clip, no noise; computed identically on
        every replica, so each adds its 1/R share), in the variables' dtypes."""
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
                raise refuse("no-private-step", message)
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


class _TFFront:
    """The front end ``dp.step.private_step`` runs with on TensorFlow (``keras_dpsgd.dp.step.FrontEnd``): the
    lot in the optimizer's variables, the releases through its overridable hooks, tf.cond and tf.distribute."""

    def __init__(self, optimizer: LotReleaseMixin, loss, model, reg_grads, tf_vars: list, variables):
        self.opt, self.loss, self.model, self.reg_grads = optimizer, loss, model, reg_grads
        self.tf_vars, self.variables = tf_vars, variables
        self.ops = optimizer._dp.noise.OPS
        self.accumulation = optimizer._dp.accumulation
        self.replicas = _distribute.num_replicas()

    def clipping(self):
        return self.opt._clipping()

    def observe(self, clip) -> None:
        """At trace time the refusal of batch writes; the non-finite count; the hook on the norms."""
        opt = self.opt
        opt._refuse_batch_writes(self.loss, self.model)
        nonfinite = tf.logical_not(clip.finite[:, 0])
        opt.nonfinite_examples.assign_add(tf.reduce_sum(tf.cast(nonfinite, tf.int64)))
        opt.on_per_example_sq_norms(clip.sq_norms)

    def load_lot(self) -> dp_lot.Lot:
        opt = self.opt
        sums = tuple(opt._value(acc) for acc in opt._accumulators)
        return dp_lot.Lot(sums, opt._value(opt._accum_examples), opt._value(opt._accum_batches))

    def store_lot(self, lot: dp_lot.Lot) -> None:
        opt = self.opt
        for acc, s in zip(opt._accumulators, lot.sums):
            acc.assign(s)
        opt._accum_examples.assign(lot.examples)
        opt._accum_batches.assign(lot.batches)

    def add_noise(self, clipped) -> list:
        """The hook ``add_noise`` on the sums, with the record (and its sensitivity) in flight."""
        local = self.opt._dp.local
        local.releasing = clipped
        try:
            return self.opt.add_noise(list(clipped.sums))
        finally:
            local.releasing = None

    def normalize(self, noised: list, num_examples) -> list:
        return self.opt.normalize(noised, num_examples)

    def count(self, num_examples) -> None:
        if self.accumulation > 1 and self.replicas > 1:
            self.opt._count_replica_lot(num_examples)
        else:
            self.opt._count_release(num_examples)

    def when_complete(self, complete, release, reset):
        """Lots of one batch: the release (pending). Lots of k: released and applied in a conditional; under
        R > 1 every batch SUMs across the replicas (zeros but on the lot's last batch: ``tf.cond`` cannot hold
        a synchronization), the descent rule gated to the lot's end by the front end."""
        opt = self.opt

        def finished():
            return opt._finish(release(), self.reg_grads, self.tf_vars)

        if self.accumulation == 1:
            return opt._pending(finished())
        if self.replicas > 1:
            grads = tf.cond(complete, finished, lambda: [tf.zeros_like(v) for v in self.tf_vars])
            opt._apply_lot_across_replicas(list(grads), self.tf_vars, complete)
        else:

            def apply_lot():
                opt._apply_release(opt._pending(finished()), self.variables)
                reset()
                return tf.constant(True)

            tf.cond(complete, apply_lot, lambda: tf.constant(False))
            return None

        def reset_lot():
            reset()
            return tf.constant(True)

        tf.cond(complete, reset_lot, lambda: tf.constant(False))
        return None

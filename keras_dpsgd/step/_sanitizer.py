"""The DP-SGD sanitizer, shared by every private tf_keras optimizer.

Abadi et al. 2016, Algorithm 1, for a lot L of examples:

1. per-example gradients g_i = ∇θ ℓ(θ, x_i)                (the backend)
2. clip: ḡ_i = g_i · min(1, C / ||g_i||), or g_i / (||g_i|| + γ)  (``_clip_factors``)
3. sum: Σ_i ḡ_i                                             (the backend)
4. noise: Σ_i ḡ_i + N(0, σ²C² I)                            (``add_noise``)
5. normalize: divide by the expected lot size L             (``_normalize``)

The descent rule that follows (SGD, momentum, Adam, ...) only sees the
sanitized gradient: it is post-processing and costs no privacy.

Per-layer clipping (Abadi et al. 2016, Sec 3.1; McMahan et al. 2018) clips
each trainable variable v to its own bound C_v and adds N(0, σ_v² C_v²) to it.
The step is one Gaussian mechanism with effective noise multiplier
σ_eff = (Σ_v 1/σ_v²)^(-1/2): with V variables and one σ, σ_eff = σ/√V, which is
what the accountant must be charged (``effective_noise_multiplier``).

Non-finite gradients: an example whose per-example gradient holds NaN or Inf
(or whose squared norm overflows float32) gets clip factor 0, so it adds
nothing to the sum (this keeps each example's contribution within the
sensitivity bound), and is counted in ``nonfinite_examples``. That count is
an un-noised statistic of the private data, outside the privacy ledger: it is
a local diagnostic of this process, never saved (not in checkpoints, ``.keras``
or h5 files) and never released by the library.

Lots (gradient accumulation). A lot is the unit of release: with
``gradient_accumulation_steps`` = k, k batches are accumulated and released
once. An incomplete lot is never released and never carried into another lot:
it is discarded (counted in ``discarded_lots`` and ``discarded_batches``, with
a warning) at the start of every epoch of ``fit`` (lots never straddle two
shuffles), at the end of every ``fit``, before the first batch of a ``fit``
(a lot left by an interrupted ``fit`` or restored from a checkpoint taken
mid-lot) and when a ``.keras``/h5 file is loaded. A discarded lot drew no
noise and moved no weight: it costs no privacy, and ``noised_steps`` counts
exactly the released lots. With a known ``sampling_rate`` (``PoissonLots``),
``steps_per_epoch`` must be a multiple of k, as discarding would shift every
later lot of the Poisson stream. In a custom training loop, call
``discard_partial_lot()`` wherever a lot is interrupted.

Several replicas (``tf.distribute.MirroredStrategy``, ``MultiWorkerMirroredStrategy``; the
derivation is in ``keras_dpsgd.step._distribute``): each of the R replicas clips its share of the batch,
adds N(0, σ²C²/R) with a key of its own and divides by the global L; tf_keras's ``apply_gradients``
SUMs the gradients over the replicas (``aggregate_gradients``; with ``reduction="none"`` the
compiled loss is not scaled by 1/R), which gives (ΣS_r + N(0, σ²C²))/L, the one-device release.
The step's variables count once per global step: ``noised_steps`` and the accumulators are updated
in replica context, each replica its own copy (aggregation NONE: the copies stay equal for the
counter, and hold each replica's partial sum for the accumulators); ``nonfinite_examples`` is
ON_READ/SUM. The realized lot size is all-reduced; a weight-regularizer gradient, computed
identically on every replica, is added as 1/R of it. Accumulation releases its lot with one
cross-replica sum per batch (``_release_lot_across_replicas``). Adaptive clipping, and weight decay
or EMA with accumulation, are refused under R > 1 (``_check_distribution``).

Regularization: the gradient of a data-independent term is added to the
sanitized gradient without clipping or noise (post-processing). Two routes:
the optimizer's ``weight_decay`` argument (decoupled weight decay), or passing
``(per_example_loss, regularization_loss)`` to ``minimize``/``compute_gradients``
with a persistent tape, or ``(per_example_loss, regularization_fn)`` with a
function of the weights (differentiated on its own tape). tf_keras's own
``compile`` cannot add ``model.losses`` to an unreduced loss (it raises "Shapes
must be equal rank" in its compile_utils before the optimizer is called):
``keras_dpsgd.tf_keras.make_private(model)`` keeps the weight regularizers
apart (``keras_dpsgd.tf_keras._train_step``); activity regularizers and other
``add_loss`` terms depend on the data and must go into the per-example loss.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import tensorflow as tf

from keras_dpsgd.step import _display, _distribute, _math as _step
from keras_dpsgd._frames import find_calling_model
from keras_dpsgd import ledger
from keras_dpsgd.step._settings import DPSettingsMixin, DPState
from keras_dpsgd.preprocessing.normalization import refuse_adapted_preprocessing
from keras_dpsgd.backends.tensorflow._graph import refuse_grouped_convolution_layers
from keras_dpsgd.backends.tensorflow._per_example import (
    per_example_loss,
    refuse_example_mixing,
)

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


def _resolve_bounds(l2_norm_clip: Any, var_list: Sequence[tf.Variable]) -> list[float]:
    """One clip bound per trainable variable, in `var_list` order (None, per-example normalization: 1,
    the sensitivity of an example rescaled to norm < 1)."""
    num = len(var_list)
    if l2_norm_clip is None:
        return [1.0] * num
    if isinstance(l2_norm_clip, float):
        return [l2_norm_clip] * num
    if isinstance(l2_norm_clip, list):
        if len(l2_norm_clip) != num:
            raise ValueError(
                f"l2_norm_clip must have one bound per trainable variable ({num}: "
                f"{[v.name for v in var_list]}), got {len(l2_norm_clip)}"
            )
        return list(l2_norm_clip)
    names = [v.name for v in var_list]
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


class DPSanitizerMixin(DPSettingsMixin):
    """DP-SGD sanitizer for a tf_keras (2.11+) optimizer; put before the optimizer class.

    ``keras_dpsgd.step._classes.init_private`` constructs it (``DPSGDOptimizer`` and the classes of
    ``make_dp_optimizer``): the DP arguments checked, the tf_keras ``__init__``, then ``_init_dp``.
    The settings' properties and ``get_config`` are shared with Keras 3 (``DPSettingsMixin``).
    """

    # ----------------------------------------------------------------- setup
    def _init_dp(self, state: DPState) -> None:
        """Stores the checked DP settings (`state`) and makes the optimizer's saved variables."""
        self._init_dp_state(state)
        with tf.init_scope():
            self.noised_steps = self.add_variable([], tf.int64, name="noised_steps")
            # The worst (q, σ_eff) the ledger has charged: the .keras format saves optimizer
            # variables but not the ledger's segments (keras_dpsgd.ledger).
            self.ledger_max_sampling_rate, self.ledger_min_noise_multiplier = ledger.add_bound_variables(self)
        self._ledger_bounds = self._no_dependency([self.ledger_max_sampling_rate, self.ledger_min_noise_multiplier])
        # The ledger's copy on the optimizer exists from the start, so a checkpoint
        # restores it at once (no deferred read of a file that may be gone).
        ledger.ledger_state_holders(None, self)

    @property
    def gradient_accumulation_steps(self) -> int:
        """k: batches per lot (clipped sums accumulated by ``minimize``, released once per lot)."""
        return self._dp.accumulation

    def build(self, var_list):
        if getattr(self, "_built", False):
            return
        super().build(var_list)
        bounds = _resolve_bounds(self._dp.l2_norm_clip, var_list)
        sigmas = self._dp.noise_multiplier
        self._dp.sigmas = list(sigmas) if isinstance(sigmas, list) else [sigmas] * len(var_list)
        self.clip_bounds = tf.Variable(bounds, dtype=tf.float32, trainable=False, name="clip_bounds")
        self._variables.append(self.clip_bounds)
        if self.gradient_accumulation_steps > 1:
            self._accumulators = [self.add_variable_from_reference(v, "dp_accumulator") for v in var_list]
            self._accum_batches = self.add_variable([], tf.int64, name="dp_accumulated_batches")
            self._accum_examples = self.add_variable([], tf.float32, name="dp_accumulated_examples")

    def _saved_layouts(self) -> list[list]:
        """The variable layouts of the files this version loads (None: a saved value it skips).

        Now; 0.1.0, which also saved ``nonfinite_examples`` after ``noised_steps``;
        and older files, saved before the ledger bounds existed.
        """
        current = list(self._variables)
        at = next(i for i, v in enumerate(current) if v is self.noised_steps) + 1
        with_count = current[:at] + [None] + current[at:]
        without_bounds = [v for v in with_count if all(v is not b for b in self._ledger_bounds)]
        return [current, with_count, without_bounds]

    def _layout(self, num_saved: int) -> list | None:
        """The older layout that holds `num_saved` values, or None (current or unknown)."""
        for layout in self._saved_layouts()[1:]:
            if len(layout) == num_saved:
                return layout
        return None

    def save_own_variables(self, store):
        """.keras saving; refused where the file would lose part of the ledger."""
        ledger.refuse_lost_history(ledger.saving_model(self), self, "a .keras file")
        return super().save_own_variables(store)

    def load_own_variables(self, store):
        """.keras loading; older files load what this version keeps (bounds stay unset)."""
        older = self._layout(len(store.keys()))
        if older is None:
            super().load_own_variables(store)
        else:
            for i, variable in enumerate(older):
                if variable is not None:
                    variable.assign(store[str(i)])
        self.discard_partial_lot("saved in the loaded file")

    def set_weights(self, weights):
        """h5 loading; older weights load what this version keeps (bounds stay unset)."""
        weights = list(weights)
        older = self._layout(len(weights))
        if older is not None:
            given = {id(v): w for v, w in zip(older, weights) if v is not None}
            weights = [given.get(id(v), v.numpy()) for v in self._variables]
        result = super().set_weights(weights)
        self.discard_partial_lot("saved in the loaded weights")
        return result

    # ------------------------------------------------------------------ lots
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
            self.gradient_accumulation_steps,
            where,
        )
        return batches

    def _fit_steps_per_epoch(self, model: Any) -> int | None:
        """The steps per epoch of `model`'s running fit (tf_keras: its data handler's), or None."""
        frame = ledger.fit_frame(model)
        handler = frame.f_locals.get("data_handler") if frame is not None else None
        return getattr(handler, "inferred_steps", None)

    def _first_epoch_of_fit(self, model: Any) -> bool:
        """At an epoch's start: True for the first epoch of this fit (tf_keras: no step taken yet)."""
        return int(model._train_counter.numpy()) == 0

    def _check_lot_alignment(self, model: Any) -> None:
        """With Poisson lots (known q), fit's steps_per_epoch must hold whole lots."""
        k = self.gradient_accumulation_steps
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
        ledger.note_fit_sampling(model, self)  # a later fit may have another q = B·k/N
        self._check_lot_alignment(model)
        if self._first_epoch_of_fit(model):
            self.discard_partial_lot("left before this fit (interrupted, or restored mid-lot)")
            return
        if self.discard_partial_lot("at the end of an epoch") and self._dp.sampling_rate is not None:
            raise ValueError(
                "an epoch of fit ended inside a lot while the sampling rate is known (Poisson lots): "
                "the lots no longer align with the Poisson stream. Use steps_per_epoch=lots.steps_per_epoch "
                "and save BackupAndRestore checkpoints at epoch ends or every multiple of "
                f"gradient_accumulation_steps = {self.gradient_accumulation_steps} batches"
            )

    def _watch_lot_boundaries(self, model: Any) -> None:
        """At trace time: fit's q where the optimizer does not know it (``ledger.note_fit_sampling``,
        again at every epoch start), and lots of `model`'s fit never cross an epoch or a fit."""
        if model is None:
            return
        ledger.note_fit_sampling(model, self)
        if "reset_metrics" not in vars(model):
            object.__setattr__(model, "reset_metrics", _EpochBoundary(model))
        if self.gradient_accumulation_steps == 1:
            return
        self._check_lot_alignment(model)
        with tf.init_scope():
            first_step_of_fit = int(model._train_counter.numpy()) == 0
        if first_step_of_fit:
            self.discard_partial_lot("left before this fit (interrupted, or restored mid-lot)")

    def finalize_variable_values(self, var_list):
        """Called by fit at its end: an incomplete last lot is discarded."""
        self.discard_partial_lot("at the end of fit")
        return super().finalize_variable_values(var_list)

    # ------------------------------------------------------ sanitizer steps
    def _clipped_sum(self, loss, var_list, tape, model):
        """Steps 1-3 through the backend: Σ_i clip(g_i), plus the batch size."""
        finite = []  # The non-finite mask, computed once from the backend's sq_norms.

        def factors(sq_norms):
            finite.append(_step.finite_rows(sq_norms))
            return self._clip_factors(sq_norms, finite[-1])

        summed, sq_norms = self._backend.clipped_sum(loss, var_list, tape, factors)
        self._refuse_batch_writes(loss, model)  # At trace time.
        nonfinite = tf.logical_not(finite[-1][:, 0])
        self.nonfinite_examples.assign_add(tf.reduce_sum(tf.cast(nonfinite, tf.int64)))
        self.on_per_example_sq_norms(sq_norms)
        # The lot's realized size over all replicas (one scalar all-reduce under a strategy).
        return summed, _distribute.global_sum(tf.cast(tf.shape(loss)[0], tf.float32))

    def on_per_example_sq_norms(self, sq_norms: tf.Tensor) -> None:
        """Hook called once per batch inside the traced step with sq_norms [B, V].

        Override (e.g. adaptive clipping's norm query) to observe per-example
        squared norms; the clip bounds in force are ``self.clip_bounds``.
        Whatever is derived from them is a release of its own that must be
        noised and recorded by the accountant. Default: nothing.
        """

    # ------------------------------------------------ hooks for subclasses
    # Published extension points, the same names as on Keras 3 (``DPKeras3Mixin``): adaptive
    # clipping and gradient canaries use them. Anything a hook derives from the data is a release
    # of its own, which must be noised and charged (``release_noise_multipliers``). Steps 4-5
    # (``add_noise``, ``normalize``, ``standard_normal``) are shared: ``DPSettingsMixin``.
    def on_noised_step(self, num_examples: tf.Tensor) -> None:
        """Hook: called once per noised step (once per lot), after the gradient's release and the
        ``noised_steps`` increment, with the lot's realized number of examples. Default: nothing."""

    # ------------------------------------------------------ optimizer API
    def _check_distribution(self) -> None:
        """At trace time: the strategy is one the split-noise step supports (``_distribute``), and
        what is not derived or tested for several replicas is refused."""
        name = type(self).__name__
        _distribute.check_strategy(name)
        replicas = _distribute.num_replicas()
        if replicas == 1:
            return
        if self.gradient_accumulation_steps > 1 and (self.use_ema or self.weight_decay):
            raise ValueError(
                f"{name} with gradient_accumulation_steps = {self.gradient_accumulation_steps}, "
                f"weight_decay={self.weight_decay!r} and use_ema={self.use_ema!r} is not supported with "
                f"{replicas} replicas: tf_keras applies weight decay and the moving average at every batch "
                "there, not once per lot. Use weight_decay=None and use_ema=False (a kernel_regularizer with "
                "keras_dpsgd.tf_keras.make_private instead of weight decay), or gradient_accumulation_steps=1."
            )
        refused = getattr(self, "_refused_under_replicas", None)
        if refused:
            raise ValueError(f"{name} is not supported with {replicas} replicas: {refused}")

    def _refuse_split_worker_lots(self, model: Any) -> None:
        """Under MultiWorkerMirroredStrategy, refuses a fit on a per-worker dataset handed over as is.

        A dataset with auto-sharding off holds each worker's own lots (``PoissonLots.dataset()``
        with ``num_workers``); ``fit`` distributes it with ``experimental_distribute_dataset``,
        which takes each of its batches for a GLOBAL batch and gives every step 1/W of it: one lot
        would be released over W steps, each charged as a Poisson lot of its own.
        """
        strategy = _distribute.current_strategy()
        if model is None or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return
        from keras_dpsgd.step.lots import strategy_workers

        frame = ledger.fit_frame(model)
        data = frame.f_locals.get("x") if frame is not None else None
        off = tf.data.experimental.AutoShardPolicy.OFF
        if isinstance(data, tf.data.Dataset) and data.options().experimental_distribute.auto_shard_policy == off:
            workers = strategy_workers(strategy)
            if workers > 1:
                raise ValueError(
                    f"fit got a per-worker dataset (tf.data auto-sharding off, e.g. PoissonLots.dataset()) under "
                    f"MultiWorkerMirroredStrategy with {workers} workers: fit would split each of its batches "
                    f"over {workers} steps, so one lot would be released in parts. Pass "
                    "lots.distribute(strategy) to fit instead (PoissonLots with num_workers), or a dataset made by "
                    "strategy.distribute_datasets_from_function with one batch per local replica."
                )

    def _prepare(self, loss, var_list, tape):
        self._check_distribution()
        if callable(var_list):
            var_list = var_list()
        var_list = list(var_list)
        if callable(loss):
            tape = tape or tf.GradientTape()
            with tape:
                tape.watch(var_list)
                loss = loss()
        if tape is None:
            raise ValueError(f"tape is required when a Tensor loss is passed to {type(self).__name__}")
        model = find_calling_model(self, max_depth=24)
        refuse_grouped_convolution_layers(model, self._backend)
        refuse_adapted_preprocessing(model)
        regularization = None
        if isinstance(loss, (tuple, list)):
            if len(loss) != 2:
                raise ValueError(
                    f"loss must be a Tensor or a (per_example_loss, regularization_loss) pair, got {len(loss)} items"
                )
            loss, regularization = loss
        refuse_example_mixing(model, var_list, loss)
        raw_loss = loss
        loss = per_example_loss(loss, tape, type(self).__name__)
        reg_grads = None
        if callable(regularization):  # A function of the weights only (``_tf_keras_step``): its own tape.
            with tf.GradientTape() as reg_tape:
                reg_tape.watch(var_list)
                value = regularization()
            reg_grads = reg_tape.gradient(value, var_list, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            reg_grads = [_distribute.replica_share(tf.convert_to_tensor(g)) for g in reg_grads]
        elif regularization is not None:
            if not getattr(tape, "_persistent", False):
                raise ValueError(
                    "a (per_example_loss, regularization_loss) pair needs tf.GradientTape(persistent=True): "
                    "the regularization gradient and the per-example gradients are two tape queries"
                )
            reg_grads = tape.gradient(regularization, var_list, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            reg_grads = [_distribute.replica_share(tf.convert_to_tensor(g)) for g in reg_grads]
        if _distribute.num_replicas() == 1:  # the logged loss and metrics: over the real rows
            _display.install_tf_keras(model, raw_loss, loss)
        return loss, var_list, tape, reg_grads

    def _release(self, summed, num_examples, reg_grads):
        """Steps 4-5 and the regularization gradient (no clip, no noise), pending for apply_gradients."""
        return self._pending(self._noised(summed, num_examples, reg_grads))

    def _noised(self, summed, num_examples, reg_grads):
        """Steps 4-5 (``noised_steps`` + 1, ``on_noised_step``) plus the regularization gradient."""
        grads = self.normalize(self.add_noise(summed), num_examples)
        self.noised_steps.assign_add(1)
        self.on_noised_step(num_examples)
        if reg_grads is not None:
            grads = [g + r for g, r in zip(grads, reg_grads)]
        return grads

    def _pending(self, grads):
        """Marks `grads` as the sanitized gradients the next apply_gradients may apply."""
        self._dp.pending[:] = grads
        return grads

    def _sanitized_sum(self, loss, var_list, tape):
        """The path `compute_gradients` and `minimize` share: prepare → build → Σ_i clip(g_i).

        Returns (var_list, clipped sum, batch size, regularization gradients or None).
        """
        loss, var_list, tape, reg_grads = self._prepare(loss, var_list, tape)
        with tf.init_scope():
            self.build(var_list)
        model = find_calling_model(self, max_depth=24)
        self._refuse_split_worker_lots(model)
        ledger.attach(model, self)
        self._watch_lot_boundaries(model)  # lots never cross an epoch (nothing to do without accumulation)
        summed, num_examples = self._clipped_sum(loss, var_list, tape, model)
        return var_list, summed, num_examples, reg_grads

    def compute_gradients(self, loss, var_list, tape=None):
        """Sanitized gradients of a per-example `loss` (one noised step).

        Args:
          loss: per-example loss [B, ...] recorded on `tape`, a
            (per_example_loss, regularization_loss) pair, or a callable.
          var_list: trainable variables (or a callable returning them).
          tape: the tf.GradientTape that recorded `loss`.

        Returns:
          A list of (sanitized gradient, variable) pairs.

        Raises:
          ValueError: scalar loss, example-mixing layers, or
            gradient_accumulation_steps > 1 (use `minimize`).
        """
        if self.gradient_accumulation_steps > 1:
            raise ValueError(
                "with gradient_accumulation_steps > 1 call minimize(loss, var_list, tape) "
                "(Keras fit does): compute_gradients alone cannot accumulate a lot"
            )
        var_list, summed, num_examples, reg_grads = self._sanitized_sum(loss, var_list, tape)
        return list(zip(self._release(summed, num_examples, reg_grads), var_list))

    def minimize(self, loss, var_list, tape=None):
        """One DP-SGD step, or one batch of a lot when accumulating."""
        if self.gradient_accumulation_steps == 1:
            self.apply_gradients(self.compute_gradients(loss, var_list, tape))
            return
        var_list, summed, num_examples, reg_grads = self._sanitized_sum(loss, var_list, tape)
        for acc, s in zip(self._accumulators, summed):
            acc.assign_add(s)
        self._accum_examples.assign_add(num_examples)
        self._accum_batches.assign_add(1)
        if _distribute.num_replicas() > 1:
            self._release_lot_across_replicas(var_list, reg_grads)
            return

        def release_lot():
            lot = [acc.read_value() for acc in self._accumulators]
            grads = self._release(lot, self._accum_examples.read_value(), reg_grads)
            self.apply_gradients(list(zip(grads, var_list)))
            return self._reset_lot()

        tf.cond(self._lot_complete(), release_lot, lambda: tf.constant(False))

    def _lot_complete(self) -> tf.Tensor:
        """True on the last batch of a lot (the same on every replica: each counts the batches)."""
        return self._accum_batches >= self.gradient_accumulation_steps

    def _reset_lot(self) -> tf.Tensor:
        for acc in self._accumulators:
            acc.assign(tf.zeros_like(acc))
        self._accum_examples.assign(0.0)
        self._accum_batches.assign(0)
        return tf.constant(True)

    def _release_lot_across_replicas(self, var_list, reg_grads) -> None:
        """Gradient accumulation under R > 1 replicas: one noise draw per global lot.

        The cross-replica sum of tf_keras's ``apply_gradients`` is a synchronization point, which
        tf.distribute cannot run inside a ``tf.cond``: so every batch goes through it. Each replica
        holds its own partial sums (the accumulators are updated in replica context, one copy per
        replica) and, on the lot's last batch only, releases them noised by σC/√R and divided by
        the global L (``_noised``, inside the conditional, with no synchronization); on other
        batches it contributes zeros. The descent rule and the step counter are applied only on
        the last batch (``_distributed_apply_gradients_fn``). The cost: one gradient all-reduce
        per batch instead of one per lot.
        """
        complete = self._lot_complete()
        lot = lambda: self._noised(
            [acc.read_value() for acc in self._accumulators],  # noqa: E731
            self._accum_examples.read_value(),
            reg_grads,
        )
        grads = tf.cond(complete, lot, lambda: [tf.zeros_like(v) for v in var_list])
        self._gate_updates = True
        try:
            self.apply_gradients(list(zip(self._pending(list(grads)), var_list)))
        finally:
            self._gate_updates = False
        tf.cond(complete, self._reset_lot, lambda: tf.constant(False))

    def _distributed_apply_gradients_fn(self, distribution, grads_and_vars, **kwargs):
        """tf_keras's cross-replica update; under accumulation with R > 1 only on a lot's last batch."""
        if not getattr(self, "_gate_updates", False):
            return super()._distributed_apply_gradients_fn(distribution, grads_and_vars, **kwargs)

        def update(var, grad):
            def apply():
                if self.jit_compile:
                    self._update_step_xla(grad, var, id(self._var_key(var)))
                else:
                    self._update_step(grad, var)
                return tf.constant(True)

            return tf.cond(self._lot_complete(), apply, lambda: tf.constant(False))

        for grad, var in grads_and_vars:
            distribution.extended.update(var, update, args=(grad,), group=False)
        return self.iterations.assign_add(tf.cast(self._lot_complete(), self.iterations.dtype))

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """Applies gradients that came out of this optimizer's sanitizer only."""
        grads_and_vars = list(grads_and_vars)
        pending = self._dp.pending
        for grad, _ in grads_and_vars:
            if grad is not None and not any(grad is g for g in pending):
                raise ValueError(
                    f"{type(self).__name__}.apply_gradients got a gradient that did not come from its "
                    "compute_gradients: applying it would be a non-private step. Call "
                    "minimize(loss, var_list, tape) or apply the output of compute_gradients. "
                    "(A LossScaleOptimizer, which compile adds under the 'mixed_float16' policy, "
                    "rescales the sanitized gradients: loss scaling is not supported; use the "
                    "'float32' or 'mixed_bfloat16' policy.)"
                )
        del pending[:]
        return super().apply_gradients(grads_and_vars, *args, **kwargs)

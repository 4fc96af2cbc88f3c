"""The DP-SGD sanitizer, shared by every private tf_keras optimizer.

Abadi et al. 2016, Algorithm 1, for a lot L of examples:

1. per-example gradients g_i = ∇θ ℓ(θ, x_i)                (the backend)
2. clip: ḡ_i = g_i · min(1, C / ||g_i||), or g_i / (||g_i|| + γ)  (``dp.clip``)
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
derivation is in ``keras_dpsgd.step.distribute``): each of the R replicas clips its share of the batch,
adds N(0, σ²C²/R) with a key of its own and divides by the global L; tf_keras's ``apply_gradients``
SUMs the gradients over the replicas (``aggregate_gradients``; with ``reduction="none"`` the
compiled loss is not scaled by 1/R), which gives (ΣS_r + N(0, σ²C²))/L, the one-device release.
The step's variables count once per global step: ``noised_steps`` and the accumulators are updated
in replica context, each replica its own copy (aggregation NONE: the copies stay equal for the
counter, and hold each replica's partial sum for the accumulators); ``nonfinite_examples`` is
ON_READ/SUM. The realized lot size is all-reduced; a weight-regularizer gradient, computed
identically on every replica, is added as 1/R of it. Accumulation releases its lot with one
cross-replica sum per batch (``_release._TFFront.when_complete``). Adaptive clipping, and weight decay
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

from typing import Any

import tensorflow as tf

from keras_dpsgd.step import display as _display, distribute as _distribute
from keras_dpsgd._frames import find_calling_model
from keras_dpsgd import ledger
from keras_dpsgd.step.settings import DPState
from keras_dpsgd.step.release import LotReleaseMixin
from keras_dpsgd.preprocessing.normalization import refuse_adapted_preprocessing
from keras_dpsgd.backends.tensorflow.graph import refuse_grouped_convolution_layers
from keras_dpsgd.step.loss import SCALAR_LOSS_MESSAGE, per_example_values, regularization_gradients
from keras_dpsgd.backends.tensorflow.per_example_backend import refuse_example_mixing
from keras_dpsgd.step.eager import traced_eagerly, traced_step
from keras_dpsgd.dp.refusals import refuse


_NOT_PRIVATE_MESSAGE = (
    "{cls}.apply_gradients got a gradient that did not come from its "
    "compute_gradients: applying it would be a non-private step. Call "
    "minimize(loss, var_list, tape) or apply the output of compute_gradients. "
    "(A LossScaleOptimizer, which compile adds under the 'mixed_float16' policy, "
    "rescales the sanitized gradients: loss scaling is not supported; use the "
    "'float32' or 'mixed_bfloat16' policy.)"
)


class DPSanitizerMixin(LotReleaseMixin):
    """DP-SGD sanitizer for a tf_keras (2.11+) optimizer; put before the optimizer class.

    ``keras_dpsgd.step.classes.init_private`` constructs it (``DPSGDOptimizer`` and the classes of
    ``make_dp_optimizer``): the DP arguments checked, the tf_keras ``__init__``, then ``_init_dp``.
    The settings and the lot/release state machine are shared with Keras 3
    (``keras_dpsgd.step.release.LotReleaseMixin``); this class supplies tf_keras's hooks: its
    variables, how the model is found (the call stack), its fit's locals and ``apply_gradients``.
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
        self._build_lot(var_list, [v.name for v in var_list])

    def _bounds_variable(self, bounds: list[float]) -> tf.Variable:
        clip_bounds = tf.Variable(bounds, dtype=tf.float32, trainable=False, name="clip_bounds")
        self._variables.append(clip_bounds)
        return clip_bounds

    def _value(self, variable: tf.Variable) -> tf.Variable:
        return variable  # TF reads it where an op takes it (under a strategy: this replica's copy).

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
        self._adopt_loading_model()

    def set_weights(self, weights):
        """h5 loading; older weights load what this version keeps (bounds stay unset)."""
        weights = list(weights)
        older = self._layout(len(weights))
        if older is not None:
            given = {id(v): w for v, w in zip(older, weights) if v is not None}
            weights = [given.get(id(v), v.numpy()) for v in self._variables]
        result = super().set_weights(weights)
        self.discard_partial_lot("saved in the loaded weights")
        self._adopt_loading_model()
        return result

    def _adopt_loading_model(self) -> None:
        """Attaches the ledger to the model being loaded with this optimizer, so that a model compiled again
        right after the load (before any read or step) keeps the loaded steps."""
        model = ledger.saving_model(self)
        if model is not None:
            ledger.attach(model, self, loading=True)

    # ------------------------------------------------------- fit's lot boundaries
    def _fit_steps_per_epoch(self, model: Any) -> int | None:
        """The steps per epoch of `model`'s running fit (tf_keras: its data handler's), or None."""
        frame = ledger.fit_frame(model)
        handler = frame.f_locals.get("data_handler") if frame is not None else None
        return getattr(handler, "inferred_steps", None)

    def _first_epoch_of_fit(self, model: Any) -> bool:
        """At an epoch's start: True for the first epoch of this fit (tf_keras: no step taken yet)."""
        return int(model._train_counter.numpy()) == 0

    def _first_step_of_fit(self, model: Any) -> bool:
        """tf_keras: the model's step counter is still 0."""
        with tf.init_scope():
            return int(model._train_counter.numpy()) == 0

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
            raise refuse(
                "tf-keras-replica-lot-options",
                f"{name} with gradient_accumulation_steps = {self.gradient_accumulation_steps}, "
                f"weight_decay={self.weight_decay!r} and use_ema={self.use_ema!r} is not supported with "
                f"{replicas} replicas: tf_keras applies weight decay and the moving average at every batch "
                "there, not once per lot. Use weight_decay=None and use_ema=False (a kernel_regularizer with "
                "keras_dpsgd.tf_keras.make_private instead of weight decay), or gradient_accumulation_steps=1.",
            )
        refused = getattr(self, "_refused_under_replicas", None)
        if refused:
            raise refuse("tf-keras-adaptive-replicas", f"{name} is not supported with {replicas} replicas: {refused}")

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
                raise refuse(
                    "worker-dataset",
                    f"fit got a per-worker dataset (tf.data auto-sharding off, e.g. PoissonLots.dataset()) under "
                    f"MultiWorkerMirroredStrategy with {workers} workers: fit would split each of its batches "
                    f"over {workers} steps, so one lot would be released in parts. Pass "
                    "lots.distribute(strategy) to fit instead (PoissonLots with num_workers), or a dataset made by "
                    "strategy.distribute_datasets_from_function with one batch per local replica.",
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
        name = type(self).__name__
        loss = per_example_values(
            loss,
            tape,
            lambda shape: SCALAR_LOSS_MESSAGE.format(cls=name, shape=shape),
            lambda shape: f"{name} needs a per-example loss of known rank, got shape {shape}",
        )
        # A function of the weights only (``_tf_keras_step``) or a tensor on the persistent tape.
        reg_grads = regularization_gradients(
            regularization, var_list, tape, "a (per_example_loss, regularization_loss) pair"
        )
        if _distribute.num_replicas() == 1:  # the logged loss and metrics: over the real rows
            _display.install_tf_keras(model, raw_loss, loss)
        return loss, var_list, tape, reg_grads

    def _sanitized_step(self, loss, var_list, tape):
        """The path `compute_gradients` and `minimize` share: prepare → build → Algorithm 1 (``_private_step``).

        Returns (var_list, the release's gradients: lots of one batch; None with accumulation).
        """
        loss, var_list, tape, reg_grads = self._prepare(loss, var_list, tape)
        with tf.init_scope():
            self.build(var_list)
        model = find_calling_model(self, max_depth=24)
        self._refuse_split_worker_lots(model)
        ledger.attach(model, self)
        self._watch_lot_boundaries(model)  # lots never cross an epoch (nothing to do without accumulation)
        return var_list, self._private_step(loss, var_list, tape, model, reg_grads, var_list)

    @tf.autograph.experimental.do_not_convert
    def compute_gradients(self, loss, var_list, tape=None):
        """Sanitized gradients of a per-example `loss` (one noised step).

        Called eagerly with a loss callable (TF Privacy's custom loops), the step is traced in a
        ``tf.function`` of the optimizer's, where the same graph checks run (``traced_step``); the
        gradients it returns are the ones ``apply_gradients`` then accepts.

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
            raise refuse(
                "sanitize-lot",
                "with gradient_accumulation_steps > 1 call minimize(loss, var_list, tape) "
                "(Keras fit does): compute_gradients alone cannot accumulate a lot",
            )
        if traced_eagerly(loss, tape):
            var_list = _variables(var_list)
            grads = traced_step(self, "compute_gradients", var_list, lambda: self.compute_gradients(loss, var_list))
            return list(zip(self._pending(list(grads)), var_list))
        var_list, grads = self._sanitized_step(loss, var_list, tape)
        return list(zip(grads, var_list))

    @tf.autograph.experimental.do_not_convert
    def minimize(self, loss, var_list, tape=None):
        """One DP-SGD step, or one batch of a lot when accumulating.

        Called eagerly with a loss callable (TF Privacy's custom loops), the step is traced in a
        ``tf.function`` of the optimizer's, where the same graph checks run (``traced_step``)."""
        if traced_eagerly(loss, tape):
            var_list = _variables(var_list)
            traced_step(self, "minimize", var_list, lambda: self.minimize(loss, var_list))
            return
        if self.gradient_accumulation_steps == 1:
            self.apply_gradients(self.compute_gradients(loss, var_list, tape))
            return
        self._sanitized_step(loss, var_list, tape)

    def _apply_release(self, grads, variables) -> None:
        self.apply_gradients(list(zip(grads, variables)))

    def _apply_lot_across_replicas(self, grads, tf_vars, complete) -> None:
        """tf_keras: ``apply_gradients`` SUMs `grads` across the replicas on every batch; the descent
        rule and the step counter run on the lot's last batch only (``_distributed_apply_gradients_fn``).
        ``noised_steps`` (a per-replica copy) was counted inside the lot's conditional."""
        self._gate_updates = True
        try:
            self.apply_gradients(list(zip(self._pending(grads), tf_vars)))
        finally:
            self._gate_updates = False

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

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """Applies gradients that came out of this optimizer's sanitizer only."""
        grads_and_vars = list(grads_and_vars)
        self._take_pending([grad for grad, _ in grads_and_vars], _NOT_PRIVATE_MESSAGE.format(cls=type(self).__name__))
        return super().apply_gradients(grads_and_vars, *args, **kwargs)


def _variables(var_list: Any) -> list:
    """`var_list`, or what a callable `var_list` returns, as a list (resolved eagerly, outside the trace)."""
    return list(var_list() if callable(var_list) else var_list)

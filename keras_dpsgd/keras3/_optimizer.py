"""Differentially private Keras 3 optimizers (TensorFlow backend): the DP settings and the sanitizer.

Keras 3's train step hands an optimizer only batch-summed gradients, so the per-example step is
on the model side (:func:`keras_dpsgd.keras3.make_private`); it calls
:meth:`DPKeras3Mixin.sanitize`, which runs the same step math as the tf_keras sanitizer
(the DP core, ``keras_dpsgd.dp``) and the same per-example backends. ``apply`` accepts only gradients that
came out of ``sanitize``: a Keras 3 model trained with a DP optimizer but without the DP train
step is refused at its first step.

Under ``tf.distribute.MirroredStrategy`` / ``MultiWorkerMirroredStrategy`` with R replicas
(``keras_dpsgd.step.distribute``): each replica clips its share of the lot, adds its own noise
N(0, σ²C²/R) under a key of its own and divides by the global L; Keras's ``apply`` then SUMs the
R gradients across replicas (``TFOptimizer._all_reduce_sum_gradients``) before one descent step
on every replica, so the update is (ΣS_r + N(0, σ²C²))/L, the one-device release. The counters
(``noised_steps``, Keras's ``iterations``) are mirrored and counted once per step
(``only_first_replica``). Keras's clipnorm/clipvalue and the hooks' own releases are refused under
R > 1 (``DPKeras3Mixin._refuse_unsplit_releases``).

Gradient accumulation under R > 1 (``keras_dpsgd.step.release._TFFront.when_complete``), as on tf_keras:
the cross-replica sum is a synchronization point (merge_call), which tf.distribute cannot run inside
the ``tf.cond`` of a lot's release, so every batch goes through it. Each replica accumulates its
clipped sums for k batches; on the k-th only, it adds N(0, σ²C²/R) under its own key and divides by
the global L; on the other batches it contributes zeros. The descent rule is applied (and Keras's
``iterations``, ``noised_steps`` counted) on the lot's last batch only, inside the cross-replica
update: one noise draw per global lot, and one gradient all-reduce per batch. That update runs the
descent rule and the variables' constraints only: Keras's weight decay and EMA are refused with
accumulation under R > 1.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import keras
import tensorflow as tf

from keras_dpsgd.step import distribute as _distribute
from keras_dpsgd import backends, ledger
from keras_dpsgd.step.classes import make_dp_class
from keras_dpsgd.step.eager import recorded, traced_eagerly, traced_step
from keras_dpsgd.step.settings import DPState
from keras_dpsgd.step.release import LotReleaseMixin
from keras_dpsgd.dp.refusals import refuse

__all__ = [
    "DPKeras3Mixin",
    "DPSGDOptimizer",
    "DPAdamOptimizer",
    "check_dp_optimizer",
    "make_dp_optimizer",
    "NOT_PRIVATE_MESSAGE",
]

# Hook implementations whose own release is split across replicas like the gradient's noise, by
# hook name (adaptive clipping's norm queries: keras_dpsgd.keras3._adaptive registers them).
SPLIT_HOOKS: dict[str, Any] = {}

NOT_PRIVATE_MESSAGE = (
    "{cls}.apply got gradients that did not come from its sanitizer: on Keras 3 the model's train "
    "step computes the private gradient, and this model's train step is not private (training on "
    "would be a non-private step). Fix: model = keras_dpsgd.keras3.make_private(model) before fit "
    "(a model with its own train_step calls keras_dpsgd.keras3.sanitized_gradients). "
    "(Under the 'mixed_float16' policy compile wraps the optimizer in a LossScaleOptimizer, which "
    "rescales the sanitized gradients: use 'float32' or 'mixed_bfloat16'.)"
)


class DPKeras3Mixin(LotReleaseMixin):
    """DP-SGD settings and sanitizer for a Keras 3 optimizer; put before the optimizer class.

    Built by :func:`make_dp_optimizer`, whose constructor (``keras_dpsgd.step.classes``) checks the
    DP arguments, runs the Keras 3 ``__init__`` and then ``_init_dp``. The settings and the
    lot/release state machine are shared with tf_keras (``keras_dpsgd.step.release.LotReleaseMixin``);
    this class supplies Keras 3's hooks: its variables, ``apply`` (with Keras's own accumulation
    kept off), the cross-replica update of a lot and its fit's locals.
    """

    def _init_dp(self, state: DPState) -> None:
        """Stores the checked DP settings (`state`) and makes the optimizer's saved variables."""
        if self.loss_scale_factor is not None:
            raise refuse(
                "loss-scaling",
                f"loss_scale_factor must be None for a DP optimizer, got {self.loss_scale_factor!r}: "
                "the DP train step does not scale the loss",
            )
        self._init_dp_state(state)
        # Counted once per step under a strategy (the replicas are in sync).
        self.noised_steps = self.add_variable(
            (),
            initializer="zeros",
            dtype="int32" if _on_jax() else "int64",  # JAX: int64 needs x64
            aggregation="only_first_replica",
            name="noised_steps",
        )
        # The worst (q, σ_eff) the ledger has charged (keras_dpsgd.ledger reads them as tf.Variables).
        self._ledger_q_max, self._ledger_sigma_min = ledger.add_bound_variables(self)
        # The ledger's copy on the optimizer exists from the start, so that loading a .keras or
        # .weights.h5 file (BackupAndRestore, ModelCheckpoint) restores its segments.
        ledger.ledger_state_holders(None, self)

    def save_own_variables(self, store):
        """.keras (and .weights.h5) saving: the ledger brought up to date first.

        The file keeps this optimizer's copy of the ledger's segments (``keras_dpsgd.ledger``'s Keras 3
        holder), which also holds the steps of an earlier optimizer of the same model (compiled
        again): attaching closes those into it before it is written.
        """
        ledger.attach(ledger.saving_model(self, max_depth=64), self)
        if _on_jax():
            from keras_dpsgd.backends.jax import state as _state

            return _state.save_variables(self, store)  # the noise key and the non-finite count unsaved
        return super().save_own_variables(store)

    # ------------------------------------------------------------ settings
    @property
    def gradient_accumulation_steps(self) -> int | None:
        """k: batches per lot, accumulated by the DP step (:meth:`minimize`); released once per lot.

        Keras's own ``gradient_accumulation_steps`` machinery (which would average k separately
        noised batches) is never used: while Keras's code runs this reads None.
        """
        state = self.__dict__.get("_dp")
        if state is None or state.keras_view:
            return None
        return state.accumulation

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: Any) -> None:
        if value:  # Keras's __init__ assigns its own argument here: None for a DP optimizer.
            raise refuse(
                "keras-accumulation",
                "Keras's own gradient_accumulation_steps would average k separately noised batches, which "
                "is not one DP-SGD lot: pass gradient_accumulation_steps to the keras_dpsgd DP optimizer's "
                f"constructor (the DP step accumulates the clipped sums), got {value!r} for Keras's",
            )

    @contextlib.contextmanager
    def _keras_view(self):
        """Keras's own code (build, apply) runs without its gradient accumulation."""
        self._dp.keras_view += 1
        try:
            yield
        finally:
            self._dp.keras_view -= 1

    @property
    def iterations(self):
        """Descent steps applied: lots (``apply`` runs once per lot)."""
        return self._iterations

    @property
    def ledger_max_sampling_rate(self) -> tf.Variable:
        return _ledger_variable(self._ledger_q_max)

    @property
    def ledger_min_noise_multiplier(self) -> tf.Variable:
        return _ledger_variable(self._ledger_sigma_min)

    def build(self, variables):
        if self.built:
            return
        with self._keras_view():
            super().build(variables)
        # By-name bounds name a variable by its path ("dense/kernel"), which is unique in a model.
        self._build_lot(variables, [getattr(v, "path", v.name) for v in variables])
        if _on_jax():
            from keras_dpsgd.backends.jax import state as _state

            _state.add_variables(self)

    def _bounds_variable(self, bounds: list[float]) -> Any:
        return self.add_variable(
            (len(bounds),),
            initializer=keras.initializers.Constant(bounds),
            dtype="float32",
            # Set in replica context by adaptive clipping, to the same value on every replica.
            aggregation="only_first_replica",
            name="clip_bounds",
        )

    def _value(self, variable: Any) -> Any:
        return variable.value

    # ----------------------------------------------------------- sanitizer
    @tf.autograph.experimental.do_not_convert
    def sanitize(
        self,
        per_example_loss: tf.Tensor,
        variables: Sequence[Any],
        tape: tf.GradientTape | None = None,
        regularization_grads: Sequence[tf.Tensor] | None = None,
    ) -> list[tf.Tensor]:
        """One noised DP-SGD step's gradients (Abadi et al. 2016, Alg. 1), for lots of one batch.

        1-3. per-example gradients, clip, sum (the per-example backend, ``dp.clip.clip_factors``);
        4. noise N(0, σ_v² C_v²) (``dp.release.add_noise``); 5. divide by L (``dp.release.normalize``);
        then the regularization gradient, un-clipped and un-noised (post-processing).

        Args:
          per_example_loss: [B] loss recorded on `tape`; or, called eagerly (TF Privacy's custom loops), a
            callable returning it, traced in a ``tf.function`` of the optimizer's where the same graph
            checks run (``keras_dpsgd.step.eager``).
          variables: the Keras 3 trainable variables, in the order `apply` will get them.
          tape: the tape that recorded the forward pass (None with a loss callable).
          regularization_grads: gradients of a data-independent loss, or None.

        Returns:
          One gradient per variable; pass them to ``apply`` (and nothing else).

        Raises:
          ValueError: with gradient_accumulation_steps > 1 (a lot is several batches: call
            :meth:`minimize`), other variables than the optimizer's, or a multi-replica strategy.
        """
        if self._dp.accumulation > 1:
            raise refuse(
                "sanitize-lot",
                f"with gradient_accumulation_steps = {self._dp.accumulation} a lot is several batches: call "
                "keras_dpsgd.keras3.private_update(optimizer, per_example_loss, variables, tape) (or "
                "optimizer.minimize), which accumulates the lot and applies it once",
            )
        if traced_eagerly(per_example_loss, tape):
            _refuse_callable_on_jax("sanitize")
            variables = list(variables() if callable(variables) else variables)

            def step():
                loss, taped = recorded(per_example_loss, self._checked_variables(variables))
                return self.sanitize(loss, variables, taped, regularization_grads)

            return self._pending(list(traced_step(self, "sanitize", self._checked_variables(variables), step)))
        tf_vars = self._checked_variables(variables)
        # No local named `model` here: the ledger's walk of the stack (saving_model) reads frames' locals, and a
        # converted copy of this method (AutoGraph, before do_not_convert) held such a local as an Undefined value.
        return self._private_step(
            per_example_loss, tf_vars, tape, ledger.saving_model(self), regularization_grads, variables
        )

    @tf.autograph.experimental.do_not_convert
    def minimize(
        self,
        per_example_loss: tf.Tensor,
        variables: Sequence[Any],
        tape: tf.GradientTape | None = None,
        regularization_grads: Sequence[tf.Tensor] | None = None,
        *,
        model: Any = None,
    ) -> None:
        """One DP-SGD update, or one batch of a lot (``gradient_accumulation_steps`` = k > 1).

        With k > 1 the clipped sums of k batches are accumulated; after the k-th the lot is
        released once (noise drawn once, divided by L, one ``apply``) and ``noised_steps``
        counts it. An incomplete lot is discarded, never released nor carried over, at every
        epoch start and at the end of `model`'s ``fit``, and on load (``discard_partial_lot``).

        `per_example_loss`, `variables`, `tape` and `regularization_grads` are as for :meth:`sanitize`.

        Args:
          model: the model being trained (its ``fit`` marks the lot boundaries); None in a
            custom loop, which calls ``discard_partial_lot()`` where a lot is interrupted.
        """
        if traced_eagerly(per_example_loss, tape):
            _refuse_callable_on_jax("minimize")
            variables = list(variables() if callable(variables) else variables)

            def step():
                loss, taped = recorded(per_example_loss, self._checked_variables(variables))
                self.minimize(loss, variables, taped, regularization_grads, model=model)

            traced_step(self, "minimize", self._checked_variables(variables), step)
            return
        self._watch_lot_boundaries(model)
        if self._dp.accumulation == 1:
            self.apply(self.sanitize(per_example_loss, variables, tape, regularization_grads), variables)
            return
        tf_vars = self._checked_variables(variables)
        self._private_step(per_example_loss, tf_vars, tape, ledger.saving_model(self), regularization_grads, variables)

    def _apply_release(self, grads, variables) -> None:
        self.apply(grads, variables)

    def _count_replica_lot(self, num_examples) -> None:
        """Nothing inside the lot's conditional: ``noised_steps`` (ONLY_FIRST_REPLICA) synchronizes,
        so it is counted outside (``_apply_lot_across_replicas``)."""

    def _apply_lot_across_replicas(self, grads, tf_vars, complete) -> None:
        """Counts the lot (``noised_steps``, outside the conditional: it synchronizes), SUMs `grads`
        across the replicas (every batch), then applies the descent rule and the variables'
        constraints inside the cross-replica update, on the lot's last batch only."""
        self.noised_steps.assign_add(tf.cast(complete, tf.int64))
        summed = self._all_reduce_sum_gradients(list(zip(grads, tf_vars)))
        tf.__internal__.distribute.interim.maybe_merge_call(
            self._update_on_lot_end, self._distribution_strategy, summed, self.learning_rate
        )
        self._iterations.assign_add(tf.cast(complete, self._iterations.dtype))

    def _update_on_lot_end(self, distribution, grads_and_vars, learning_rate) -> None:
        """Cross-replica context: each variable's update (and constraint), gated to a lot's end."""

        def update(var, grad, learning_rate):
            def step():
                self.update_step(grad, var, learning_rate)
                constraint = self._trainable_variables[self._get_variable_index(var)].constraint
                if constraint is not None:
                    var.assign(constraint(var))
                return tf.constant(True)

            return tf.cond(self._lot_complete(), step, lambda: tf.constant(False))

        for grad, var in grads_and_vars:
            distribution.extended.update(var, update, args=(grad, learning_rate), group=False)

    def _checked_variables(self, variables: Sequence[Any]) -> list[tf.Variable]:
        """The TF variables of `variables`, which must be those the optimizer is built with."""
        variables = list(variables)
        _distribute.check_strategy(type(self).__name__)
        if _distribute.num_replicas() > 1:
            self._refuse_unsplit_releases()
        if not self.built:
            with tf.init_scope():
                self.build(variables)
        if [id(v) for v in variables] != [id(v) for v in self._trainable_variables]:
            raise refuse(
                "sanitize-variables",
                "sanitize needs the variables the optimizer was built with, in the same order (the clip "
                f"bounds are per variable): got {[getattr(v, 'path', v.name) for v in variables]}, built with "
                f"{[getattr(v, 'path', v.name) for v in self._trainable_variables]}",
            )
        return [v.value if isinstance(v, keras.Variable) else v for v in variables]

    def _refuse_unsplit_releases(self) -> None:
        """Under R > 1 replicas: refuses what would act on one replica's share before the cross-replica
        sum (Keras's clipnorm/clipvalue, a hook's own release), which the noise split does not cover."""
        name = type(self).__name__
        if self._dp.accumulation > 1:
            fixes = {
                "weight_decay": "weight_decay=None (a kernel_regularizer with make_private instead)",
                "use_ema": "use_ema=False",
            }
            for option, fix in fixes.items():
                if getattr(self, option):
                    raise refuse(
                        "replica-lot-options",
                        f"{name}({option}={getattr(self, option)!r}, gradient_accumulation_steps="
                        f"{self._dp.accumulation}) under {_distribute.num_replicas()} replicas: the lot's update, "
                        "gated to its last batch inside the cross-replica update, applies the descent rule only, "
                        f"not Keras's {option}; set {fix}, gradient_accumulation_steps=1, or train on one device",
                    )
            if getattr(self, "_adaptive", None) is not None:
                raise refuse(
                    "replica-lot-options",
                    f"{name}(gradient_accumulation_steps={self._dp.accumulation}) under "
                    f"{_distribute.num_replicas()} replicas: adaptive clipping's norm query is released inside "
                    "the lot's conditional, where the replicas cannot sum it, so the bounds would never move; set "
                    "gradient_accumulation_steps=1 (a larger global batch), or train on one device",
                )
        for option in ("clipnorm", "clipvalue", "global_clipnorm"):
            if getattr(self, option, None) is not None:
                raise refuse(
                    "replica-clipping",
                    f"{name}({option}={getattr(self, option)!r}) under {_distribute.num_replicas()} replicas: Keras "
                    "clips each replica's gradient before the cross-replica sum, where it holds only 1/R of the "
                    f"noise; set {option}=None (the DP step clips per example with l2_norm_clip)",
                )
        for hook in ("on_per_example_sq_norms", "add_noise", "normalize", "on_noised_step"):
            if getattr(type(self), hook) not in (getattr(DPKeras3Mixin, hook), SPLIT_HOOKS.get(hook)):
                raise refuse(
                    "replica-own-release",
                    f"{name} overrides {hook} (gradient canaries, a hook of its own, ...): its own release is not "
                    f"split across the {_distribute.num_replicas()} replicas of the strategy, which is supported "
                    "for the plain DP optimizers and adaptive clipping only; train it on one device (no strategy, "
                    "or OneDeviceStrategy)",
                )

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        """Applies the descent rule to gradients that came out of ``sanitize`` only."""
        grads = list(grads)
        self._take_pending(grads, NOT_PRIVATE_MESSAGE.format(cls=type(self).__name__))
        with self._keras_view():
            return super().apply(grads, trainable_variables)

    # ------------------------------------------------------- fit's lot boundaries
    def load_own_variables(self, store):
        """.keras loading; a lot saved mid-way is discarded (never resumed)."""
        if _on_jax():
            from keras_dpsgd.backends.jax import state as _state

            super().load_own_variables(_state.saved_store(self, store))
            _state.after_load(self)
        else:
            super().load_own_variables(store)
        if backends.is_torch():
            from keras_dpsgd.keras3._torch_front import noise_keys

            noise_keys(self).renew()  # fresh OS entropy: a file restored twice never replays noise
            self._dp.nonfinite.assign(0)
        self.discard_partial_lot("saved in the loaded file")

    def _fit_locals(self, model: Any) -> dict:
        frame = ledger.fit_frame(model)
        return frame.f_locals if frame is not None else {}

    def _fit_steps_per_epoch(self, model: Any) -> int | None:
        return getattr(self._fit_locals(model).get("epoch_iterator"), "num_batches", None)

    def _first_epoch_of_fit(self, model: Any) -> bool:
        where = self._fit_locals(model)
        return bool(where) and where.get("epoch") == where.get("initial_epoch")

    def _first_step_of_fit(self, model: Any) -> bool:
        """Keras 3: traced at the first step of this fit, after its first epoch began."""
        return self._first_epoch_of_fit(model) and self._fit_locals(model).get("begin_step") == 0


def _on_jax() -> bool:
    return backends.is_jax()


def _refuse_callable_on_jax(method: str) -> None:
    """A loss callable is traced with TensorFlow (``keras_dpsgd.step.eager``): refused by name on JAX."""
    if _on_jax():
        raise refuse(
            "own-train-step",
            f"{method}(loss_fn, variables) with a loss callable needs the TensorFlow backend (its step is traced "
            "in a tf.function); on JAX, train with fit after keras_dpsgd.keras3.make_private(model)",
        )


def _ledger_variable(variable: Any) -> Any:
    """The ledger's view of a saved bound: the tf.Variable (TensorFlow), the Keras variable (JAX, torch)."""
    return variable if _on_jax() or backends.is_torch() else variable.value


_DP_DOC = """
    Privacy arguments (Abadi et al. 2016, Algorithm 1), as for the tf_keras classes:
      l2_norm_clip: C > 0 (flat clipping), a list (one bound per trainable variable, in
        `model.trainable_variables` order) or a dict by variable path/name (per-layer clipping).
      noise_multiplier: σ >= 0 (one per variable allowed with per-layer clipping).
      clipping: "clip" (default) or "normalize" (per-example normalization, l2_norm_clip=None),
        as for the tf_keras classes; stability: its γ > 0 (default 0.01).
      gradient_accumulation_steps: k >= 1 batches form one lot: the clipped sums of k batches
        are accumulated by the DP step, noise is drawn and the update applied once per lot
        (`noised_steps` counts lots). An incomplete lot is discarded (`discarded_lots`,
        `discarded_batches`, a warning) at every epoch start and end of fit and on load, as
        on tf_keras. Keras's own accumulation (which averages separately noised batches) is
        never used.
      expected_lot_size: divide the noised sum by this L; None divides by the realized batch size.
      sampling_rate: q, read by the accountant.
      per_example_backend: "auto", "reference" or "fast".
      jacobian_fallback: "warn" (default: a variable no fast per-example rule reads takes exact
        per-example jacobians, about B times the cost of its gradient, with one warning per traced
        step naming it and the op that stopped the analysis) or "refuse" (ValueError at the first
        step, before any update). `per_example_report` holds the last traced step's report.
      seed: None (OS entropy, never checkpointed) or an integer (reproducible noise; keep it secret).
      num_microbatches: None only (TF Privacy's default); any other value is refused.

    The model's train step must be private: `keras_dpsgd.keras3.make_private(model)`. Without it
    the first step raises. Not supported on Keras 3: loss_scale_factor, mixed_float16 loss
    scaling.
"""

_DP_CLASSES: dict[type, type] = {}


def _register(cls: type) -> type:
    return keras.saving.register_keras_serializable(package="keras_dpsgd", name=cls.__name__)(cls)


def make_dp_optimizer(optimizer_cls: type, *, name: str | None = None) -> type:
    """Returns a private version of a Keras 3 optimizer class (e.g. ``keras.optimizers.Adam``).

    The class takes `l2_norm_clip` and `noise_multiplier` first, then the DP keywords and every
    argument of `optimizer_cls` as keywords; it is registered for Keras serialization under
    package "keras_dpsgd" (call this before loading a model saved with it). The same class is
    returned for the same `optimizer_cls`.

    Raises:
      TypeError: if `optimizer_cls` is not a Keras 3 optimizer class (a tf_keras class belongs
        to ``keras_dpsgd.tf_keras._optimizer.make_dp_optimizer``), or is private already.
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, keras.optimizers.Optimizer)):
        raise TypeError(
            "optimizer_cls must be a Keras 3 optimizer class (a subclass of keras.optimizers.Optimizer; "
            "for tf_keras use keras_dpsgd.tf_keras._optimizer.make_dp_optimizer), "
            f"got {optimizer_cls!r}"
        )
    # Keras's own gradient accumulation stays off (the DP step accumulates lots).
    doc = f"Private Keras 3 {optimizer_cls.__name__}: its descent rule on sanitized gradients.\n" + _DP_DOC
    kinds = dict(module="keras_dpsgd.keras3", register=_register, cache=_DP_CLASSES, error=TypeError)
    base = None
    if backends.is_torch():  # Keras's fused torch update (torch._foreach) where it has one, as Keras's SGD(...) takes
        from keras_dpsgd.backends.torch import keras_optimizer_base

        base = keras_optimizer_base(optimizer_cls)
    return make_dp_class(optimizer_cls, DPKeras3Mixin, name=name, doc=doc, base=base, **kinds)


DPSGDOptimizer = make_dp_optimizer(keras.optimizers.SGD, name="DPSGDOptimizer")
DPAdamOptimizer = make_dp_optimizer(keras.optimizers.Adam, name="DPAdamOptimizer")


def check_dp_optimizer(optimizer: Any) -> DPKeras3Mixin:
    """`optimizer` if it is a Keras 3 DP optimizer; else a ValueError saying why the step would not be private."""
    if isinstance(optimizer, DPKeras3Mixin):
        return optimizer
    inner = getattr(optimizer, "inner_optimizer", None)
    if isinstance(inner, DPKeras3Mixin):
        raise refuse(
            "loss-scaling",
            "the DP optimizer is wrapped in a LossScaleOptimizer (the 'mixed_float16' policy): loss "
            "scaling would rescale the sanitized gradients and is not supported; use the 'float32' "
            "or 'mixed_bfloat16' policy, or compile(..., auto_scale_loss=False) to train in "
            "'mixed_float16' without loss scaling (float16 gradients may underflow; an example whose "
            "gradient overflows is zeroed and counted in nonfinite_examples)",
        )
    raise refuse(
        "no-private-step",
        "a private train step needs a keras_dpsgd Keras 3 DP optimizer (e.g. "
        f"keras_dpsgd.keras3.DPSGDOptimizer), got {type(optimizer).__name__}: training on would not be "
        "private. Compile with a DP optimizer.",
    )

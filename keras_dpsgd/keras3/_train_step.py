"""The private train step of a Keras 3 model (TensorFlow backend; JAX: ``keras3._jax_train_step``).

Keras 3's ``train_step`` reduces the loss and hands the optimizer only the batch-summed gradient,
so the per-example step is on the model side: :func:`make_private` gives a model a train step that

1. runs the forward pass on a tape and takes the compiled loss *unreduced*: one loss per example;
2. hands it to the DP optimizer's sanitizer (per-example clipped sums through the per-example
   backend, noise, normalization: ``DPKeras3Mixin.sanitize``);
3. adds the gradient of the weight regularizers (``kernel_regularizer`` ...), un-clipped and
   un-noised: a function of the weights only, so post-processing;
4. applies the optimizer's descent rule (``optimizer.apply``) and updates the metrics as Keras does.

With the optimizer's ``gradient_accumulation_steps`` = k > 1, steps 2-4 run once per lot of k
batches (``DPKeras3Mixin.minimize``): the clipped sums are accumulated, noise is drawn once and
the descent rule applied once; :func:`private_update` is the same for a model's own step.

Compile alone cannot install this step: Keras 3 offers no supported hook that sees the
per-example loss and the tape (``optimizer.scale_loss`` gets the reduced scalar, after sample
weights, masks and ``model.losses`` were folded in), so :func:`make_private` is required and a DP
optimizer refuses to apply gradients that did not come from its sanitizer.
"""

from __future__ import annotations

import types
from typing import Any, Sequence

import keras
import tensorflow as tf

from keras_dpsgd.step import display as _display
from keras_dpsgd.step.augment import Augmentation, check_augmentation
from keras_dpsgd import backends, ledger
from keras_dpsgd.backends.tensorflow.graph import refuse_grouped_convolution_layers
from keras_dpsgd.step.loss import per_example_values, refuse_data_losses, regularization_gradients
from keras_dpsgd.keras3._loss import per_example_loss, weight_regularization
from keras_dpsgd.keras3._optimizer import check_dp_optimizer
from keras_dpsgd.keras3._refusals import refuse_adapted_preprocessing, refuse_example_mixing
from keras_dpsgd.step.lots import is_lots_dataset
from keras_dpsgd.step.prebuild import build_before_the_trace
from keras_dpsgd.dp.refusals import refuse

__all__ = [
    "make_private",
    "private_update",
    "sanitized_gradients",
    "per_example_loss",
    "refuse_example_mixing",
    "refuse_adapted_preprocessing",
]

_PRIVATE_ATTR = "_keras_dpsgd_private"
_AUGMENTATION_ATTR = "_keras_dpsgd_augmentation"

# The trainer hooks through which Keras's own train step on each backend computes the loss and its gradient
# (keras/src/backend/<backend>/trainer.py). The private step computes each example's loss itself, from the
# compiled loss, so it would never run an override of one: refused, on every backend alike.
_LOSS_HOOKS = {
    "tensorflow": ("train_step", "compute_loss", "_compute_loss"),
    "jax": ("train_step", "compute_loss_and_updates", "stateless_compute_loss", "compute_loss", "_compute_loss"),
    "torch": ("train_step", "compute_loss", "_compute_loss"),
}

_OWN_STEP_MESSAGE = (
    "make_private cannot make {cls} private: it overrides {method}, which Keras's train step on the {backend} "
    "backend runs to compute the loss and its gradient; the private train step computes each example's loss "
    "itself, from the compiled loss, and would silently skip the override. Put the loss in compile(loss=...): "
    "a function loss(y_true, y_pred) returning one value per example (it may read the model's weights), and "
    "weight penalties in kernel_regularizer=... (added un-clipped and un-noised). On the TensorFlow backend only "
    "(a model's own step is not built on JAX), your own train_step may compute the per-example loss (shape "
    "[batch]) on a tf.GradientTape and call keras_dpsgd.keras3.private_update(self.optimizer, loss, "
    "self.trainable_variables, tape), which sanitizes and applies the gradients (or accumulates a lot); or, for "
    "lots of one batch, grads = keras_dpsgd.keras3.sanitized_gradients(self.optimizer, loss, "
    "self.trainable_variables, tape), then self.optimizer.apply(grads, self.trainable_variables)."
)


def _prepared(optimizer, per_example_loss, variables, tape, regularization_loss):
    """Checks the arguments of a model's own step; the regularization gradient (or None)."""
    optimizer = check_dp_optimizer(optimizer)
    # An eager step, or the reference backend, would take pfor jacobians through a grouped convolution.
    refuse_grouped_convolution_layers(ledger.saving_model(optimizer), optimizer._backend)
    variables = list(variables)
    loss = per_example_values(
        per_example_loss,
        tape,
        lambda shape: f"per_example_loss must have shape [batch_size], got {shape}: it was reduced over the batch",
    )
    tf_vars = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    reg_grads = regularization_gradients(regularization_loss, tf_vars, tape, "regularization_loss")
    return optimizer, loss, variables, reg_grads


def sanitized_gradients(
    optimizer: Any,
    per_example_loss: tf.Tensor,
    variables: Sequence[Any],
    tape: tf.GradientTape,
    *,
    regularization_loss: tf.Tensor | None = None,
) -> list[tf.Tensor]:
    """The DP-SGD gradients of one step, for a model's own ``train_step`` (lots of one batch).

    Args:
      optimizer: the model's keras_dpsgd Keras 3 DP optimizer.
      per_example_loss: the loss of each example, shape [B] (other axes are averaged), recorded
        on `tape`.
      variables: the trainable variables (``self.trainable_variables``).
      tape: the GradientTape that recorded the forward pass; persistent if
        `regularization_loss` is given.
      regularization_loss: a scalar that depends on the weights only (never on the data), added
        un-clipped and un-noised; None for none.

    Returns:
      One gradient per variable, to pass to ``optimizer.apply(grads, variables)``.

    Raises:
      ValueError: a non-DP optimizer, a reduced (scalar) loss, a regularization loss with a
        non-persistent tape, or gradient_accumulation_steps > 1 (use :func:`private_update`).
    """
    if detail := _not_built_here("keras_dpsgd.keras3.sanitized_gradients (a model's own train step)"):
        raise refuse("own-train-step", detail)
    optimizer, loss, variables, reg_grads = _prepared(optimizer, per_example_loss, variables, tape, regularization_loss)
    return optimizer.sanitize(loss, variables, tape, reg_grads)


def private_update(
    optimizer: Any,
    per_example_loss: tf.Tensor,
    variables: Sequence[Any],
    tape: tf.GradientTape,
    *,
    regularization_loss: tf.Tensor | None = None,
    model: keras.Model | None = None,
) -> None:
    """One DP-SGD update (sanitize, then apply), or one batch of a lot, for a model's own step.

    The arguments are those of :func:`sanitized_gradients`; with the optimizer's
    ``gradient_accumulation_steps`` = k > 1 the clipped sums of k batches make one lot, released
    and applied once (``DPKeras3Mixin.minimize``). `model` (default: the model whose method calls
    this, found on the call stack) marks the lot boundaries of its ``fit``.
    """
    if detail := _not_built_here("keras_dpsgd.keras3.private_update (a model's own train step)"):
        raise refuse("own-train-step", detail)
    optimizer, loss, variables, reg_grads = _prepared(optimizer, per_example_loss, variables, tape, regularization_loss)
    if model is None:
        model = ledger.saving_model(optimizer)
    optimizer.minimize(loss, variables, tape, reg_grads, model=model)


@tf.autograph.experimental.do_not_convert
def _private_train_step(self: keras.Model, data: Any) -> dict:
    """The DP train step installed by :func:`make_private` (module docstring, steps 1-4)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    views = getattr(self, _AUGMENTATION_ATTR, None)
    if views is not None:  # K views of each example, rows i·K .. i·K+K-1 (keras_dpsgd.step.augment)
        x, y, sample_weight = views.views(x), views.repeat(y), views.repeat(sample_weight)
    optimizer = check_dp_optimizer(self.optimizer)
    refuse_adapted_preprocessing(self)
    refuse_grouped_convolution_layers(self, optimizer._backend)  # Only the fast backend reads them exactly.
    ledger.attach(self, optimizer)  # At trace time: the ledger is the model's (a new optimizer adds to it).
    variables = list(self.trainable_variables)
    num_weight_terms = sum(1 for v in self.trainable_weights if getattr(v, "regularizer", None) is not None)
    with tf.GradientTape(persistent=num_weight_terms > 0) as tape:
        y_pred = self(x, training=True)
        losses = per_example_loss(self, y, y_pred, sample_weight)  # one value per view with augmentation
        example_losses = losses if views is None else views.mean_over_views(losses)  # ℓ_i = mean_k ℓ_ik
        refuse_example_mixing(self, example_losses)  # Frozen BatchNormalization proven from the traced step.
        refuse_data_losses(
            len(self.losses), num_weight_terms, own_step="train_step (keras_dpsgd.keras3.sanitized_gradients)"
        )
        regularization = weight_regularization(self)
    private_update(optimizer, example_losses, variables, tape, regularization_loss=regularization, model=self)
    # The logged loss and metrics: means over the real rows (padding of Poisson lots excluded); with
    # augmentation over the real views, i.e. the mean over examples of the mean over their K views.
    rows = _display.real_rows(sample_weight)
    total, count = _display.real_mean(losses, rows)
    if regularization is not None:
        total = total + tf.cast(regularization, total.dtype)
    self._loss_tracker.update_state(total, sample_weight=count)
    if rows is not None:
        y, y_pred, sample_weight = (_display.real_rows_only(s, rows) for s in (y, y_pred, sample_weight))
    logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    if _is_multi_worker(self):
        # Keras reduces each log with strategy.reduce("MEAN", v, axis=0) under several workers, which
        # needs an axis: one value per replica, averaged into the scalar Keras logs.
        logs = tf.nest.map_structure(lambda v: tf.reshape(v, [-1]) if v.shape.rank == 0 else v, logs)
    return logs


# fit's parameters before `shuffle` (after x): y, batch_size, epochs, verbose, callbacks,
# validation_split, validation_data.
_BEFORE_SHUFFLE = 7


def _fit(self: keras.Model, x: Any = None, *args, **kwargs):
    """Keras's ``fit``; on ``PoissonLots.dataset()`` with ``shuffle=False`` unless given.

    Lots are independent draws, so there is nothing to shuffle, and Keras warned on every such fit
    that it ignores its default ``shuffle=True`` for a dataset.
    """
    if is_lots_dataset(x) and len(args) < _BEFORE_SHUFFLE + 1:
        kwargs.setdefault("shuffle", False)
    if backends.is_torch():
        from keras_dpsgd.keras3._torch_train_step import prepare_fit

        prepare_fit(self)  # host-side checks before Keras's own build
        return type(self).fit(self, x, *args, **kwargs)
    if backends.is_jax():
        from keras_dpsgd.keras3._jax_train_step import prepare_fit, values_kept_on_refusal

        prepare_fit(self)  # JAX traces the step with the variables purged: host-side work first
        if is_lots_dataset(x):
            from keras_dpsgd.keras3._jax_loss import build_compiled_loss

            build_compiled_loss(self, x)  # Keras's own build would pair a [B] weight with a [B, T] loss's tokens
        with values_kept_on_refusal(self):
            return type(self).fit(self, x, *args, **kwargs)
    build_before_the_trace(self, strategy=getattr(self, "_distribute_strategy", None))  # traced once
    return type(self).fit(self, x, *args, **kwargs)


def _train_on_batch(self: keras.Model, *args, **kwargs):
    """Keras's ``train_on_batch``, refused while the optimizer holds a Poisson rate (``_fed_data``): on JAX
    the stateless step never reaches the checks of the TensorFlow step, so the refusal comes first here."""
    from keras_dpsgd.step.fed_data import check_fed_data

    check_fed_data(self, self.optimizer, outside_fit=True)
    return type(self).train_on_batch(self, *args, **kwargs)


def _is_multi_worker(model: keras.Model) -> bool:
    return isinstance(getattr(model, "_distribute_strategy", None), tf.distribute.MultiWorkerMirroredStrategy)


def _reduce_first_batch_per_leaf(model: keras.Model) -> None:
    """Under MultiWorkerMirroredStrategy: Keras's symbolic build reduces the first batch leaf by leaf.

    Keras 3 (``TensorFlowTrainer._maybe_symbolic_build``) reads the first batch of a distributed
    dataset and calls ``strategy.reduce("MEAN", (x, y, sample_weight))`` on the whole tuple,
    which MultiWorkerMirroredStrategy refuses (it reduces one value at a time). This instance
    (no Keras class is changed) reads that batch the same way and reduces each leaf; the batch
    only gives shapes to build the model, never trains it.
    """
    if not _is_multi_worker(model) or "_maybe_symbolic_build" in vars(model):
        return
    strategy = model._distribute_strategy
    build = model._maybe_symbolic_build

    def reduce_leaf(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.reduce("MEAN", value, axis=None)
        return value

    def maybe_symbolic_build(iterator=None, data_batch=None):
        if iterator is not None:
            for _, _, batches in iterator:
                data_batch = tf.nest.map_structure(reduce_leaf, next(batches))
                break
        return build(data_batch=data_batch)

    model._maybe_symbolic_build = maybe_symbolic_build


def _no_automatic_xla(model: keras.Model) -> None:
    """``compile(jit_compile="auto")`` (Keras's default) resolves to False for this instance.

    Keras turns XLA on for "auto" where a GPU is present. XLA ignores run-time assertions, so there
    the per-example backends' checks (a reshape keeping whole examples, an unrolled loop equal to
    the layer, the jacobian against a plain backward pass) become verdicts: a failing batch adds
    noise only, is counted in ``nonfinite_examples`` and is logged once, instead of stopping the
    fit with the reason. That trade is the user's to make: ``jit_compile=True`` still compiles the
    private step with XLA. (A model compiled with "auto" before ``make_private`` keeps what Keras
    resolved then; compile after it, or pass ``jit_compile=False``.)
    """
    model._resolve_auto_jit_compile = lambda: False


def _overridden(model: keras.Model, method: str) -> bool:
    return getattr(type(model), method) is not getattr(keras.Model, method)


def check_backend() -> str:
    """The Keras 3 backend, refused unless it is TensorFlow, JAX or torch (``keras_dpsgd.backends``).

    Raises:
      ValueError: naming the backend and the way out (KERAS_BACKEND=tensorflow, jax or torch).
    """
    backend = keras.backend.backend()
    if backend not in _LOSS_HOOKS:
        raise ValueError(
            f"keras_dpsgd supports Keras 3 with the TensorFlow, JAX and torch backends, got the {backend!r} backend "
            f"(KERAS_BACKEND={backend}): its per-example gradients, clipping and noise are written for TensorFlow, "
            "JAX and torch. Set KERAS_BACKEND=tensorflow, jax or torch before importing keras (or unset it), or "
            "use tf_keras (TF_USE_LEGACY_KERAS=1)."
        )
    return backend


def _not_built_here(what: str) -> str | None:
    """On the stateless backends (JAX, torch), where `what` is not built: the detail of its refusal, naming it."""
    if backends.is_jax():
        from keras_dpsgd.backends.jax import not_built

        return not_built(what)
    if backends.is_torch():
        from keras_dpsgd.backends.torch import not_built

        return not_built(what)
    return None


def _call_in_training(augmentation: Any, x: Any) -> Any:
    """One view: a Keras layer called in training mode (its random transforms on), else `augmentation(x)`."""
    if isinstance(augmentation, keras.layers.Layer):
        return augmentation(x, training=True)
    return augmentation(x)


def make_private(model: keras.Model, *, augmentation: Any = None, augmentation_multiplicity: int = 1) -> keras.Model:
    """Gives a Keras 3 model (Sequential, functional or subclassed) the private train step.

    The DP settings stay on the optimizer: compile with a keras_dpsgd Keras 3 DP optimizer
    (before or after this call) and a loss Keras can take unreduced (a name such as "mse", a
    ``keras.losses.Loss`` object or a function). The model is changed in place (its instance's
    ``train_step``; no Keras class is modified) and returned. Saved and reloaded models lose the
    private step; their DP optimizer then refuses the first step until ``make_private`` is called
    again.

    Args:
      model: the Keras 3 model.
      augmentation: augmentation multiplicity (De et al. 2022): a Keras layer (called with
        ``training=True``, e.g. ``keras.Sequential([keras.layers.RandomTranslation(0.1, 0.1)])``)
        or a callable ``x -> augmented x``, called once per view inside the train step (fresh
        randomness for each view); None: each view is the batch itself, made to differ by the
        model's own random layers, if any.
      augmentation_multiplicity: K in [1, 256], views per example. The loss of an example is the
        mean of its K views' losses, so its gradient (the mean of the views' gradients) is clipped
        once: one example still contributes one clipped vector, and the privacy ledger is that of
        the step without augmentation. Metrics and the logged loss are means over the views.
        (``keras_dpsgd.step.augment``.) Not built on JAX (refused there).

    Raises:
      TypeError: `model` is not a Keras 3 model; `augmentation` is not callable.
      ValueError: Keras 3 runs on a backend other than TensorFlow or JAX; the model overrides a hook
        through which Keras's train step computes the loss: ``train_step``, ``compute_loss``,
        ``_compute_loss``, and on JAX ``compute_loss_and_updates`` and ``stateless_compute_loss`` (the
        way out: the compiled loss and weight regularizers; on TensorFlow, :func:`private_update` in the
        model's own step);
        `augmentation_multiplicity` is not an integer in [1, 256]; augmentation on JAX.
        (A BatchNormalization layer in training mode, or an augmentation that mixes the examples
        such as MixUp, is refused at the first step: :func:`refuse_example_mixing`.)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"make_private needs a Keras 3 keras.Model, got {type(model).__name__} (a tf_keras model: "
            "keras_dpsgd.tf_keras.make_private, needed only for weight regularizers)"
        )
    augmentation, multiplicity = check_augmentation(augmentation, augmentation_multiplicity)
    views = Augmentation(augmentation, multiplicity, _call_in_training)
    backend = check_backend()
    detail = _not_built_here(
        "augmentation multiplicity (make_private(augmentation=..., augmentation_multiplicity=...))"
    )
    if views.active and detail:
        raise refuse("augmentation-not-applied", detail)
    for method in _LOSS_HOOKS[backend]:
        if _overridden(model, method):
            raise refuse(
                "own-loss-hook", _OWN_STEP_MESSAGE.format(cls=type(model).__name__, method=method, backend=backend)
            )
    if backends.is_jax(backend):
        from keras_dpsgd.keras3._jax_train_step import private_train_step

        model.train_step = types.MethodType(private_train_step, model)
    elif backends.is_torch(backend):
        from keras_dpsgd.keras3._torch_train_step import private_train_step as torch_train_step

        model.train_step = types.MethodType(torch_train_step, model)
        model._resolve_auto_jit_compile = lambda: False  # torch.compile of the private step is refused
    else:
        model.train_step = types.MethodType(_private_train_step, model)
        _reduce_first_batch_per_leaf(model)
        _no_automatic_xla(model)
    model.fit = types.MethodType(_fit, model)
    model.train_on_batch = types.MethodType(_train_on_batch, model)
    setattr(model, _PRIVATE_ATTR, True)
    object.__setattr__(model, _AUGMENTATION_ATTR, views if views.active else None)  # untracked by Keras
    model.train_function = None  # Rebuilt on the next fit with the private step.
    return model


def is_private(model: keras.Model) -> bool:
    """True if :func:`make_private` gave `model` the private train step."""
    return bool(getattr(model, _PRIVATE_ATTR, False))

"""The private train step of a Keras 3 model on the JAX backend (stateless: ``train_step(state, data)``).

Abadi et al. 2016, Algorithm 1, as on TensorFlow: the DP core's ``keras_dpsgd.dp.step.private_step``, with
JAX's front end (``_jax_front.JaxFront``: the optimizer's variables as the step's values). Here, for one batch:

1. per-example gradients: ``jax.vmap`` over the batch of ``jax.grad`` of one example's compiled
   loss through ``model.stateless_call`` on a batch of one (no layer can mix examples); with
   ``per_example_backend="auto"`` the layers with rules (``ghost``) are differentiated at their
   pre-activation outputs instead, their norms and clipped sums taken from inputs and output gradients;
2. the clipped sum given the core's clip factors (:func:`_clipped_sum`; non-finite examples zeroed);
3. the core does the rest: the lot of k batches (released on its k-th only, ``jax.lax.cond``: one noise
   draw per lot), noise N(0, σ_v² C_v²) from the core's sampler, divided by L, ``noised_steps`` + 1; the
   front end adds the gradient of the weight regularizers (data-independent: no clip, no noise) and, with
   adaptive clipping, releases the lot's bound queries (``_adaptive_values``);
4. the optimizer's descent rule (``optimizer.stateless_apply``) and the metrics as Keras updates
   them (the logged loss: the mean over the real rows, padding of Poisson lots excluded).

Under ``keras.distribution.DataParallel`` steps 1-2 run per device and are summed over the devices
(``keras3._jax_distribute``); step 3 runs once: one noise draw per lot, one ``noised_steps``.

Everything the step checks it checks when it is traced (a data-dependent ``add_loss``, a
non-trainable variable written from an example's data such as BatchNormalization's moving
statistics in training mode), before any weight changes. Host-side work (attaching the ledger,
the lot boundaries of ``fit``) happens before ``fit`` runs (:func:`prepare_fit`), while Keras's
variables still hold their values.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import keras
from keras.src import backend as keras_backend

from keras_dpsgd import ledger
from keras_dpsgd.backends.jax import ghost as _ghost, not_built
from keras_dpsgd.backends.jax._per_example import clipped_sum, sq_norms
from keras_dpsgd.backends.jax.ops import JAX_OPS
from keras_dpsgd.dp.step import Clip, private_step
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.keras3 import _adaptive_values as _adaptive
from keras_dpsgd.keras3._jax_distribute import (
    DataParallelMesh,
    check_replicated,
    data_parallel_mesh,
    per_device,
    varying,
)
from keras_dpsgd.keras3._jax_front import JaxFront, OptimizerState, clipping_of
from keras_dpsgd.keras3._jax_loss import per_example_loss_at
from keras_dpsgd.keras3._jax_metrics import real_mean, unweighted_metrics_on_real_rows
from keras_dpsgd.keras3._optimizer import check_dp_optimizer

__all__ = [
    "private_train_step",
    "prepare_fit",
    "values_kept_on_refusal",
    "check_optimizer",
]

_HOOKS = ("on_per_example_sq_norms", "add_noise", "normalize", "on_noised_step", "_noise_key", "standard_normal")


def check_optimizer(optimizer: Any) -> None:
    """Refuses, by name, the DP optimizer features not built on JAX."""
    from keras_dpsgd.keras3._bandmf import BandMFMixin
    from keras_dpsgd.keras3._optimizer import DPKeras3Mixin
    from keras_dpsgd.step.adaptive import AdaptiveClippingCore

    cls = type(optimizer)
    # The step runs no hook: it does DPKeras3Mixin's release, adaptive clipping's (``_adaptive``) and BandMF's
    # (``_jax_front.JaxFront._correlated``).
    adaptive = _adaptive.is_adaptive(optimizer)
    bandmf = [BandMFMixin.add_noise] if isinstance(optimizer, BandMFMixin) else []
    for hook in _HOOKS:
        allowed = [getattr(DPKeras3Mixin, hook, None)] + ([getattr(AdaptiveClippingCore, hook, None)] * adaptive)
        allowed += bandmf if hook == "add_noise" else []
        if not any(getattr(cls, hook, None) is a for a in allowed):
            raise refuse(
                "own-release-hooks",
                not_built(f"{cls.__name__} overrides {hook} (gradient canaries, a hook of its own): optimizer hooks"),
            )
    if optimizer.per_example_backend not in ("auto", "reference"):
        raise refuse(
            "per-example-backend-choice",
            not_built(
                f"per_example_backend={optimizer.per_example_backend!r} (JAX takes 'auto': norm rules where a layer has "
                "one, else jax.vmap; or 'reference': jax.vmap for every variable)"
            ),
        )


def _check_model(model: keras.Model) -> None:
    if data_parallel_mesh(model) is not None:  # refuses any other distribution by name
        check_replicated(model)
        if getattr(model.optimizer, "bandmf_bands", None) is not None:
            raise refuse(
                "keras-distribution",
                not_built(
                    f"{type(model.optimizer).__name__} under keras.distribution.DataParallel (BandMF's noise history "
                    "is not tested across devices)"
                ),
            )


def prepare_fit(model: keras.Model) -> None:
    """Before a fit (variables still hold values): checks, the ledger attached, the lot boundaries watched."""
    from keras_dpsgd.keras3._refusals import refuse_adapted_preprocessing

    optimizer = check_dp_optimizer(model.optimizer)
    check_optimizer(optimizer)
    _check_model(model)
    refuse_adapted_preprocessing(model)
    ledger.attach(model, optimizer)
    optimizer._watch_lot_boundaries(model, check_data=False)  # no fit frame yet: checked at the epoch start


@contextlib.contextmanager
def values_kept_on_refusal(model: keras.Model):
    """Puts the variables' values back when a fit fails before its first step ran (a refusal at trace time).

    Keras's JAX fit takes the values out of the variables before the first step (to pass them to the
    stateless step) and puts them back only once a step has run; a step refused when it is traced
    would leave a model without weights. The values were never donated then, so they are restored.
    """
    optimizer = model.optimizer
    if model.built and optimizer is not None and not optimizer.built:
        # Keras's fit builds it before its first step; built here, its variables' values are kept too (a refused
        # optimizer whose variables were emptied could not be read again when the model is compiled anew).
        optimizer.build(model.trainable_variables)
    variables = list(model.variables) + list(optimizer.variables) + list(model.metrics_variables)
    kept = [(v, v._value) for v in variables]
    try:
        yield
    except BaseException:
        for variable, value in kept:
            if variable._value is None and value is not None and not value.is_deleted():
                variable._value = value
        raise


def _seed_positions(model) -> list[int]:
    """Where the random seed states (Dropout's, ...) are among the model's non-trainable variables."""
    states = {
        id(generator.state)
        for layer in model._flatten_layers(include_self=True, recursive=True)
        for generator in getattr(layer, "_seed_generators", ())
    }
    return [j for j, v in enumerate(model.non_trainable_variables) if id(v) in states]


def _example_seeds(model, non_trainable, x) -> list:
    """Each example's seed states: example i runs with every ``[seed, counter]`` as ``[seed + i, counter]``."""
    batch = next(leaf for leaf in keras.tree.flatten(x) if leaf is not None).shape[0]
    offsets = jnp.stack([jnp.arange(batch), jnp.zeros(batch, jnp.int32)], axis=1)
    return [non_trainable[j][None] + offsets.astype(non_trainable[j].dtype) for j in _seed_positions(model)]


def _per_example(model, trainable, non_trainable, x, y, sample_weight, tap=None, seeds=None):
    """(per-example gradients [B, ...] per variable, losses [B], y_pred, new non-trainable values).

    With a `tap` (``_ghost.Plan``) the gradients are those of ``tap.params(trainable)`` and the covered
    layers' inputs are left in ``tap.captured`` (no weighted gradient then).

    Each example draws its own randomness (a Dropout mask of its own, :func:`_example_seeds`, or
    `seeds` given by the caller); the states then advance as in one call.
    """
    kwargs = {"training": True} if model._call_has_training_arg else {}
    num_weight_terms = sum(1 for v in model.trainable_weights if getattr(v, "regularizer", None) is not None)
    data_losses = []
    non_trainable = list(non_trainable)
    seed_pos = _seed_positions(model)
    other_pos = [j for j in range(len(non_trainable)) if j not in seed_pos]
    batch = next(leaf for leaf in keras.tree.flatten(x) if leaf is not None).shape[0]
    seeds = _example_seeds(model, non_trainable, x) if seeds is None else seeds

    def loss_of_one(params, seeds_i, xi, yi, wi):
        xb, yb, wb = keras.tree.map_structure(lambda a: None if a is None else a[None], (xi, yi, wi))
        values = list(non_trainable)
        for j, seed in zip(seed_pos, seeds_i):
            values[j] = seed
        if tap is None:
            y_pred, new_values, losses = model.stateless_call(params, values, xb, return_losses=True, **kwargs)
            loss = per_example_loss_at(model, params, new_values, yb, y_pred, wb)[0]
            captured = []
        else:
            with tap.applied(params, trainable) as (full, captured, watch):
                y_pred, new_values, losses = model.stateless_call(full, values, xb, return_losses=True, **kwargs)
                with watch():  # a covered variable read by the loss would be read outside its layer's call
                    loss = per_example_loss_at(model, full, new_values, yb, y_pred, wb)[0]
        data_losses.append(len(losses) - num_weight_terms)
        new_seeds = [new_values[j] for j in seed_pos]
        return loss, (loss, y_pred, [new_values[j] for j in other_pos], new_seeds, captured)

    try:
        grads, (losses, y_pred, new_others, new_seeds, captured) = jax.vmap(
            jax.grad(loss_of_one, has_aux=True), in_axes=(None, 0, 0, 0, 0), out_axes=(0, (0, 0, None, 0, 0))
        )(trainable if tap is None else tap.params(trainable), seeds, x, y, sample_weight)
    except ValueError as err:
        if "out_axes" not in str(err) and "vmap has mapped output" not in str(err):
            raise
        raise refuse(
            "batch-statistic-stored",
            "the private step writes a non-trainable variable from an example's data (e.g. BatchNormalization's "
            "moving statistics in training mode): it would publish a value of the batch outside the ledger, and "
            "batch statistics mix examples. Freeze the layer (layer.trainable = False: inference mode) or use "
            "LayerNormalization/GroupNormalization",
        ) from err
    if data_losses and data_losses[-1] > 0:
        raise refuse(
            "data-losses",
            f"the model added {data_losses[-1]} loss term(s) with add_loss (e.g. an activity_regularizer): they may "
            "depend on the data, so their gradient cannot be added without clipping and noise. Fold them into the "
            "compiled loss, or use weight regularizers (kernel_regularizer), which the private step adds un-noised.",
        )
    new_values = list(non_trainable)
    for j, value in zip(other_pos, new_others):
        new_values[j] = value
    for j, value in zip(seed_pos, new_seeds):
        new_values[j] = value[0] if batch else non_trainable[j]  # example 0 ran with the state itself
    y_pred = keras.tree.map_structure(lambda a: a[:, 0], y_pred)  # [B, 1, ...] -> [B, ...]
    if tap is not None:
        tap.captured = captured
        return grads, losses, y_pred, new_values, None

    def weighted_gradient(weights):
        """∇ Σ_i w_i ℓ_i, each ℓ_i computed on its own (vmap, the same seeds): Σ_i w_i g_i by linearity."""

        def total(params):
            per_example = jax.vmap(lambda *a: loss_of_one(*a)[0], in_axes=(None, 0, 0, 0, 0))
            return jnp.sum(jax.lax.stop_gradient(weights) * per_example(params, seeds, x, y, sample_weight))

        return [g.astype(jnp.float32) for g in jax.grad(total)(trainable)]

    def again():
        """The per-example gradients computed again (a branch of its own: pass 1's need not be kept)."""
        return list(
            jax.vmap(jax.grad(loss_of_one, has_aux=True), in_axes=(None, 0, 0, 0, 0))(
                trainable, seeds, x, y, sample_weight
            )[0]
        )

    weighted_gradient.again = again

    return list(grads), losses, y_pred, new_values, weighted_gradient


def _regularization(model, trainable):
    """(Σ weight regularizers, its gradient per variable) at `trainable`, or (None, None)."""
    variables = model.trainable_variables
    if not any(getattr(v, "regularizer", None) is not None for v in variables):
        return None, None

    def total(params):
        terms = [
            jnp.sum(v.regularizer(p)).astype(jnp.float32)
            for v, p in zip(variables, params)
            if getattr(v, "regularizer", None) is not None
        ]
        return sum(terms)

    return jax.value_and_grad(total)(trainable)


def _clipped_sum(grads, weighted_gradient, clip: Clip) -> list:
    """Σ_i c_i g_i per variable of one batch, the factors c from `clip` (the core's ``dp.step.Clip``).

    Flat clipping (one group): the squared norms from the per-example gradients, then the clipped
    sum as one weighted backward pass ∇ Σ_i c_i ℓ_i (= Σ_i c_i g_i by linearity; each ℓ_i still
    computed on its own), which never materializes c_i·g_i. Where that sum is not finite (an
    example with factor 0 whose gradient holds NaN/Inf: 0·NaN in the backward pass), and with
    per-layer clipping, the sum is taken over the per-example gradients with every zero-factor
    example replaced by exact zeros (``_per_example.clipped_sum``).
    """
    factors = clip(sq_norms(grads))
    if max(clip.groups) > 0:
        return clipped_sum(grads, lambda _: factors)[0]
    fast = weighted_gradient(factors[:, 0])
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in fast]))
    summed = jax.lax.cond(ok, lambda: fast, lambda: clipped_sum(weighted_gradient.again(), lambda _: factors)[0])
    return list(summed)


def clipped_sum_per_device(
    where: DataParallelMesh, model, optimizer, bounds, trainable, non_trainable, x, y, sample_weight
) -> tuple:
    """(clipped sum of the batch, finite rows [B, 1], losses [B], y_pred, new non-trainable values).

    Steps 1-2 of the private step (``_per_example``, ``_clipped_sum``) on
    each device's examples, the clipped sums ``psum``-ed; each example's seed states are those of
    the one-device step (taken from its place in the whole batch), and the new non-trainable values
    are device 0's (its example 0 is the batch's).
    """
    seeds = _example_seeds(model, list(non_trainable), x)

    def local(bounds, trainable, non_trainable, seeds, x, y, sample_weight):
        trainable = varying(list(trainable), where)
        grads, losses, y_pred, new_values, weighted_gradient = _per_example(
            model, trainable, non_trainable, x, y, sample_weight, seeds=seeds
        )
        clip = Clip(JAX_OPS, *clipping_of(optimizer, bounds))  # the step's clip factors, on this device's rows
        summed = _clipped_sum(grads, weighted_gradient, clip)
        return summed, (clip.finite, losses, y_pred), new_values

    summed, (finite, losses, y_pred), new_values = per_device(
        local, where, (bounds, list(trainable), list(non_trainable)), (seeds, x, y, sample_weight)
    )
    return summed, finite, losses, y_pred, [v[0] for v in new_values]


def private_train_step(self: keras.Model, state: Any, data: Any) -> tuple:
    """The DP train step installed on a JAX-backend model by ``keras_dpsgd.keras3.make_private``."""
    trainable, non_trainable, optimizer_values, metrics_values = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    optimizer = check_dp_optimizer(self.optimizer)
    check_optimizer(optimizer)
    opt = OptimizerState(optimizer, optimizer_values)
    trainable = list(trainable)

    where = data_parallel_mesh(self)
    kwargs = {"training": True} if self._call_has_training_arg else {}
    batch = next(leaf for leaf in keras.tree.flatten(x) if leaf is not None).shape[0]
    auto = optimizer.per_example_backend == "auto" and where is None and batch > 0  # B = 0: the vmap path
    ghost = (
        _ghost.plan(self, trainable, non_trainable, x, kwargs, y, sample_weight, per_example_loss_at) if auto else None
    )
    out = {}  # what the per-example computation returns besides the clipped sum
    if where is not None:  # keras.distribution.DataParallel: the clipped sum per device, psum-ed (_jax_distribute)

        def clipped_sum_of(clip):
            summed, clip.finite, *rest = clipped_sum_per_device(
                where, self, optimizer, opt[optimizer.clip_bounds], trainable, non_trainable, x, y, sample_weight
            )  # each device's factors are this Clip's, on its rows (adaptive clipping is refused here)
            out.update(zip(("losses", "y_pred", "non_trainable"), rest))
            return summed, jnp.float32(batch)

    elif ghost is None:
        grads, *rest, weighted_gradient = _per_example(self, trainable, non_trainable, x, y, sample_weight)
        out.update(zip(("losses", "y_pred", "non_trainable"), rest))

        def clipped_sum_of(clip):
            return _clipped_sum(grads, weighted_gradient, clip), jnp.float32(batch)

    else:  # covered layers' norms and sums from their inputs and output gradients (_ghost)
        before = list(non_trainable)
        grads, *rest, _ = _per_example(self, trainable, before, x, y, sample_weight, ghost)
        out.update(zip(("losses", "y_pred", "non_trainable"), rest))

        def clipped_sum_of(clip):
            summed = ghost.clipped_sum(grads, trainable, before, lambda sq: (clip(sq), clip.finite), clip.groups)[0]
            return summed, jnp.float32(batch)

    regularization, reg_grads = _regularization(self, trainable)
    # Algorithm 1 (clip, sum, the lot, noise, normalize, count): the DP core's, once for every backend.
    trainable = private_step(JaxFront(optimizer, opt, trainable, reg_grads), clipped_sum_of)
    losses, y_pred, non_trainable = out["losses"], out["y_pred"], out["non_trainable"]

    # The logged loss (real rows only) and Keras's metrics.
    total, count = real_mean(losses, sample_weight)
    if regularization is not None:
        total = total + regularization
    with keras_backend.StatelessScope(state_mapping=list(zip(self.metrics_variables, metrics_values))) as scope:
        self._loss_tracker.update_state(total, sample_weight=count)
        with unweighted_metrics_on_real_rows(self, y, y_pred, sample_weight):
            logs = self.compute_metrics(x, y, y_pred, sample_weight)
    new_metrics = []
    for ref, value in zip(self.metrics_variables, metrics_values):
        current = scope.get_current_value(ref)
        new_metrics.append(value if current is None else current)
    return logs, (trainable, list(non_trainable), opt.values, new_metrics)

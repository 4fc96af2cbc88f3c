"""The private train step of a Keras 3 model on the torch backend (eager: ``train_step(data)``).

Abadi et al. 2016, Algorithm 1, as on TensorFlow and JAX: the DP core's ``keras_dpsgd.dp.step.private_step``
with this backend's front end (``keras3._torch_front.TorchFront``), for one batch:

1. per-example gradients: ``torch.func.vmap`` over the batch of ``torch.func.grad`` of one example's compiled
   loss through ``model.stateless_call`` on a batch of one (no layer can mix examples;
   ``keras_dpsgd.backends.torch.per_example_grads``), with norm rules for the covered layers (``ghost``); where
   every trainable variable is covered, the vmapped forward's backward pass is autograd's over the batched operations
   (``perturbation_grads``: the same per-example output gradients, without functorch's grad transform);
2. the core's clip factors (flat or per group) and the clipped sum, non-finite examples zeroed and counted;
3. with ``gradient_accumulation_steps`` = k > 1 the core's lot of k batches, kept in the optimizer's
   ``dp_accumulator`` variables, released on its k-th batch only: one noise draw per lot;
4. the core's release: noise N(0, σ_v² S_v²) (S_v the sensitivity the clipped sum carries) from the core's
   sampler over this backend's words, divided by L (``expected_lot_size``, else the realized number of
   examples), plus the gradient of the weight regularizers (data-independent: no clip, no noise);
   ``noised_steps`` counts it;
5. the optimizer's descent rule (``optimizer.apply``, which takes the release only) and the metrics (the logged
   loss: the mean over the real rows, padding of Poisson lots excluded).

The step is eager (Keras's torch trainer runs ``train_step`` as Python; ``jit_compile=True``, i.e.
``torch.compile``, is refused), so the core's ``cond`` on the lot's completion is a Python ``if``. Refused
before any weight changes: a non-trainable variable written from an example's data (BatchNormalization in
training mode: the vmapped step would return a value per example), ``add_loss`` terms, optimizer hooks of one's own
and the other features not built on torch (by name, ``keras_dpsgd.backends.torch.not_built``). Adaptive clipping
releases the lot's bound queries with the gradient (``TorchFront``, the core's rules).
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import torch
from keras import ops

from keras_dpsgd import ledger
from keras_dpsgd.backends import torch as torch_backend
from keras_dpsgd.backends.torch import ghost
from keras_dpsgd.dp.step import private_step
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.keras3 import _adaptive_values as _adaptive
from keras_dpsgd.keras3._bandmf import BandMFMixin
from keras_dpsgd.keras3._optimizer import DPKeras3Mixin, check_dp_optimizer
from keras_dpsgd.keras3._torch_front import TorchFront
from keras_dpsgd.keras3._torch_loss import per_example_loss_at

__all__ = ["private_train_step", "prepare_fit", "check_optimizer"]

_HOOKS = ("on_per_example_sq_norms", "add_noise", "normalize", "on_noised_step", "_noise_key", "standard_normal")
_PREPARED_ATTR = "_dp_torch_prepared"

_BATCH_WRITE = (
    "the private step writes a non-trainable variable from an example's data (e.g. BatchNormalization's moving "
    "statistics in training mode): it would publish a value of the batch outside the ledger, and batch statistics "
    "mix examples. Freeze the layer (layer.trainable = False: inference mode) or use "
    "LayerNormalization/GroupNormalization"
)


def check_optimizer(optimizer: Any) -> None:
    """Refuses, by name, the DP optimizer features not built on torch."""
    from keras_dpsgd.step.adaptive import AdaptiveClippingCore

    cls = type(optimizer)
    # The step runs no hook: TorchFront does DPKeras3Mixin's release, adaptive clipping's (``_adaptive_values``) and
    # BandMF's (its add_noise is TensorFlow's).
    adaptive = _adaptive.is_adaptive(optimizer)
    bandmf = [BandMFMixin.add_noise] if isinstance(optimizer, BandMFMixin) else []
    for hook in _HOOKS:
        allowed = [getattr(DPKeras3Mixin, hook, None)] + ([getattr(AdaptiveClippingCore, hook, None)] * adaptive)
        allowed += bandmf if hook == "add_noise" else []
        if not any(getattr(cls, hook, None) is a for a in allowed):
            raise refuse(
                "own-release-hooks",
                torch_backend.not_built(
                    f"{cls.__name__} overrides {hook} (gradient canaries, a hook of its own): optimizer hooks"
                ),
            )
    if optimizer.per_example_backend not in torch_backend.PER_EXAMPLE_CHOICES:
        raise refuse(
            "per-example-backend-choice",
            torch_backend.not_built(
                f"per_example_backend={optimizer.per_example_backend!r} (torch takes 'auto' or 'reference': "
                "torch.func.vmap gradients)"
            ),
        )


def prepare_fit(model: keras.Model) -> None:
    """Before a fit or a step outside fit: checks, the ledger attached, the lot boundaries watched."""
    from keras_dpsgd.keras3._refusals import refuse_adapted_preprocessing

    optimizer = check_dp_optimizer(model.optimizer)
    check_optimizer(optimizer)
    if model.jit_compile is True:
        raise refuse(
            "torch-jit-compile",
            torch_backend.not_built("compile(jit_compile=True) (torch.compile of the private step)"),
        )
    if keras.distribution.distribution() is not None:
        raise refuse(
            "keras-distribution",
            torch_backend.not_built(f"keras.distribution ({type(keras.distribution.distribution()).__name__})"),
        )
    refuse_adapted_preprocessing(model)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    ledger.attach(model, optimizer)
    optimizer._watch_lot_boundaries(model, check_data=False)  # the fed data: checked at every epoch start
    object.__setattr__(model, _PREPARED_ATTR, optimizer)


def _per_example(model, trainable, non_trainable, x, y, sample_weight, the_plan=None):
    """(per-example gradients [B, ...] per variable, losses [B], y_pred, new non-trainable values, taps).

    With a plan (``keras_dpsgd.backends.torch.ghost``) the gradients are those of the uncovered variables only,
    and `taps` holds (∂ℓ/∂z per covered call, each call's inputs); else None.
    """
    kwargs = {"training": True} if model._call_has_training_arg else {}
    num_weight_terms = sum(1 for v in model.trainable_weights if getattr(v, "regularizer", None) is not None)
    data_losses = []
    positions = {id(v): i for i, v in enumerate(model.trainable_variables)}

    def forward(full, xi, yi, wi, watching=contextlib.nullcontext):
        xb, yb, wb = keras.tree.map_structure(lambda a: None if a is None else a[None], (xi, yi, wi))
        y_pred, new_values, losses = model.stateless_call(full, non_trainable, xb, return_losses=True, **kwargs)
        with watching():  # a compiled loss that reads a covered kernel
            loss = per_example_loss_at(model, full, new_values, yb, y_pred, wb)[0]
        data_losses.append(len(losses) - num_weight_terms)
        return loss, y_pred, list(new_values)

    if the_plan is None:

        def loss_of_one(params, xi, yi, wi):
            loss, y_pred, new_values = forward(params, xi, yi, wi)
            return loss, ((loss, y_pred, []), new_values)

        params = trainable
    else:
        x_one = keras.tree.map_structure(lambda a: None if a is None else a[:1], x)
        ghost.probe(the_plan, trainable, non_trainable, x_one, kwargs)
        raw = {id(v): trainable[positions[id(v)]] for v in the_plan.covered}
        raw.update({id(v): n for v, n in zip(model.non_trainable_variables, non_trainable)})

        def loss_of_one(args, xi, yi, wi):
            others, zs = args
            full = list(trainable)
            for v, p in zip(the_plan.others, others):
                full[positions[id(v)]] = p
            with the_plan.tapped("tap", zs, raw) as inputs:
                loss, y_pred, new_values = forward(full, xi, yi, wi, the_plan.watching)
            return loss, ((loss, y_pred, list(inputs)), new_values)

        zeros = [torch.zeros(shape, dtype=torch.float32) for shape in the_plan.shapes]
        params = [[trainable[positions[id(v)]] for v in the_plan.others], zeros]
    try:
        if the_plan is not None and not the_plan.others:  # perturbations only: autograd's backward pass
            zs, aux = torch_backend.perturbation_grads(
                lambda zs, *e: loss_of_one(([], zs), *e), zeros, x, y, sample_weight
            )
            grads, ((losses, y_pred, inputs), new_values) = ([], zs), aux
        else:
            grads, ((losses, y_pred, inputs), new_values) = torch_backend.per_example_grads(
                loss_of_one, params, x, y, sample_weight
            )
    except torch_backend.BatchWrite as err:
        raise refuse("batch-statistic-stored", _BATCH_WRITE) from err
    if data_losses and data_losses[-1] > 0:
        raise refuse(
            "data-losses",
            f"the model added {data_losses[-1]} loss term(s) with add_loss (e.g. an activity_regularizer): they may "
            "depend on the data, so their gradient cannot be added without clipping and noise. Fold them into the "
            "compiled loss, or use weight regularizers (kernel_regularizer), which the private step adds un-noised.",
        )
    y_pred = keras.tree.map_structure(lambda a: a[:, 0], y_pred)  # [B, 1, ...] -> [B, ...]
    if the_plan is None:
        return list(grads), losses, y_pred, new_values, None
    others, deltas = grads
    return list(others), losses, y_pred, new_values, (list(deltas), list(inputs))


def _regularization(model, trainable):
    """(Σ weight regularizers, its gradient per variable) at `trainable`, or (None, None)."""
    variables = model.trainable_variables
    if not any(getattr(v, "regularizer", None) is not None for v in variables):
        return None, None

    def total(params):
        terms = [
            ops.sum(ops.cast(v.regularizer(p), "float32"))
            for v, p in zip(variables, params)
            if getattr(v, "regularizer", None) is not None
        ]
        return sum(terms)

    grads, value = torch.func.grad_and_value(total)(list(trainable))
    return value, grads


_PLAN_ATTR = "_dp_torch_plan"


def _plan_of(model, optimizer, batch: int):
    """The model's ghost plan under per_example_backend="auto" (None: the vmap path for every variable)."""
    if optimizer.per_example_backend != "auto" or batch == 0:
        return None
    key = tuple(id(v) for v in model.trainable_variables)
    cached = model.__dict__.get(_PLAN_ATTR)
    if cached is None or cached[0] != key:
        cached = (key, ghost.plan(model, per_example=True))
        object.__setattr__(model, _PLAN_ATTR, cached)
    return cached[1]


def _per_example_clipped_sum(model, optimizer, clip, trainable, non_trainable, x, y, sample_weight):
    """(Σ_i clip(g_i) per variable, losses, y_pred, new non-trainable values): steps 1-3 (`clip`: the core's
    ``dp.step.Clip``, squared norms -> factors)."""
    batch = next(leaf for leaf in keras.tree.flatten(x) if leaf is not None).shape[0]
    the_plan = _plan_of(model, optimizer, batch)
    if the_plan is not None:
        others, losses, y_pred, new_values, taps = _per_example(
            model, trainable, non_trainable, x, y, sample_weight, the_plan
        )
        deltas, inputs = taps
        outside = ghost.reads_outside(the_plan)
        if not outside:
            calls = {id(layer): [] for layer, _ in the_plan.layers}
            for layer, a, d in zip(the_plan.owners, inputs, deltas):
                calls[id(layer)].append((a, d))
            values = {id(v): t for v, t in zip(model.trainable_variables, trainable)}
            values.update({id(v): t for v, t in zip(model.non_trainable_variables, non_trainable)})
            summed, _, _ = ghost.clipped_sums(
                the_plan, calls, values, lambda sq: (clip(sq), clip.finite), optimizer._clip_groups(), others
            )
            return summed, losses, y_pred, new_values
        names = [f"{layer.name} ({type(layer).__name__})" for layer in outside]
        ghost.announce_uncovered(names, "a variable of the layer is read outside its own call")
        kept = [(layer, rule) for layer, rule in the_plan.layers if layer not in outside]
        plan = ghost.Plan(model, kept, the_plan.variables) if kept else None
        object.__setattr__(model, _PLAN_ATTR, (model.__dict__[_PLAN_ATTR][0], plan))
        return _per_example_clipped_sum(model, optimizer, clip, trainable, non_trainable, x, y, sample_weight)
    grads, losses, y_pred, new_values, _ = _per_example(model, trainable, non_trainable, x, y, sample_weight)
    summed = torch_backend.clipped_sum(grads, clip(torch_backend.sq_norms(grads)))
    return summed, losses, y_pred, new_values


def _real_rows(sample_weight):
    """bool [B]: the rows with a nonzero sample weight (``keras_dpsgd.step._display.real_rows``'s rule), or None."""
    rows = None
    for w in keras.tree.flatten(sample_weight):
        if w is None:
            continue
        nonzero = torch.as_tensor(w) != 0
        if nonzero.dim() > 1:
            nonzero = torch.any(nonzero.reshape(nonzero.shape[0], -1), dim=1)
        rows = nonzero if rows is None else rows | nonzero
    return rows


def _log(model, x, y, y_pred, sample_weight, losses, regularization) -> dict:
    """The logged loss (the mean over the real rows) and Keras's metrics on the real rows."""
    rows = _real_rows(sample_weight)
    losses = losses.detach().to(torch.float32)
    kept = losses if rows is None else losses[rows]
    count = kept.shape[0]
    total = kept.sum() / max(count, 1)
    if regularization is not None:
        total = total + regularization.detach()
    model._loss_tracker.update_state(total, sample_weight=count)
    if rows is not None:
        y, y_pred, sample_weight = (
            keras.tree.map_structure(lambda a: None if a is None else a[rows], s) for s in (y, y_pred, sample_weight)
        )
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def private_train_step(self: keras.Model, data: Any) -> dict:
    """The DP train step installed on a torch-backend model by ``keras_dpsgd.keras3.make_private``."""
    data = keras.tree.map_structure(lambda a: None if a is None else ops.convert_to_tensor(a), data)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)  # train_on_batch hands numpy arrays
    optimizer = check_dp_optimizer(self.optimizer)
    if self.__dict__.get(_PREPARED_ATTR) is not optimizer:  # train_on_batch, or a new optimizer
        prepare_fit(self)
    variables = list(self.trainable_variables)
    trainable = [v.value.detach() for v in variables]
    non_trainable = [v.value.detach() for v in self.non_trainable_variables]
    regularization, reg_grads = _regularization(self, trainable)
    out = {}

    def clipped_sum(clip):  # steps 1-3 (the core's private_step runs them, then the lot and the release)
        summed, out["losses"], out["y_pred"], out["new_values"] = _per_example_clipped_sum(
            self, optimizer, clip, trainable, non_trainable, x, y, sample_weight
        )
        return summed, torch.tensor(float(out["losses"].shape[0]))

    front = TorchFront(optimizer, variables, reg_grads)
    front.draw_ahead()  # this release's noise on a second thread while the clipped sum is computed
    try:
        private_step(front, clipped_sum)
    finally:
        front.close()
    with torch.no_grad():
        for variable, value in zip(self.non_trainable_variables, out["new_values"]):
            if value is not variable.value:
                variable.assign(value)
    losses, y_pred = out["losses"], out["y_pred"]
    return _log(self, x, y, y_pred, sample_weight, losses, regularization)

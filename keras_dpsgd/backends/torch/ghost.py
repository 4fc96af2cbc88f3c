"""Per-example clipped sums on torch without per-example weight gradients for the layers it knows (ghost clipping).

The exact path (``_per_example``) differentiates each example's loss, on a batch of one under ``torch.func.vmap``,
with respect to every trainable variable: B full gradients. Here the same vmapped backward pass is taken with
respect to a zero perturbation ``z`` added to the pre-activation output of each *covered* layer call (and to the
other trainable variables, as before), as on JAX (``keras_dpsgd.backends.jax.ghost``). It returns, per example i
and call c, the layer's input ``a_ic`` and its output gradient ``δ_ic = ∂ℓ_i/∂z_c``; the layer's norms and clipped
sum come from them (``_rules``: closed forms, or a vector-Jacobian product of the layer alone). Mixing is
impossible by construction: the forward and backward passes run under ``torch.func.vmap`` on batches of one.

A covered variable read anywhere but in its own layer's call (weight tying, a custom layer reading another's
kernel, a compiled loss reading a kernel) would lose that use's gradient. Every read of a covered variable in the
model's call and the compiled loss is therefore watched in the step (``_layer_forms.ReadWatch``, as on JAX: Keras
reads a variable through its ``StatelessScope``); a layer whose variable is read outside its own call is taken off
the plan and the step recomputed on the exact path (announced by name), never run with a lost use.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from keras_dpsgd.backends import _layer_forms as _forms
from keras_dpsgd.backends.torch._rules import per_example_grads, pre_at, rule_for, weighted_sums
from keras_dpsgd.dp.refusals import refuse

__all__ = ["Plan", "plan", "announce_uncovered"]

_LOG = logging.getLogger("keras_dpsgd")
_ANNOUNCED: set = set()


def announce_uncovered(names: list[str], why: str) -> None:
    """One warning per set of layers that take the exact vmap path (a slower path is never silent)."""
    key = (tuple(names), why)
    if names and key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        _LOG.warning(
            "keras_dpsgd (torch): the per-example gradients of %s are computed under torch.func.vmap (%s): "
            "exact, about B times the memory of their gradient",
            ", ".join(names),
            why,
        )


class Plan:
    """The covered layers of one model and one input shape: their rules, the variables they cover, their calls."""

    def __init__(self, model, layers: list, variables: list):
        self.model = model
        self.layers = layers  # [(layer, rule)]
        self.variables = variables  # the model's trainable variables, in order
        covered = {id(v) for layer, _ in layers for v in layer.trainable_variables}
        self.covered = [v for v in variables if id(v) in covered]
        self.others = [v for v in variables if id(v) not in covered]
        self.shapes: list | None = None  # the pre-activation shape of each covered call, in call order
        self.owners: list = []  # the layer of each call
        self.signature = None  # the input signature the shapes were probed on
        self.reads = _forms.ReadWatch([layer for layer, _ in layers])  # the last "tap"'s reads outside the calls
        self._mode = None
        self._calls: list = []
        self._raw: dict = {}

    @contextlib.contextmanager
    def tapped(self, mode: str, zs=None, raw=None):
        """Covered layers' calls intercepted: "probe" records their pre-activation shapes, "tap" adds `zs` to
        the pre-activations and records the inputs, each call reading its variables at `raw` (id -> value), and
        watches the covered variables' reads in the model's call (and under :meth:`watching`: the loss)."""
        self._mode, self._calls, self._zs, self._raw = mode, [], zs, raw or {}
        self.reads = _forms.ReadWatch([layer for layer, _ in self.layers])
        patched = []
        try:
            for layer, rule in self.layers:
                patched.append((layer, vars(layer).get("call")))
                object.__setattr__(layer, "call", self._call_of(layer, rule))
            if mode == "tap":
                patched.append((self.model, vars(self.model).get("call")))
                object.__setattr__(self.model, "call", self._watched(self.model.call))
            with self.reads.reads_seen():
                yield self._calls
        finally:
            for obj, own in reversed(patched):
                if own is None:
                    vars(obj).pop("call", None)
                else:
                    object.__setattr__(obj, "call", own)
            self._mode = None

    def watching(self):
        """The covered variables' reads are checked while this is open (inside :meth:`tapped`)."""
        return self.reads.watch()

    def _watched(self, model_call):
        def call(*args, **kwargs):
            with self.reads.watch():
                return model_call(*args, **kwargs)

        return call

    def _call_of(self, layer, rule):
        def call(inputs, *args, **kwargs):
            if args or {k: v for k, v in kwargs.items() if k != "training"}:
                raise refuse("per-example-check", f"{layer.name}: a covered layer called with more than its input")
            values = self._raw or {id(v): v.value for v in layer.variables}
            with self.reads.own_call(layer):
                inputs = rule.tap(layer, inputs)
                pre = pre_at(layer, rule, inputs, values)
            if self._mode == "probe":
                self.owners.append(layer)
                self._calls.append(tuple(pre.shape))
            else:
                pre = pre.add_(self._zs[len(self._calls)])  # pre's own buffer (a new tensor of this call)
                self._calls.append(inputs)
            return rule.post(layer, pre)

        return call


def plan(model, per_example: bool) -> Plan | None:
    """The covered layers of `model` (None: no layer has a rule); the others are announced by name."""
    if not per_example:
        return None
    layers, uncovered = [], []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if not layer.trainable_variables:
            continue
        sublayers = list(layer._flatten_layers(include_self=False, recursive=True))
        if sublayers:  # a container: its sublayers are visited; weights of its own take the vmap path
            inner = {id(v) for sub in sublayers for v in sub.trainable_variables}
            if any(id(v) not in inner for v in layer.trainable_variables):
                uncovered.append(f"{layer.name} ({type(layer).__name__})")
            continue
        rule = rule_for(layer)
        if rule is None:
            uncovered.append(f"{layer.name} ({type(layer).__name__})")
        else:
            layers.append((layer, rule))
    announce_uncovered(uncovered, "no norm rule for this layer type on torch")
    return Plan(model, layers, list(model.trainable_variables)) if layers else None


def probe(the_plan: Plan, trainable, non_trainable, x_one, kwargs) -> None:
    """The covered calls' pre-activation shapes on one example (a forward pass, no gradient), once per input
    signature (the shapes and dtypes of one example's inputs)."""
    signature = tuple((tuple(a.shape[1:]), str(a.dtype)) for a in torch.utils._pytree.tree_leaves(x_one))
    if the_plan.signature == signature:
        return
    owners = []
    the_plan.owners = owners
    with torch.no_grad(), the_plan.tapped("probe") as calls:
        the_plan.model.stateless_call(trainable, non_trainable, x_one, **kwargs)
    the_plan.shapes, the_plan.signature = list(calls), signature


def clipped_sums(the_plan: Plan, calls_by_layer, values, factors_of, groups, other_grads):
    """(Σ_i clip(g_i) per trainable variable in order, finite rows [B, 1], sq [B, V]).

    `calls_by_layer`: {layer: [(a [B, 1, ...], δ [B, 1, ...])]}; `other_grads`: the uncovered variables'
    per-example gradients [B, *shape] (vmap); `values`: id -> the trainable values.
    """
    from keras_dpsgd.backends.torch._per_example import contiguous_layout

    with contiguous_layout():
        return _clipped_sums(the_plan, calls_by_layer, values, factors_of, groups, other_grads)


def _clipped_sums(the_plan, calls_by_layer, values, factors_of, groups, other_grads):
    from keras_dpsgd.backends.torch._per_example import clipped_sum, staged_sq_norms
    from keras_dpsgd.dp import rounding as _rounding

    index = {id(v): i for i, v in enumerate(the_plan.variables)}
    columns: dict = {}
    materialized: dict = {}  # id -> [B, *shape]: a layer's per-example gradients where no closed form served
    for layer, rule in the_plan.layers:
        calls = calls_by_layer[id(layer)]
        found = rule.sq_norms(layer, calls, layer.trainable_variables) or {}
        missing = [v for v in layer.trainable_variables if id(v) not in found]
        if missing:
            grads = per_example_grads(layer, rule, calls, values, missing)
            found.update({id(v): _rounding.positive_upper(*staged_sq_norms(g)) for v, g in zip(missing, grads)})
            materialized.update({id(v): g for v, g in zip(missing, grads)})
        columns.update(found)
    for v, g in zip(the_plan.others, other_grads):
        columns[id(v)] = _rounding.positive_upper(*staged_sq_norms(g))
    sq = torch.stack([columns[id(v)] for v in the_plan.variables], dim=1)
    factors, finite = factors_of(sq)
    summed: dict = {}
    for layer, rule in the_plan.layers:
        variables = layer.trainable_variables
        if all(id(v) in materialized for v in variables):  # book-keeping: the sum of what is already there
            cols = factors[:, [index[id(v)] for v in variables]]
            summed.update(
                {id(v): s for v, s in zip(variables, clipped_sum([materialized[id(v)] for v in variables], cols))}
            )
            continue
        calls = calls_by_layer[id(layer)]
        summed.update(weighted_sums(layer, rule, calls, values, factors, finite[:, 0], index, groups))
    if the_plan.others:
        other_factors = factors[:, [index[id(v)] for v in the_plan.others]]
        summed.update({id(v): s for v, s in zip(the_plan.others, clipped_sum(other_grads, other_factors))})
    return [summed[id(v)] for v in the_plan.variables], finite, sq


def reads_outside(the_plan: Plan) -> list[Any]:
    """The covered layers whose variables the last tapped step read outside their own call."""
    return [layer for layer, _ in the_plan.layers if layer in the_plan.reads.violations]

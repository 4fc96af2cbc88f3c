"""Per-example clipped sums on JAX without per-example weight gradients for the layers it knows (ghost clipping).

The exact path (``_per_example``) differentiates each example's loss, on a batch of one under
``jax.vmap``, with respect to every trainable variable: B full gradients. Here the same vmapped
backward pass is taken with respect to a zero perturbation ``z`` added to the pre-activation output
of each *covered* layer call (and to the other trainable variables, as before). It returns, per
example i and call c, the layer's input ``a_ic`` (recorded in the forward pass) and its output
gradient ``δ_ic = ∂ℓ_i/∂z_c``. A covered layer's output before its activation is affine in its
trainable variables ``w`` given its input (``pre(a, w)``), so an example's gradient is the
vector-Jacobian product ``g_i = Σ_c (∂pre/∂w)(a_ic)ᵀ δ_ic``, and

* its squared norm comes from ``(a_i, δ_i)``: for a Dense kernel ``||a_i||²·||δ_i||²`` (one row) or
  ``Σ_{t,s} (a_t·a_s)(δ_t·δ_s)`` (rows t of a sequence), for an Embedding
  ``Σ_{t,s} [id_t = id_s] δ_t·δ_s`` (Li et al. 2022, "ghost clipping"; Bu et al. 2023,
  "book-keeping"), otherwise the vector-Jacobian product of one example (this layer's gradient only);
* the clipped sum ``Σ_i f_i g_i`` is one vector-Jacobian product over the batch with cotangents
  ``f_i δ_i`` (no second backward pass through the model; no per-example gradient kept).

Mixing is impossible by construction, as on the exact path: the forward and backward passes run
under ``jax.vmap`` on batches of one, and so do the rules' products (``jax.vmap`` of ``pre`` on one
example's input). An example with factor 0 (non-finite) has its inputs and cotangents replaced by
exact zeros first. Layers covered (exact type, float32, not quantized, no rematerialization; their rules in ``_rules``):
``Dense`` (LoRA included), ``EinsumDense`` (LoRA included), ``Embedding`` (without LoRA),
``Conv1D``/``Conv2D``/``Conv3D`` and ``DepthwiseConv1D``/``DepthwiseConv2D`` (from the unfolded input: ``_conv``),
``LayerNormalization``, ``PReLU``, ``ReversibleEmbedding`` (a subclass whose body defines nothing takes its
base's rule). Every other trainable variable keeps the
exact per-example gradient of ``_per_example`` (one warning names its layers). A covered variable
read anywhere but in its own layer's call (weight tying, a custom layer reading another's kernel, a
compiled loss reading a kernel) would lose that use's gradient: every read in the model's call and the
loss is watched when the step is traced and such a layer is not covered. A layer called inside a JAX
loop or other traced function (an RNN cell's Dense, a Dense in ``keras.ops.fori_loop``/``scan``/
``while_loop``/``cond``, a rematerialized block) runs once per iteration of a body traced once: its
calls cannot be recorded, so it is not covered either (its variables take the exact ``jax.vmap`` path,
named in the warning).
"""

from __future__ import annotations

import contextlib
import logging

import jax
import jax.numpy as jnp
import keras
from jax.extend.core import get_opaque_trace_state

from keras_dpsgd.backends._layer_forms import ReadWatch
from keras_dpsgd.backends.jax._rules import per_example_grads, rule_for, weighted_sums
from keras_dpsgd.dp.refusals import refuse

__all__ = ["Plan", "plan"]

_LOG = logging.getLogger("keras_dpsgd")
_ANNOUNCED: set = set()


# -------------------------------------------------------------------------------------- interception
class _Taps(ReadWatch):
    """The covered calls of one trace: their order and shapes, the inputs recorded, the reads watched
    (``_layer_forms.ReadWatch``, the torch backend's too).

    ``trace`` is JAX's trace state where the model's call (or the loss) started: a covered layer called
    under another one runs inside a loop body or another traced function (``looped``).
    """

    def __init__(self, layers, expected=None, zs=None):
        super().__init__(layers)
        self.layers = list(layers)
        self.expected, self.zs = expected, zs
        self.calls, self.inputs, self.looped = [], [], set()
        self.trace = None

    @contextlib.contextmanager
    def watch(self):
        """Reads of the covered variables outside their layers' calls are recorded while this is open."""
        self.watching, self.trace = True, get_opaque_trace_state()
        try:
            yield
        finally:
            self.watching, self.trace = False, None


def _wrapped_call(layer, rule, taps):
    def call(inputs, *args, **kwargs):
        if not rule.computes(layer, inputs, args, kwargs):  # a call the rule does not compute: not covered
            if taps.zs is not None:
                raise refuse(
                    "per-example-check",
                    f"keras_dpsgd: layer {layer.name!r} was called with other arguments than when the step was "
                    "planned; the per-example gradients cannot be proven exact",
                    RuntimeError,
                )
            taps.violations.add(layer)
            return type(layer).call(layer, inputs, *args, **kwargs)
        if taps.trace is not None and get_opaque_trace_state() != taps.trace:  # inside a loop's body (or remat)
            if taps.zs is not None:
                raise refuse(
                    "per-example-check",
                    f"keras_dpsgd: layer {layer.name!r} was called inside a JAX loop or traced function, unlike "
                    "when the step was planned; the per-example gradients cannot be proven exact",
                    RuntimeError,
                )
            taps.looped.add(layer)
            return rule.post(layer, rule.pre(layer, rule.tap(layer, inputs)))
        taps.inside.append(layer)
        try:
            inputs = rule.tap(layer, inputs)
            pre = rule.pre(layer, inputs)
        finally:
            taps.inside.pop()
        k = len(taps.calls)
        taps.calls.append((layer, tuple(pre.shape)))
        if taps.zs is not None:
            if k >= len(taps.expected) or taps.expected[k] != (layer, tuple(pre.shape)):
                raise refuse(
                    "per-example-check",
                    f"keras_dpsgd: layer {layer.name!r} was called in another order or shape than when the step was "
                    "planned; the per-example gradients cannot be proven exact",
                    RuntimeError,
                )
            pre = pre + taps.zs[k].astype(pre.dtype)
            taps.inputs.append(inputs)
        return rule.post(layer, pre)

    return call


@contextlib.contextmanager
def _intercepting(model, taps: _Taps):
    """Covered layers' calls tap their pre-activations; reads of their variables elsewhere are recorded."""
    model_call = model.call

    def watched_call(*args, **kwargs):
        with taps.watch():
            return model_call(*args, **kwargs)

    patched = []  # (object, its own instance attribute "call" before, if any)
    try:
        for layer in taps.layers:
            patched.append((layer, vars(layer).get("call")))
            object.__setattr__(layer, "call", _wrapped_call(layer, rule_for(layer), taps))
        patched.append((model, vars(model).get("call")))
        object.__setattr__(model, "call", watched_call)
        with taps.reads_seen():
            yield taps
    finally:
        for obj, own in reversed(patched):
            if own is None:
                object.__delattr__(obj, "call")
            else:
                object.__setattr__(obj, "call", own)


# ------------------------------------------------------------------------------------------ the plan
def plan(model, trainable, non_trainable, x, kwargs, y=None, sample_weight=None, loss_at=None) -> Plan | None:
    """The covered layers of `model` for this trace (``None`` when none is), found by tracing one example.

    With `y`, the compiled loss is traced too (its reads of the covered variables watched): `loss_at` is the
    front end's per-example loss, ``loss_at(model, trainable, non_trainable, y, y_pred, sample_weight)``
    (``keras_dpsgd.keras3._jax_loss.per_example_loss_at``).
    """
    candidates = [
        layer for layer in model._flatten_layers(include_self=False, recursive=True) if rule_for(layer) is not None
    ]
    seen, shared = set(), set()
    for layer in candidates:
        for v in layer.variables:
            (shared if id(v) in seen else seen).add(id(v))
    candidates = [layer for layer in candidates if not any(id(v) in shared for v in layer.variables)]
    if not candidates:
        return None
    taps = _Taps(candidates)
    one = keras.tree.map_structure(lambda a: None if a is None else a[:1], (x, y, sample_weight))

    def forward(params, values, xb, yb, wb):
        with _intercepting(model, taps):
            y_pred, new_values = model.stateless_call(params, values, xb, **kwargs)
            if y is not None:
                with taps.watch():
                    loss_at(model, params, new_values, yb, y_pred, wb)

    jax.eval_shape(forward, list(trainable), list(non_trainable), *one)
    called = {id(layer) for layer, _ in taps.calls}
    trainable_ids = {id(v) for v in model.trainable_variables}
    covered = [
        layer
        for layer in candidates
        if id(layer) in called
        and layer not in taps.violations
        and layer not in taps.looped
        and all(id(v) in trainable_ids for v in layer.trainable_variables)
    ]
    looped = sorted(layer.name for layer in taps.looped)
    if not covered:
        _announce_looped(looped)
        return None
    return Plan(model, covered, [(layer, shape) for layer, shape in taps.calls if layer in covered], looped)


def _announce_looped(looped) -> None:
    """Without any covered layer the whole step is the exact path: said once for the layers called in loops."""
    key = ("looped",) + tuple(looped)
    if looped and key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        _LOG.warning(_LOOPED, ", ".join(looped))


_LOOPED = (
    "keras_dpsgd (JAX): layer(s) %s are called inside a JAX loop or traced function (an RNN cell, "
    "keras.ops.scan/fori_loop/while_loop/cond, rematerialization), where their calls cannot be recorded: their "
    "variables take exact per-example gradients under jax.vmap, about B times their gradient's memory"
)


class Plan:
    """The covered layers and calls of one trace: what the vmapped backward pass differentiates, and the rules.

    Used by ``keras3._jax_train_step._per_example`` as its ``tap``: :meth:`params` (what ``jax.grad`` differentiates),
    :meth:`applied` (the model's trainable values and the interception for one example), then
    :meth:`clipped_sum` on the gradients and the recorded inputs (:attr:`captured`).
    """

    def __init__(self, model, covered, expected, looped=()):
        self.model, self.covered, self.expected = model, covered, expected
        covered_ids = {id(v) for layer in covered for v in layer.trainable_variables}
        variables = model.trainable_variables
        self.index = {id(v): j for j, v in enumerate(variables)}
        self.uncovered = [j for j, v in enumerate(variables) if id(v) not in covered_ids]
        self.captured = None
        self._announce([v for j, v in enumerate(variables) if j in set(self.uncovered)], looped)

    def _announce(self, variables, looped) -> None:
        names = tuple(v.path for v in variables)
        if names and names not in _ANNOUNCED:
            _ANNOUNCED.add(names)
            _LOG.warning(
                "keras_dpsgd (JAX): %d trainable variable(s) without a per-example norm rule in this step (rules: "
                "Dense, EinsumDense, Embedding, ReversibleEmbedding, Conv1D/2D/3D, DepthwiseConv1D/2D, "
                "LayerNormalization, PReLU in float32, called in the model's own trace, their variables read only "
                "in their call) take exact per-example gradients under "
                "jax.vmap, about B times their gradient's memory: %s",
                len(names),
                ", ".join(names),
            )
        _announce_looped(looped)

    def params(self, trainable):
        """(the uncovered variables' values, one zero perturbation per covered call): what jax.grad takes."""
        zs = [jnp.zeros(shape, jnp.float32) for _, shape in self.expected]
        return [trainable[j] for j in self.uncovered], zs

    @contextlib.contextmanager
    def applied(self, params, trainable):
        """(the model's trainable values with `params`' uncovered ones, the recorded inputs, the watch of the
        loss's reads: ``_Taps.watch``) for one example."""
        uncovered, zs = params
        full = list(jax.lax.stop_gradient(t) for t in trainable)
        for j, value in zip(self.uncovered, uncovered):
            full[j] = value
        taps = _Taps(self.covered, self.expected, zs)
        with _intercepting(self.model, taps):
            yield full, taps.inputs, taps.watch
        if taps.violations:
            names = sorted(layer.name for layer in taps.violations)
            raise refuse(
                "per-example-check",
                f"keras_dpsgd: the variables of layer(s) {names} were read outside their layer's call",
                RuntimeError,
            )
        if len(taps.calls) != len(self.expected):
            raise refuse(
                "per-example-check",
                "keras_dpsgd: the covered layers were called another number of times than planned",
                RuntimeError,
            )

    def _values(self, trainable, non_trainable):
        values = {id(v): t for v, t in zip(self.model.trainable_variables, trainable)}
        values.update({id(v): t for v, t in zip(self.model.non_trainable_variables, non_trainable)})
        return values

    def _calls(self, grads):
        """{layer: [(inputs [B, 1, ...], output gradient [B, 1, ...]) per call]}."""
        calls = {id(layer): [] for layer in self.covered}
        for (layer, _), a, d in zip(self.expected, self.captured, grads[1]):
            calls[id(layer)].append((a, d))
        return calls

    def clipped_sum(self, grads, trainable, non_trainable, factors_of, groups) -> tuple[list, jax.Array]:
        """(Σ_i f_i g_i per trainable variable, finite rows [B, 1]).

        `factors_of(sq [B, V])` -> (factors [B, V], finite [B, 1]); `groups[v]`: variable v's clip group.
        """
        from keras_dpsgd.backends.jax._per_example import sq_norms, weighted_row_sum

        uncovered_grads = list(grads[0])
        values = self._values(trainable, non_trainable)
        calls = self._calls(grads)
        columns, materialized = [None] * len(trainable), {}
        if uncovered_grads:
            uncovered_sq = sq_norms(uncovered_grads)
            for c, j in enumerate(self.uncovered):
                columns[j] = uncovered_sq[:, c]
        for layer in self.covered:
            rule, train = rule_for(layer), layer.trainable_variables
            closed = rule.sq_norms(layer, calls[id(layer)], train) or {}
            missing = [v for v in train if id(v) not in closed]
            if missing:
                # Norms of the materialized gradients, which the release then sums too (self-consistent).
                direct = per_example_grads(layer, rule, calls[id(layer)], values, missing)
                materialized.update({id(v): g for v, g in zip(missing, direct)})
                closed.update({id(v): column for v, column in zip(missing, sq_norms(direct).T)})
            for v in train:
                columns[self.index[id(v)]] = closed[id(v)].astype(jnp.float32)
        sq = jnp.stack(columns, axis=1)
        factors, finite = factors_of(sq)

        summed = [None] * len(trainable)
        for j, g in zip(self.uncovered, uncovered_grads):
            summed[j] = weighted_row_sum(g, factors[:, j])
        for layer in self.covered:
            rule = rule_for(layer)
            if all(id(v) in materialized for v in layer.trainable_variables):
                continue  # summed below from the materialized gradients
            for v, s in weighted_sums(
                layer, rule, calls[id(layer)], values, factors, finite, self.index, groups
            ).items():
                summed[self.index[v]] = s
        for v, g in materialized.items():
            summed[self.index[v]] = weighted_row_sum(g, factors[:, self.index[v]])
        return summed, finite

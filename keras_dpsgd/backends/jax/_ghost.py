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
exact zeros first. Layers covered (exact type, float32, not quantized, no rematerialization):
``Dense`` (LoRA included), ``EinsumDense`` (LoRA included), ``Embedding`` (without LoRA),
``Conv1D``/``Conv2D``/``Conv3D``, ``LayerNormalization``. Every other trainable variable keeps the
exact per-example gradient of ``_per_example`` (one warning names its layers). A covered variable
read anywhere but in its own layer's call (weight tying, a custom layer reading another's kernel)
would lose that use's gradient: every read is watched when the step is traced and such a layer is
not covered.
"""

from __future__ import annotations

import contextlib
import logging

import jax
import jax.numpy as jnp
import keras
from keras.src.backend.common.stateless_scope import StatelessScope

__all__ = ["Plan", "plan", "RULES"]

_LOG = logging.getLogger("keras_dpsgd")
_ANNOUNCED: set = set()


# --------------------------------------------------------------------------------------------- rules
class _Rule:
    """A layer whose output before its activation, ``pre(layer, inputs)``, is affine in its trainable variables.

    ``pre`` reads the layer's variables from the current ``StatelessScope``; ``post`` is what the layer
    applies after (its activation). ``sq_norms`` may return closed forms per variable (``None``: the
    vector-Jacobian product of each example).
    """

    def pre(self, layer, inputs):
        raise NotImplementedError

    def post(self, layer, outputs):
        return outputs

    def covers(self, layer) -> bool:
        return not getattr(layer, "lora_enabled", False)

    def sq_norms(self, layer, calls, trainable) -> dict | None:
        return None


class _Dense(_Rule):
    def pre(self, layer, inputs):
        x = keras.ops.matmul(inputs, layer.kernel)  # Dense.kernel adds LoRA's product where enabled
        return x if layer.bias is None else keras.ops.add(x, layer.bias)

    def post(self, layer, outputs):
        return outputs if layer.activation is None else layer.activation(outputs)

    def covers(self, layer) -> bool:
        return True

    def sq_norms(self, layer, calls, trainable):
        if layer.lora_enabled:
            return None
        a = jnp.concatenate([x.reshape(x.shape[0], -1, x.shape[-1]) for x, _ in calls], axis=1).astype(jnp.float32)
        d = jnp.concatenate([g.reshape(g.shape[0], -1, g.shape[-1]) for _, g in calls], axis=1).astype(jnp.float32)
        out = {}
        if layer.bias is not None:
            out[id(layer.bias)] = jnp.sum(jnp.square(jnp.sum(d, axis=1)), axis=1)
        rows, d_in, d_out = a.shape[1], a.shape[2], d.shape[2]
        if rows == 1:
            out[id(layer._kernel)] = jnp.sum(jnp.square(a), axis=(1, 2)) * jnp.sum(jnp.square(d), axis=(1, 2))
        elif rows * (d_in + d_out) < d_in * d_out:  # Gram: B·T²(d_in + d_out) < direct: B·T·d_in·d_out
            out[id(layer._kernel)] = jnp.sum(
                jnp.einsum("bti,bsi->bts", a, a) * jnp.einsum("btj,bsj->bts", d, d), (1, 2)
            )
        else:
            out[id(layer._kernel)] = jnp.sum(jnp.square(jnp.einsum("bti,btj->bij", a, d)), axis=(1, 2))
        return {k: v for k, v in out.items() if k in {id(t) for t in trainable}}


class _EinsumDense(_Dense):
    def pre(self, layer, inputs):
        x = keras.ops.einsum(layer.equation, inputs, layer.kernel)
        return x if layer.bias is None else keras.ops.add(x, layer.bias)

    def sq_norms(self, layer, calls, trainable):
        return None


class _Conv(_Rule):
    def pre(self, layer, inputs):
        outputs = layer.convolution_op(inputs, layer.kernel)  # BaseConv.call, before the activation
        if not layer.use_bias:
            return outputs
        if layer.data_format == "channels_last":
            shape = (1,) * (layer.rank + 1) + (layer.filters,)
        else:
            shape = (1, layer.filters) + (1,) * layer.rank
        return keras.ops.add(outputs, keras.ops.reshape(layer.bias, shape))

    def post(self, layer, outputs):
        return outputs if layer.activation is None else layer.activation(outputs)


class _Embedding(_Rule):
    def pre(self, layer, inputs):
        return keras.layers.Embedding.call(layer, inputs)

    def sq_norms(self, layer, calls, trainable):
        ids = jnp.concatenate([x.reshape(x.shape[0], -1) for x, _ in calls], axis=1)
        if ids.shape[1] ** 2 > layer.input_dim:  # the direct form (one [V, d] gradient per example) is cheaper
            return None
        d = jnp.concatenate([g.reshape(g.shape[0], -1, g.shape[-1]) for _, g in calls], axis=1).astype(jnp.float32)
        same = (ids[:, :, None] == ids[:, None, :]).astype(jnp.float32)
        return {id(layer.embeddings): jnp.sum(same * jnp.einsum("btj,bsj->bts", d, d), axis=(1, 2))}


class _LayerNorm(_Rule):
    def pre(self, layer, inputs):
        return keras.layers.LayerNormalization.call(layer, inputs)  # affine in gamma and beta


RULES: dict[type, _Rule] = {
    keras.layers.Dense: _Dense(),
    keras.layers.EinsumDense: _EinsumDense(),
    keras.layers.Conv1D: _Conv(),
    keras.layers.Conv2D: _Conv(),
    keras.layers.Conv3D: _Conv(),
    keras.layers.Embedding: _Embedding(),
    keras.layers.LayerNormalization: _LayerNorm(),
}


def _rule_for(layer) -> _Rule | None:
    rule = RULES.get(type(layer))  # exact type: a subclass may compute something else
    if rule is None or not layer.trainable_variables or not rule.covers(layer):
        return None
    policy = layer.dtype_policy
    if getattr(policy, "quantization_mode", None) is not None or getattr(layer, "_remat_mode", None) is not None:
        return None
    if policy.compute_dtype != "float32" or policy.variable_dtype != "float32":
        return None
    return rule


# -------------------------------------------------------------------------------------- interception
class _Taps:
    """The covered calls of one trace: their order and shapes, the inputs recorded, the reads watched."""

    def __init__(self, layers, expected=None, zs=None):
        self.layers = list(layers)
        self.owner = {id(v): layer for layer in self.layers for v in layer.variables}
        self.expected, self.zs = expected, zs
        self.calls, self.inputs, self.inside, self.violations = [], [], [], set()
        self.watching = False


def _wrapped_call(layer, rule, taps):
    def call(inputs, *args, **kwargs):
        taps.inside.append(layer)
        try:
            pre = rule.pre(layer, inputs)
        finally:
            taps.inside.pop()
        k = len(taps.calls)
        taps.calls.append((layer, tuple(pre.shape)))
        if taps.zs is not None:
            if k >= len(taps.expected) or taps.expected[k] != (layer, tuple(pre.shape)):
                raise RuntimeError(
                    f"keras_dpsgd: layer {layer.name!r} was called in another order or shape than when the step was "
                    "planned; the per-example gradients cannot be proven exact"
                )
            pre = pre + taps.zs[k].astype(pre.dtype)
            taps.inputs.append(inputs)
        return rule.post(layer, pre)

    return call


@contextlib.contextmanager
def _intercepting(model, taps: _Taps):
    """Covered layers' calls tap their pre-activations; reads of their variables elsewhere are recorded."""
    original_read = StatelessScope.get_current_value

    def read(scope, variable):
        owner = taps.owner.get(id(variable))
        if owner is not None and taps.watching and (not taps.inside or taps.inside[-1] is not owner):
            taps.violations.add(owner)
        return original_read(scope, variable)

    model_call = model.call

    def watched_call(*args, **kwargs):
        taps.watching = True
        try:
            return model_call(*args, **kwargs)
        finally:
            taps.watching = False

    patched = []
    try:
        for layer in taps.layers:
            object.__setattr__(layer, "call", _wrapped_call(layer, RULES[type(layer)], taps))
            patched.append(layer)
        object.__setattr__(model, "call", watched_call)
        patched.append(model)
        StatelessScope.get_current_value = read
        yield taps
    finally:
        StatelessScope.get_current_value = original_read
        for layer in patched:
            object.__delattr__(layer, "call")


# ------------------------------------------------------------------------------------------ the plan
def plan(model, trainable, non_trainable, x, kwargs) -> Plan | None:
    """The covered layers of `model` for this trace (``None`` when none is), found by tracing one example."""
    candidates = [
        layer for layer in model._flatten_layers(include_self=False, recursive=True) if _rule_for(layer) is not None
    ]
    seen, shared = set(), set()
    for layer in candidates:
        for v in layer.variables:
            (shared if id(v) in seen else seen).add(id(v))
    candidates = [layer for layer in candidates if not any(id(v) in shared for v in layer.variables)]
    if not candidates:
        return None
    taps = _Taps(candidates)
    x_one = keras.tree.map_structure(lambda a: None if a is None else a[:1], x)

    def forward(params, values, xb):
        with _intercepting(model, taps):
            return model.stateless_call(params, values, xb, **kwargs)[0]

    jax.eval_shape(forward, list(trainable), list(non_trainable), x_one)
    called = {id(layer) for layer, _ in taps.calls}
    trainable_ids = {id(v) for v in model.trainable_variables}
    covered = [
        layer
        for layer in candidates
        if id(layer) in called
        and layer not in taps.violations
        and all(id(v) in trainable_ids for v in layer.trainable_variables)
    ]
    if not covered:
        return None
    return Plan(model, covered, [(layer, shape) for layer, shape in taps.calls if layer in covered])


class Plan:
    """The covered layers and calls of one trace: what the vmapped backward pass differentiates, and the rules.

    Used by ``_train_step._per_example`` as its ``tap``: :meth:`params` (what ``jax.grad`` differentiates),
    :meth:`applied` (the model's trainable values and the interception for one example), then
    :meth:`clipped_sum` on the gradients and the recorded inputs (:attr:`captured`).
    """

    def __init__(self, model, covered, expected):
        self.model, self.covered, self.expected = model, covered, expected
        covered_ids = {id(v) for layer in covered for v in layer.trainable_variables}
        variables = model.trainable_variables
        self.index = {id(v): j for j, v in enumerate(variables)}
        self.uncovered = [j for j, v in enumerate(variables) if id(v) not in covered_ids]
        self.captured = None
        self._announce([v for j, v in enumerate(variables) if j in set(self.uncovered)])

    def _announce(self, variables) -> None:
        names = tuple(v.path for v in variables)
        if names and names not in _ANNOUNCED:
            _ANNOUNCED.add(names)
            _LOG.warning(
                "keras_dpsgd (JAX): %d trainable variable(s) outside the layers with per-example norm rules "
                "(Dense, EinsumDense, Embedding, Conv1D/2D/3D, LayerNormalization in float32) take exact "
                "per-example gradients under jax.vmap, about B times their gradient's memory: %s",
                len(names),
                ", ".join(names),
            )

    def params(self, trainable):
        """(the uncovered variables' values, one zero perturbation per covered call): what jax.grad takes."""
        zs = [jnp.zeros(shape, jnp.float32) for _, shape in self.expected]
        return [trainable[j] for j in self.uncovered], zs

    @contextlib.contextmanager
    def applied(self, params, trainable):
        """(the model's trainable values with `params`' uncovered ones, the recorded inputs) for one example."""
        uncovered, zs = params
        full = list(jax.lax.stop_gradient(t) for t in trainable)
        for j, value in zip(self.uncovered, uncovered):
            full[j] = value
        taps = _Taps(self.covered, self.expected, zs)
        with _intercepting(self.model, taps):
            yield full, taps.inputs
        if taps.violations:
            names = sorted(layer.name for layer in taps.violations)
            raise RuntimeError(f"keras_dpsgd: the variables of layer(s) {names} were read outside their layer's call")
        if len(taps.calls) != len(self.expected):
            raise RuntimeError("keras_dpsgd: the covered layers were called another number of times than planned")

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
        from keras_dpsgd.backends.jax._per_example import sq_norms

        uncovered_grads = list(grads[0])
        values = self._values(trainable, non_trainable)
        calls = self._calls(grads)
        columns = [None] * len(trainable)
        if uncovered_grads:
            uncovered_sq = sq_norms(uncovered_grads)
            for c, j in enumerate(self.uncovered):
                columns[j] = uncovered_sq[:, c]
        for layer in self.covered:
            rule, train = RULES[type(layer)], layer.trainable_variables
            closed = rule.sq_norms(layer, calls[id(layer)], train) or {}
            missing = [v for v in train if id(v) not in closed]
            if missing:
                direct = _per_example_grads(layer, rule, calls[id(layer)], values, missing)
                closed.update(
                    {id(v): jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), 1) for v, g in zip(missing, direct)}
                )
            for v in train:
                columns[self.index[id(v)]] = closed[id(v)].astype(jnp.float32)
        sq = jnp.stack(columns, axis=1)
        factors, finite = factors_of(sq)

        summed = [None] * len(trainable)
        for c, (j, g) in enumerate(zip(self.uncovered, uncovered_grads)):
            f = factors[:, j].reshape((-1,) + (1,) * (g.ndim - 1))
            summed[j] = jnp.sum(jnp.where(f > 0, g.astype(jnp.float32), 0.0) * f, axis=0)
        for layer in self.covered:
            rule = RULES[type(layer)]
            for v, s in _weighted_sums(
                layer, rule, calls[id(layer)], values, factors, finite, self.index, groups
            ).items():
                summed[self.index[v]] = s
        return summed, finite


# ------------------------------------------------------------------------------- vector-Jacobian products
def _pre_at(layer, rule, inputs, values):
    """The layer's pre-activation output on `inputs` with its variables at `values` (id -> value)."""
    with StatelessScope(state_mapping=[(v, values[id(v)]) for v in layer.variables]):
        return rule.pre(layer, inputs)


def _with(values, variables, new):
    out = dict(values)
    out.update({id(v): n for v, n in zip(variables, new)})
    return out


def _per_example_grads(layer, rule, calls, values, variables) -> list:
    """Each example's gradient of `variables` (this layer's only): [B, *shape] each, Σ over the calls."""
    current = [values[id(v)] for v in variables]

    def one(a, d):
        _, vjp = jax.vjp(lambda w: _pre_at(layer, rule, a, _with(values, variables, w)), current)
        return vjp(d.astype(jnp.float32))[0]

    total = None
    for a, d in calls:
        g = jax.vmap(one)(a, d)
        total = g if total is None else [t + x for t, x in zip(total, g)]
    return total


def _weighted_sums(layer, rule, calls, values, factors, finite, index, groups) -> dict:
    """{id(v): Σ_i f_iv g_iv} for the layer's trainable variables: one vjp over the batch per clip group.

    The pre-activation is recomputed under ``jax.vmap`` on each example's input (batches of one) and
    transposed at cotangents ``f_i δ_i``; rows with factor 0 (or non-finite) are exact zeros first.
    """
    variables = layer.trainable_variables
    current = [values[id(v)] for v in variables]
    masked = []
    for a, _ in calls:
        keep = finite.reshape((-1,) + (1,) * (a.ndim - 1))
        masked.append(jnp.where(keep, a, jnp.zeros((), a.dtype)))

    def batched(w):
        at = _with(values, variables, w)
        return [jax.vmap(lambda a: _pre_at(layer, rule, a, at))(a) for a in masked]

    _, vjp = jax.vjp(batched, current)
    out = {}
    for group in sorted({groups[index[id(v)]] for v in variables}):
        members = [v for v in variables if groups[index[id(v)]] == group]
        f = factors[:, index[id(members[0])]]  # one column per clip group: its members' factors are equal
        cotangents = []
        for _, d in calls:
            fb = f.reshape((-1,) + (1,) * (d.ndim - 1))
            cotangents.append(jnp.where(fb > 0, d.astype(jnp.float32) * fb, 0.0))
        sums = vjp(cotangents)[0]
        out.update({id(u): s for u, s in zip(variables, sums) if groups[index[id(u)]] == group})
    return out

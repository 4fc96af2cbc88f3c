"""The layers with per-example norm rules on JAX, and the vector-Jacobian products the rules share (``_ghost``).

The rule interface, the layers' pre-activations and the closed forms of the norms are every backend's
(``keras_dpsgd.backends._layer_forms``, over this backend's :data:`ARRAYS`): a rule (:class:`Rule`) serves a layer
whose output before its activation, ``pre(layer, inputs)``, is affine in its trainable variables given its input.
From each example's inputs ``a_i`` and output gradients ``δ_i`` (one pair per call, [B, 1, ...]: each example a
batch of one), :func:`per_example_grads` gives this layer's gradient of one example (``jax.vmap`` of a
vector-Jacobian product) and :func:`weighted_sums` the clipped sum ``Σ_i f_i g_i`` (one vector-Jacobian product over
the batch, cotangents ``f_i δ_i``). ``Rule.sq_norms`` may replace the former by closed forms (Dense and Embedding:
the shared ones; Conv: Dense's forms on the input's patches, here). ``RULES`` maps an exact layer type to its rule.

A closed form is a certified upper bound of the squared norm, not its float32 value: the clipped sum is computed
apart (one product over all rows), so rows that cancel must not round the norm to 0 (``keras_dpsgd.dp.rounding``,
shared with the TensorFlow backend). The norms' products run at full float32 precision (``Precision.HIGHEST``: on
GPUs and TPUs JAX's default is a reduced one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import keras

from keras_dpsgd.backends import _layer_forms as _forms
from keras_dpsgd.backends._layer_forms import Rule, pre_at, with_values
from keras_dpsgd.backends.jax._per_example import staged_sq_norms

__all__ = ["RULES", "Rule", "rule_for", "per_example_grads", "weighted_sums"]


_HIGHEST = jax.lax.Precision.HIGHEST


ARRAYS = _forms.Arrays(
    einsum=functools.partial(jnp.einsum, precision=_HIGHEST),
    sum=jnp.sum,
    sqrt=jnp.sqrt,
    concat=jnp.concatenate,
    float32=lambda x: x.astype(jnp.float32),
    staged_sq_norms=staged_sq_norms,
)


class _Conv(_forms.ConvForm):
    def sq_norms(self, layer, calls, trainable):
        """The kernel's norm from the input's patches (one row per output position): Dense's forms on them."""
        if layer.lora_enabled or layer.groups != 1 or layer.data_format != "channels_last":
            return None
        if layer.padding not in ("valid", "same"):  # Conv1D's "causal": the vector-Jacobian product
            return None
        spec = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"), 3: ("NDHWC", "DHWIO", "NDHWC")}[layer.rank]
        rows, grads = [], []
        for a, d in calls:
            batch = a.shape[0]
            patches = jax.lax.conv_general_dilated_patches(
                a.reshape((-1,) + a.shape[2:]).astype(jnp.float32),
                filter_shape=tuple(layer.kernel_size),
                window_strides=tuple(layer.strides),
                padding=layer.padding.upper(),
                rhs_dilation=tuple(layer.dilation_rate),
                dimension_numbers=spec,
                precision=_HIGHEST,  # exact copies of the input (a reduced precision would round them)
            )  # [B, *positions, C·prod(kernel_size)] in some order of the patch's entries: norms do not care
            rows.append(patches.reshape(batch, -1, patches.shape[-1]))
            grads.append(d.reshape(batch, -1, d.shape[-1]))
        out = _forms.outer_sq_norms(ARRAYS, jnp.concatenate(rows, 1), jnp.concatenate(grads, 1).astype(jnp.float32))
        keep = {id(t) for t in trainable}
        found = {id(layer._kernel): out[0]}
        if layer.use_bias:
            found[id(layer.bias)] = out[1]
        return {k: v for k, v in found.items() if k in keep}


class _PReLU(Rule):
    def pre(self, layer, inputs):
        return keras.layers.PReLU.call(layer, inputs)  # relu(x) - alpha·relu(-x): linear in alpha


RULES: dict[type, Rule] = {
    **_forms.registry(
        _forms.DenseForm(ARRAYS),
        _forms.EinsumDenseForm(),
        _Conv(),
        _forms.EmbeddingForm(ARRAYS),
        _forms.LayerNormForm(),
    ),
    keras.layers.PReLU: _PReLU(),
}


def rule_for(layer) -> Rule | None:
    """The rule of `layer` in ``RULES`` (``_layer_forms.rule_for``), or None."""
    return _forms.rule_for(layer, RULES)


def per_example_grads(layer, rule, calls, values, variables) -> list:
    """Each example's gradient of `variables` (this layer's only): [B, *shape] each, Σ over the calls."""
    current = [values[id(v)] for v in variables]

    def one(a, d):
        _, vjp = jax.vjp(lambda w: pre_at(layer, rule, a, with_values(values, variables, w)), current)
        return vjp(d.astype(jnp.float32))[0]

    total = None
    for a, d in calls:
        g = jax.vmap(one)(a, d)
        total = g if total is None else [t + x for t, x in zip(total, g)]
    return total


def weighted_sums(layer, rule, calls, values, factors, finite, index, groups) -> dict:
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
        at = with_values(values, variables, w)
        return [jax.vmap(lambda a: pre_at(layer, rule, a, at))(a) for a in masked]

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

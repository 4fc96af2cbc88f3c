"""The layers with per-example norm rules on JAX, and the vector-Jacobian products the rules share (``_ghost``).

The rule interface, the layers' pre-activations and the closed forms of the norms are every backend's
(``keras_dpsgd.backends._layer_forms``, over this backend's :data:`ARRAYS`): a rule (:class:`Rule`) serves a layer
whose output before its activation, ``pre(layer, inputs)``, is affine in its trainable variables given its input.
From each example's inputs ``a_i`` and output gradients ``δ_i`` (one pair per call, [B, 1, ...]: each example a
batch of one), :func:`per_example_grads` gives this layer's gradient of one example (``jax.vmap`` of a
vector-Jacobian product) and :func:`weighted_sums` the clipped sum ``Σ_i f_i g_i`` (one vector-Jacobian product over
the batch, cotangents ``f_i δ_i``). ``Rule.sq_norms`` may replace the former by closed forms (Dense, EinsumDense and
Embedding: the shared ones; convolutions: Dense's forms on the input's patches, here), and ``Rule.grads`` by each
example's gradient materialized in closed form (convolutions from the input's windows, ``_conv``: then the norm and
the clipped sum read those values). ``RULES`` maps an exact layer type to its rule.

A closed form is a certified upper bound of the squared norm, not its float32 value: the clipped sum is computed
apart (one product over all rows), so rows that cancel must not round the norm to 0 (``keras_dpsgd.dp.rounding``,
shared with the TensorFlow backend). The norms' products run at full float32 precision (``Precision.HIGHEST``: on
GPUs and TPUs JAX's default is a reduced one).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import keras

from keras_dpsgd.backends import _layer_forms as _forms
from keras_dpsgd.backends._layer_forms import Rule, pre_at, with_values
from keras_dpsgd.backends.jax import _conv
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
    """Conv1D/2D/3D from the input's windows (``_conv``): the Gram norm over the patches where it is cheaper, else
    each example's gradient materialized (:meth:`grads`), its norm and the clipped sum read from it."""

    def sq_norms(self, layer, calls, trainable):
        rows = sum(math.prod(d.shape[2:-1]) for _, d in calls)
        inputs = math.prod(layer.kernel_size) * calls[0][0].shape[-1]
        if not _conv.served(layer) or not _conv.gram_cheaper(rows, inputs, layer.filters):
            return None  # materialized: grads()
        kernel, bias = _forms.outer_sq_norms(ARRAYS, *_conv.patch_rows(layer, calls))
        found = {id(layer._kernel): kernel}
        if layer.use_bias:
            found[id(layer.bias)] = bias
        keep = {id(t) for t in trainable}
        return {k: v for k, v in found.items() if k in keep}

    def grads(self, layer, calls, variables):
        if not _conv.served(layer):
            return None
        found = {id(layer._kernel): lambda: _conv.kernel_grads(layer, calls, layer._kernel.shape)}
        if layer.use_bias:
            found[id(layer.bias)] = lambda: _conv.bias_grads(calls)
        return [found[id(v)]() for v in variables] if all(id(v) in found for v in variables) else None


class _DepthwiseConv(_forms.DepthwiseConvForm):
    """DepthwiseConv1D/2D: each example's gradient materialized from the input's windows (``_conv``)."""

    def grads(self, layer, calls, variables):
        if not _conv.served(layer):
            return None
        found = {id(layer.kernel): lambda: _conv.depthwise_grads(layer, calls, layer.kernel.shape)}
        if layer.use_bias:
            found[id(layer.bias)] = lambda: _conv.bias_grads(calls)
        return [found[id(v)]() for v in variables] if all(id(v) in found for v in variables) else None


class _LayerNorm(_forms.LayerNormForm):
    """Over the last axis, each example's gamma and beta gradients from the tapped rows (``LayerNormForm.tap``):
    ``Σ_t δ_t ⊙ x̂_t`` and ``Σ_t δ_t`` over the rows [B, T, D]. (Each example's vector-Jacobian product leaves the
    same sums as a reduction over the middle axis of [B, 1, T, D], which XLA on CPU runs about 20x slower: B = 64,
    T = 32, D = 64, 0.77 ms against 0.03.)"""

    def grads(self, layer, calls, variables):
        if list(layer.axis) != [-1] or not all(self._normalized_first(layer, a) for a, _ in calls):
            return None
        rows = [a.reshape(a.shape[0], -1, a.shape[-1]) for a, _ in calls]
        deltas = [d.astype(jnp.float32).reshape(r.shape) for r, (_, d) in zip(rows, calls)]
        found = {}
        if layer.gamma is not None:
            found[id(layer.gamma)] = sum(jnp.sum(d * r, 1) for r, d in zip(rows, deltas))
        if layer.beta is not None:
            found[id(layer.beta)] = sum(jnp.sum(d, 1) for d in deltas)
        if not all(id(v) in found for v in variables):
            return None
        return [found[id(v)] for v in variables]


class _ReversibleEmbedding(_forms.ReversibleEmbeddingForm):
    def sq_norms(self, layer, calls, trainable):
        """Lookups only (a backbone without its tied output projection): the Embedding's Gram form, and an unused
        reverse table's gradient is exactly 0; with a reverse call, the vector-Jacobian product of each example."""
        if any("int" not in str(a.dtype) for a, _ in calls):
            return None
        out = super().sq_norms(layer, calls, trainable)
        if out is None:
            return None
        if not layer.tie_weights:
            out[id(layer.reverse_embeddings)] = jnp.zeros((calls[0][0].shape[0],), jnp.float32)
        return {k: v for k, v in out.items() if k in {id(t) for t in trainable}}


class _PReLU(Rule):
    def pre(self, layer, inputs):
        return keras.layers.PReLU.call(layer, inputs)  # relu(x) - alpha·relu(-x): linear in alpha


RULES: dict[type, Rule] = {
    **_forms.registry(
        _forms.DenseForm(ARRAYS),
        _forms.EinsumDenseForm(ARRAYS),
        _Conv(),
        _forms.EmbeddingForm(ARRAYS),
        _LayerNorm(),
    ),
    keras.layers.PReLU: _PReLU(),
    keras.layers.DepthwiseConv1D: _DepthwiseConv(),
    keras.layers.DepthwiseConv2D: _DepthwiseConv(),
    keras.layers.ReversibleEmbedding: _ReversibleEmbedding(ARRAYS),
}


def rule_for(layer) -> Rule | None:
    """The rule of `layer` in ``RULES`` (``_layer_forms.rule_for``), or None."""
    return _forms.rule_for(layer, RULES)


def per_example_grads(layer, rule, calls, values, variables) -> list:
    """Each example's gradient of `variables` (this layer's only): [B, *shape] each, Σ over the calls: the rule's
    closed form (``Rule.grads``) where it has one, else the vector-Jacobian product of each example."""
    closed = rule.grads(layer, calls, variables)
    if closed is not None:
        return closed
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

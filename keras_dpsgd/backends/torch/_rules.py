"""The layers with per-example norm rules on torch, and the vector-Jacobian products the rules share (``ghost``).

The rule interface, the layers' pre-activations and the closed forms of the norms are every backend's
(``keras_dpsgd.backends._layer_forms``, over this backend's :data:`ARRAYS`): a :class:`Rule` serves a layer whose
output before its activation, ``pre(layer, inputs)``, is computed from its own variables and its input. From each
example's inputs ``a_i`` and output gradients ``δ_i`` (one pair per call, [B, 1, ...]: each example a batch of one),
:func:`per_example_grads` gives this layer's gradient of one example (``torch.func.vmap`` of a vector-Jacobian
product of ``pre`` alone, not of the model) and :func:`weighted_sums` the clipped sum ``Σ_i f_i g_i`` (one
vector-Jacobian product over the batch, cotangents ``f_i δ_i``; Dense: one product of the captured tensors,
book-keeping). ``Rule.sq_norms`` may replace the former by closed forms (Dense: ``||a||²·||δ||²`` on one row, the
Gram form or the direct product on sequences, Li et al. 2022's ghost norm; Embedding: the Gram form with id
equality), certified upper bounds of the squared norms (``keras_dpsgd.dp.rounding``, shared by every backend).
"""

from __future__ import annotations

import keras
import torch

from keras_dpsgd.backends import _layer_forms as _forms
from keras_dpsgd.backends._layer_forms import Rule, pre_at, with_values
from keras_dpsgd.backends.torch._per_example import staged_sq_norms

__all__ = ["RULES", "Rule", "rule_for", "per_example_grads", "weighted_sums"]


ARRAYS = _forms.Arrays(
    einsum=torch.einsum,
    sum=torch.sum,
    sqrt=torch.sqrt,
    concat=torch.cat,
    float32=lambda x: x.to(torch.float32),
    staged_sq_norms=staged_sq_norms,
)


class _Dense(_forms.DenseForm):
    def sums(self, layer, inputs, weighted):
        """Kernel ``Σ_i Σ_t a_itᵀ (f_i δ_it)`` (one product, no recomputed forward pass), bias ``Σ_i Σ_t f_i δ_it``."""
        if layer.lora_enabled or type(layer) is not keras.layers.Dense:
            return None
        a = _cat_rows(inputs).to(torch.float32)
        out = {}
        for v in layer.trainable_variables:
            d = weighted(v)
            if v is layer._kernel:
                rows = a.shape[0] * a.shape[1]
                kernel = torch.mm(a.reshape(rows, a.shape[-1]).t(), d.reshape(rows, d.shape[-1]))
                out[id(v)] = kernel  # Σ_(i,t) a_itᵀ (f_i δ_it)
            else:
                out[id(v)] = torch.sum(d, dim=(0, 1))
        return out


class _EinsumDense(_forms.EinsumDenseForm):
    def covers(self, layer) -> bool:
        """The equation keeps the input's first axis (the batch) as the output's first: rows stay apart."""
        inputs, output = layer.equation.split("->")
        first = inputs.split(",")[0].strip()[:1]
        return first.isalpha() and output.strip()[:1] == first and first not in inputs.split(",")[1]


class _Conv(_forms.ConvForm):
    def covers(self, layer) -> bool:
        return not layer.lora_enabled and layer.groups == 1


class _LayerNorm(_forms.LayerNormForm):
    def covers(self, layer) -> bool:
        """Normalized over axes other than the batch's (positive axes, or the last)."""
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        return all(a > 0 or a == -1 for a in axes)


RULES: dict[type, Rule] = _forms.registry(
    _Dense(ARRAYS), _EinsumDense(), _Conv(), _forms.EmbeddingForm(ARRAYS), _LayerNorm()
)


def rule_for(layer) -> Rule | None:
    """The rule of `layer` in ``RULES`` (``_layer_forms.rule_for``), or None."""
    return _forms.rule_for(layer, RULES)


def per_example_grads(layer, rule, calls, values, variables) -> list:
    """Each example's gradient of `variables` (this layer's only): [B, *shape] each, Σ over the calls."""
    current = [values[id(v)] for v in variables]

    def one(a, d):
        _, vjp = torch.func.vjp(lambda w: pre_at(layer, rule, a, with_values(values, variables, w)), current)
        return vjp(d.to(torch.float32))[0]

    total = None
    for a, d in calls:
        g = torch.func.vmap(one)(a, d)
        total = list(g) if total is None else [t + x for t, x in zip(total, g)]
    return total


def _merged(x):
    """[B, 1, *rest] -> [B, *rest]: the examples' batches of one as one batch."""
    return x.reshape((x.shape[0],) + tuple(x.shape[2:]))


def _cat_rows(tensors):
    """[B, ..., k] tensors as rows [B, T, k], concatenated over the calls (one call: a view, no copy)."""
    rows = [x.reshape(x.shape[0], -1, x.shape[-1]) for x in tensors]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)


def weighted_sums(layer, rule, calls, values, factors, finite, index, groups) -> dict:
    """{id(v): Σ_i f_iv g_iv} for the layer's trainable variables: one vjp over the batch per clip group.

    The pre-activation is recomputed on the examples' inputs as one batch (a covered layer's ``pre`` keeps the
    rows apart: ``Rule.covers`` declines an EinsumDense or LayerNormalization over the batch axis) and transposed
    at cotangents ``f_i δ_i``, so no example's gradient is materialized; rows with factor 0 (or non-finite) are
    exact zeros first (where every row is finite with a positive factor there is nothing to zero: no copy).
    """
    variables = layer.trainable_variables
    current = [values[id(v)] for v in variables]
    plain = bool(torch.all(finite)) and bool(torch.all(factors > 0))
    masked = []
    for a, _ in calls:
        keep = finite.reshape((-1,) + (1,) * (a.dim() - 1))
        masked.append(a if plain else torch.where(keep, a, torch.zeros((), dtype=a.dtype)))

    def times(f, d):
        """f_i δ_i, exact zeros where f_i = 0 (δ_i may hold NaN or Inf there)."""
        fb = f.reshape((-1,) + (1,) * (d.dim() - 1))
        fd = d.to(torch.float32) * fb
        return fd if plain else torch.where(fb > 0, fd, 0.0)

    cache: dict = {}

    def weighted(v):
        group = groups[index[id(v)]]
        if group not in cache:
            cache[group] = times(factors[:, index[id(v)]], _cat_rows([d for _, d in calls]))
        return cache[group]

    closed = rule.sums(layer, masked, weighted)
    if closed is not None:
        return closed
    masked = [_merged(a) for a in masked]

    def batched(w):
        at = with_values(values, variables, w)
        return [pre_at(layer, rule, a, at) for a in masked]

    _, vjp = torch.func.vjp(batched, current)
    out = {}
    for group in sorted({groups[index[id(v)]] for v in variables}):
        f = factors[:, index[id(next(v for v in variables if groups[index[id(v)]] == group))]]
        sums = vjp([_merged(times(f, d)) for _, d in calls])[0]
        out.update({id(u): s for u, s in zip(variables, sums) if groups[index[id(u)]] == group})
    return out

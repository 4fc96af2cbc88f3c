"""The layers with per-example norm rules on torch, and the vector-Jacobian products the rules share (``ghost``).

The rule interface and the layers' pre-activations are every backend's (``keras_dpsgd.backends._layer_forms``; here
the torch array math): a :class:`Rule` serves a layer whose output before its activation, ``pre(layer, inputs)``, is
computed from its own variables and its input. From each example's inputs ``a_i`` and output gradients ``δ_i`` (one
pair per call, [B, 1, ...]: each example a batch of one), :func:`per_example_grads` gives this layer's gradient of
one example (``torch.func.vmap`` of a vector-Jacobian product of ``pre`` alone, not of the model) and
:func:`weighted_sums` the clipped sum ``Σ_i f_i g_i`` (one vector-Jacobian product over the batch, cotangents ``f_i
δ_i``). ``Rule.sq_norms`` may replace the former by closed forms (Dense: ``||a||²·||δ||²`` on one row, the Gram form
or the direct product on sequences, Li et al. 2022's ghost norm; Embedding: the Gram form with id equality). A
closed form is a certified upper bound of the squared norm (``keras_dpsgd.dp.rounding``, shared by every backend).
"""

from __future__ import annotations

import keras
import torch

from keras_dpsgd.backends import _layer_forms as _forms
from keras_dpsgd.backends._layer_forms import Rule, pre_at, with_values
from keras_dpsgd.backends.torch._per_example import staged_sq_norms
from keras_dpsgd.dp import rounding as _rounding

__all__ = ["RULES", "Rule", "rule_for", "per_example_grads", "weighted_sums"]


def _gram(x):
    """[B, T, T]: the rows' dot products ``x_t·x_s`` of x [B, T, k]."""
    return torch.einsum("bti,bsi->bts", x, x)


def _row_norms(x):
    return torch.sqrt(torch.sum(torch.square(x), dim=2))


def _weighted(norms, gram):
    """``Σ_{t,s} n_t n_s |gram_ts|`` per example (norms [B, T], gram [B, T, T]): ``_rounding.gram_upper``'s."""
    return torch.sum(norms * torch.einsum("bts,bs->bt", torch.abs(gram), norms), dim=1)


def _outer_sq_norms(a, d):
    """Upper bounds of (||Σ_t a_tᵀ δ_t||², ||Σ_t δ_t||²) per example from rows a [B, T, i] and δ [B, T, j]."""
    rows, d_in, d_out = a.shape[1], a.shape[2], d.shape[2]
    d_norms = _row_norms(d)
    bias_sq = torch.sum(torch.square(torch.sum(d, dim=1)), dim=1)
    bias = _rounding.linear_upper(bias_sq, d_out, torch.sum(d_norms, 1), rows)
    if rows == 1:
        sq = torch.sum(torch.square(a), dim=(1, 2)) * torch.sum(torch.square(d), dim=(1, 2))
        return _rounding.positive_upper(sq, d_in + d_out + 1), bias
    a_norms = _row_norms(a)
    lengths = torch.sum(a_norms * d_norms, dim=1)  # S = Σ_t ‖a_t‖ ‖δ_t‖
    if rows * (d_in + d_out) < d_in * d_out:
        aa, dd = _gram(a), _gram(d)
        terms = aa * dd
        gram, absolute = torch.sum(terms, (1, 2)), torch.sum(torch.abs(terms), (1, 2))
        weighted = _weighted(a_norms, dd), _weighted(d_norms, aa)
        return _rounding.gram_upper(gram, absolute, lengths, *weighted, widths=(d_in, d_out), rows=rows), bias
    sq, count = staged_sq_norms(torch.einsum("bti,btj->bij", a, d))
    return _rounding.linear_upper(sq, count, lengths, rows), bias


def _rows(calls, which):
    """The calls' inputs (0) or output gradients (1) as rows [B, T, k], concatenated over the calls."""
    return torch.cat([c[which].reshape(c[which].shape[0], -1, c[which].shape[-1]) for c in calls], dim=1)


class _Dense(_forms.DenseForm):
    def sq_norms(self, layer, calls, trainable):
        if layer.lora_enabled:
            return None
        kernel, bias = _outer_sq_norms(_rows(calls, 0).to(torch.float32), _rows(calls, 1).to(torch.float32))
        out = {id(layer._kernel): kernel}
        if layer.bias is not None:
            out[id(layer.bias)] = bias
        return {k: v for k, v in out.items() if k in {id(t) for t in trainable}}

    def sums(self, layer, inputs, weighted):
        """Kernel ``Σ_i Σ_t a_itᵀ (f_i δ_it)`` (one product, no recomputed forward pass), bias ``Σ_i Σ_t f_i δ_it``."""
        if layer.lora_enabled or type(layer) is not keras.layers.Dense:
            return None
        a = torch.cat([x.reshape(x.shape[0], -1, x.shape[-1]) for x in inputs], dim=1)
        out = {}
        for v in layer.trainable_variables:
            d = weighted(v)
            if v is layer._kernel:
                out[id(v)] = torch.einsum("bti,btj->ij", a.to(torch.float32), d)
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


class _Embedding(_forms.EmbeddingForm):
    def sq_norms(self, layer, calls, trainable):
        ids = torch.cat([x.reshape(x.shape[0], -1) for x, _ in calls], dim=1)
        if ids.shape[1] ** 2 > layer.input_dim:  # the direct form (one [V, d] gradient per example) is cheaper
            return None
        d = _rows(calls, 1).to(torch.float32)
        same = (ids[:, :, None] == ids[:, None, :]).to(torch.float32)  # the one-hot rows' Gram: exact
        terms = same * _gram(d)
        gram, absolute = torch.sum(terms, dim=(1, 2)), torch.sum(torch.abs(terms), dim=(1, 2))
        norms = _row_norms(d)
        lengths = torch.sum(norms, dim=1)  # S = Σ_t ‖δ_t‖ (a one-hot row has norm 1)
        weighted = _weighted(norms, same)
        widths, rows = (0, d.shape[2]), ids.shape[1]
        return {
            id(layer.embeddings): _rounding.gram_upper(gram, absolute, lengths, 0.0, weighted, widths=widths, rows=rows)
        }


class _LayerNorm(_forms.LayerNormForm):
    def covers(self, layer) -> bool:
        """Normalized over axes other than the batch's (positive axes, or the last)."""
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        return all(a > 0 or a == -1 for a in axes)


RULES: dict[type, Rule] = _forms.registry(_Dense(), _EinsumDense(), _Conv(), _Embedding(), _LayerNorm())


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


def weighted_sums(layer, rule, calls, values, factors, finite, index, groups) -> dict:
    """{id(v): Σ_i f_iv g_iv} for the layer's trainable variables: one vjp over the batch per clip group.

    The pre-activation is recomputed on the examples' inputs as one batch (a covered layer's ``pre`` keeps the
    rows apart: ``Rule.covers`` declines an EinsumDense or LayerNormalization over the batch axis) and transposed at cotangents ``f_i δ_i``, so no example's gradient is
    materialized; rows with factor 0 (or non-finite) are exact zeros first.
    """
    variables = layer.trainable_variables
    current = [values[id(v)] for v in variables]
    masked = []
    for a, _ in calls:
        keep = finite.reshape((-1,) + (1,) * (a.dim() - 1))
        masked.append(torch.where(keep, a, torch.zeros((), dtype=a.dtype)))

    def weighted(v):
        f = factors[:, index[id(v)]]
        rows = [d.reshape(d.shape[0], -1, d.shape[-1]).to(torch.float32) for _, d in calls]
        return torch.where(f[:, None, None] > 0, torch.cat(rows, dim=1) * f[:, None, None], 0.0)

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
        cotangents = []
        for _, d in calls:
            fb = f.reshape((-1,) + (1,) * (d.dim() - 1))
            cotangents.append(_merged(torch.where(fb > 0, d.to(torch.float32) * fb, 0.0)))
        sums = vjp(cotangents)[0]
        out.update({id(u): s for u, s in zip(variables, sums) if groups[index[id(u)]] == group})
    return out

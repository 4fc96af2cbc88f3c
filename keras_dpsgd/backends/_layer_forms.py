"""The per-layer rules' backend-neutral part: each layer's pre-activation in ``keras.ops``, and the registry's test.

A rule (:class:`Rule`) serves a layer whose output before its activation, ``pre(layer, inputs)``, is computed
from its own variables (read from the current ``StatelessScope``: :func:`pre_at`) and its input; ``post`` is what
the layer applies after (its activation). Each backend's ``_rules`` adds the array math that differs: the closed
forms of the per-example squared norms (``Rule.sq_norms``, Li et al. 2022's ghost norm; ``None``: the
vector-Jacobian product of each example) and the vector-Jacobian products of ``pre`` alone, not of the model.
:func:`rule_for` gives a layer's rule from a backend's registry (:func:`registry`: exact layer type -> rule).
"""

from __future__ import annotations

import keras
from keras.src.backend.common.stateless_scope import StatelessScope

__all__ = [
    "Rule",
    "DenseForm",
    "EinsumDenseForm",
    "ConvForm",
    "EmbeddingForm",
    "LayerNormForm",
    "registry",
    "rule_for",
    "pre_at",
    "with_values",
]


class Rule:
    """A layer whose output before its activation, ``pre(layer, inputs)``, reads its own variables only.

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

    def sums(self, layer, inputs, weighted) -> dict | None:
        """{id(v): Σ_i f_iv g_iv} in closed form from the calls' `inputs` ([B, 1, ...] each, zero where the factor
        is) and ``weighted(v)`` = f_iv δ_i as rows [B, T, j], or None (the vector-Jacobian product over the batch)."""
        return None


class DenseForm(Rule):
    def pre(self, layer, inputs):
        x = keras.ops.matmul(inputs, layer.kernel)  # Dense.kernel adds LoRA's product where enabled
        return x if layer.bias is None else keras.ops.add(x, layer.bias)

    def post(self, layer, outputs):
        return outputs if layer.activation is None else layer.activation(outputs)

    def covers(self, layer) -> bool:
        return True


class EinsumDenseForm(DenseForm):
    def pre(self, layer, inputs):
        x = keras.ops.einsum(layer.equation, inputs, layer.kernel)
        return x if layer.bias is None else keras.ops.add(x, layer.bias)

    def sq_norms(self, layer, calls, trainable):
        return None


class ConvForm(Rule):
    def pre(self, layer, inputs):
        padding = layer.padding  # BaseConv.call (Conv1D.call with "causal"), before the activation
        if padding == "causal":
            inputs, padding = keras.ops.pad(inputs, layer._compute_causal_padding()), "valid"
        outputs = keras.ops.conv(
            inputs,
            layer.kernel,
            strides=list(layer.strides),
            padding=padding,
            dilation_rate=layer.dilation_rate,
            data_format=layer.data_format,
        )
        if not layer.use_bias:
            return outputs
        if layer.data_format == "channels_last":
            shape = (1,) * (layer.rank + 1) + (layer.filters,)
        else:
            shape = (1, layer.filters) + (1,) * layer.rank
        return keras.ops.add(outputs, keras.ops.reshape(layer.bias, shape))

    def post(self, layer, outputs):
        return outputs if layer.activation is None else layer.activation(outputs)


class EmbeddingForm(Rule):
    def pre(self, layer, inputs):
        return keras.layers.Embedding.call(layer, inputs)


class LayerNormForm(Rule):
    def pre(self, layer, inputs):
        return keras.layers.LayerNormalization.call(layer, inputs)  # affine in gamma and beta


def registry(dense: Rule, einsum_dense: Rule, conv: Rule, embedding: Rule, layer_norm: Rule) -> dict[type, Rule]:
    """The exact layer types every backend serves, each to its rule (the Conv rule serves Conv1D, 2D and 3D)."""
    return {
        keras.layers.Dense: dense,
        keras.layers.EinsumDense: einsum_dense,
        keras.layers.Conv1D: conv,
        keras.layers.Conv2D: conv,
        keras.layers.Conv3D: conv,
        keras.layers.Embedding: embedding,
        keras.layers.LayerNormalization: layer_norm,
    }


def rule_for(layer, rules: dict[type, Rule]) -> Rule | None:
    """The rule of `layer` in `rules` (its exact type: a subclass may compute something else), or None."""
    rule = rules.get(type(layer))
    if rule is None or not layer.trainable_variables or not rule.covers(layer):
        return None
    if "call" in vars(layer):  # a call of its own on the instance (patched by someone): not the class's
        return None
    policy = layer.dtype_policy
    if getattr(policy, "quantization_mode", None) is not None or getattr(layer, "_remat_mode", None) is not None:
        return None
    if policy.compute_dtype != "float32" or policy.variable_dtype != "float32":
        return None
    return rule


def pre_at(layer, rule, inputs, values):
    """The layer's pre-activation output on `inputs` with its variables at `values` (id -> value)."""
    with StatelessScope(state_mapping=[(v, values[id(v)]) for v in layer.variables]):
        return rule.pre(layer, inputs)


def with_values(values, variables, new):
    """`values` (id -> value) with `variables` at `new`."""
    out = dict(values)
    out.update({id(v): n for v, n in zip(variables, new)})
    return out

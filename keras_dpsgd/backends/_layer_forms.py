"""The per-layer rules' backend-neutral part: each layer's pre-activation in ``keras.ops``, and the registry's test.

A rule (:class:`Rule`) serves a layer whose output before its activation, ``pre(layer, inputs)``, is computed
from its own variables (read from the current ``StatelessScope``: :func:`pre_at`) and its input; ``post`` is what
the layer applies after (its activation). The closed forms of the per-example squared norms (``Rule.sq_norms``:
Dense's ``||a||²·||δ||²``, Gram and direct forms, Embedding's Gram form with id equality; Li et al. 2022's ghost
norm) are written here once over a backend's :class:`Arrays` (``None``: the vector-Jacobian product of each
example); each backend's ``_rules`` adds its :class:`Arrays`, the vector-Jacobian products of ``pre`` alone (not of
the model) and the closed forms only it has. A closed form is a certified upper bound of the squared norm, not its
float32 value (``keras_dpsgd.dp.rounding``): the clipped sum is computed apart, so rows that cancel must not round
the norm to 0.
:func:`rule_for` gives a layer's rule from a backend's registry (:func:`registry`: exact layer type -> rule).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import string
from typing import Any, Callable

import keras
from keras.src.backend.common.stateless_scope import StatelessScope

from keras_dpsgd.dp import rounding as _rounding

__all__ = [
    "Arrays",
    "ReadWatch",
    "outer_sq_norms",
    "Rule",
    "DenseForm",
    "EinsumDenseForm",
    "ConvForm",
    "DepthwiseConvForm",
    "EmbeddingForm",
    "LayerNormForm",
    "ReversibleEmbeddingForm",
    "registry",
    "registered_type",
    "rule_for",
    "pre_at",
    "with_values",
]


@dataclasses.dataclass(frozen=True)
class Arrays:
    """The array functions the closed forms need, one backend's (the rest is Python operators: ``*``, ``abs``).

    Attributes:
      einsum: ``(spec, *operands)`` at full float32 precision.
      sum: ``(x, axes)``, axes an int or a tuple.
      sqrt: elementwise.
      concat: ``(list, axis)``.
      float32: x in float32.
      staged_sq_norms: ``g [B, ...] -> (||g_i||², how many terms each rounded sum adds at most)``.
    """

    einsum: Callable
    sum: Callable
    sqrt: Callable
    concat: Callable
    float32: Callable
    staged_sq_norms: Callable


def _rows(m: Arrays, tensors) -> Any:
    """The tensors ([B, ..., k] each) as rows [B, T, k], concatenated over the calls, in float32."""
    rows = [x.reshape(x.shape[0], -1, x.shape[-1]) for x in tensors]
    return m.float32(rows[0] if len(rows) == 1 else m.concat(rows, 1))


def _gram(m: Arrays, x):
    """[B, T, T]: the rows' dot products ``x_t·x_s`` of x [B, T, k]."""
    return m.einsum("bti,bsi->bts", x, x)


def _row_norms(m: Arrays, x):
    return m.sqrt(m.sum(x * x, 2))


def _weighted(m: Arrays, norms, gram):
    """``Σ_{t,s} n_t n_s |gram_ts|`` per example (norms [B, T], gram [B, T, T]): ``_rounding.gram_upper``'s."""
    return m.sum(norms * m.einsum("bts,bs->bt", abs(gram), norms), 1)


def gram_cheaper(rows: int, d_in: int, d_out: int) -> bool:
    """Whether the Gram form of T rows (B·T²·(i + j)) costs less than the direct product (B·T·i·j)."""
    return rows * (d_in + d_out) < d_in * d_out


def outer_sq_norms(m: Arrays, a, d):
    """Upper bounds of (||Σ_t a_tᵀ δ_t||², ||Σ_t δ_t||²) per example from rows a [B, T, i] and δ [B, T, j] (float32):
    a Dense kernel and bias (``keras_dpsgd.dp.rounding``: certified, whatever the rows' cancellation).

    ``||a||²·||δ||²`` for one row; else the Gram form ``Σ_{t,s}(a_t·a_s)(δ_t·δ_s)`` (B·T²·(i + j); Li et al. 2022's
    ghost norm) or the direct product (B·T·i·j), whichever is cheaper (:func:`gram_cheaper`).
    """
    rows, d_in, d_out = a.shape[1], a.shape[2], d.shape[2]
    if rows == 1:  # the bias's gradient is δ itself (no sum over rows), the kernel's a δᵀ: one ‖δ‖² serves both
        dd = m.sum(d * d, (1, 2))
        kernel = _rounding.positive_upper(m.sum(a * a, (1, 2)) * dd, d_in + d_out + 1)
        return kernel, _rounding.positive_upper(dd, d_out)
    d_norms = _row_norms(m, d)
    summed = m.sum(d, 1)
    bias = _rounding.linear_upper(m.sum(summed * summed, 1), d_out, m.sum(d_norms, 1), rows)
    a_norms = _row_norms(m, a)
    lengths = m.sum(a_norms * d_norms, 1)  # S = Σ_t ‖a_t‖ ‖δ_t‖
    if gram_cheaper(rows, d_in, d_out):
        aa, dd = _gram(m, a), _gram(m, d)
        terms = aa * dd
        gram, absolute = m.sum(terms, (1, 2)), m.sum(abs(terms), (1, 2))
        weighted = _weighted(m, a_norms, dd), _weighted(m, d_norms, aa)
        return _rounding.gram_upper(gram, absolute, lengths, *weighted, widths=(d_in, d_out), rows=rows), bias
    sq, count = m.staged_sq_norms(m.einsum("bti,btj->bij", a, d))
    return _rounding.linear_upper(sq, count, lengths, rows), bias


class Rule:
    """A layer whose output before its activation, ``pre(layer, inputs)``, reads its own variables only.

    ``pre`` reads the layer's variables from the current ``StatelessScope``; ``post`` is what the layer
    applies after (its activation). ``sq_norms`` may return closed forms per variable (``None``: the
    vector-Jacobian product of each example).
    """

    def tap(self, layer, inputs):
        """What a covered call hands ``pre`` and records for the norms and sums: its input, or a function of it that
        reads none of the layer's variables, computed once in the forward pass (LayerNormalization: the normalized
        rows, so each example's gradient needs no second normalization)."""
        return inputs

    def pre(self, layer, inputs):
        """The output before the activation from ``tap``'s value, affine in the layer's trainable variables."""
        raise NotImplementedError

    def post(self, layer, outputs):
        return outputs

    def covers(self, layer) -> bool:
        return not getattr(layer, "lora_enabled", False)

    def __init__(self, arrays: Arrays | None = None):
        self.arrays = arrays  # the backend's functions for the closed forms (None: no closed form)

    def sq_norms(self, layer, calls, trainable) -> dict | None:
        return None

    def grads(self, layer, calls, variables) -> list | None:
        """Each example's gradient of `variables` (this layer's) in closed form, [B, *shape] each, summed over the
        `calls` ((input, output gradient) pairs [B, 1, ...]), or None (the vector-Jacobian product of each example).
        """
        return None

    def computes(self, layer, inputs, args: tuple, kwargs: dict) -> bool:
        """Whether ``pre`` then ``post`` compute this call (its other arguments considered); where not, the layer
        is not covered (its variables take the exact path)."""
        return True

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

    def sq_norms(self, layer, calls, trainable):
        """The kernel's and the bias's norms from the calls' rows (:func:`outer_sq_norms`); None under LoRA."""
        if layer.lora_enabled or self.arrays is None:
            return None
        kernel, bias = outer_sq_norms(
            self.arrays, _rows(self.arrays, [a for a, _ in calls]), _rows(self.arrays, [d for _, d in calls])
        )
        out = {id(layer._kernel): kernel}
        if layer.bias is not None:
            out[id(layer.bias)] = bias
        keep = {id(t) for t in trainable}
        return {k: v for k, v in out.items() if k in keep}


def einsum_rows(equation: str) -> tuple[str, str, str, str, str] | None:
    """The letters (x, y, T, D, U) of ``y = einsum("x,w->y", x, w)`` whose kernel gradient is a sum of outer products
    of rows: each example's ``Σ_t a_tᵀ δ_t`` (entries permuted) with rows a_t of x over the D letters and δ_t of its
    output gradient over the U letters, t over the T letters; None where it is no such sum.

    Each kernel letter must be contracted with x (a D letter: in x, not in y) or kept in y (a U letter: in y, not in
    x), and every other letter be in both x and y (the rows T): the rows are then x and δ transposed, exact copies, as
    certified as a Dense's (a letter summed first, of x or y alone, would round the rows: None). Written as in
    ``keras.layers.EinsumDense``: two operands, each letter once, no ellipsis."""
    spec = equation.replace(" ", "")
    if "..." in spec or spec.count("->") != 1 or spec.count(",") != 1:
        return None
    inputs, y = spec.split("->")
    x, w = inputs.split(",")
    if not all(s.isalpha() and len(set(s)) == len(s) for s in (x, w, y)) or any((c in x) == (c in y) for c in w):
        return None
    if any(c not in w and c not in y for c in x) or any(c not in w and c not in x for c in y):
        return None
    rows = "".join(c for c in x if c in y)  # not in w: a kernel letter is in exactly one of x and y
    return x, y, rows, "".join(c for c in w if c in x), "".join(c for c in w if c in y)


def _einsum_rows(m: Arrays, spec: str, rows: str, columns: str, tensors):
    """The calls' tensors ([B, 1, ...] each, the 1 the example's batch axis, letters `spec`) transposed to rows
    [B, T, k] (T over the `rows` letters, k over the `columns`), concatenated over the calls, in float32."""
    example = next(c for c in string.ascii_letters if c not in spec)
    out = []
    for x in tensors:
        size = dict(zip(spec, x.shape[1:]))
        r = m.einsum(f"{example}{spec}->{example}{rows}{columns}", m.float32(x))  # a transpose: exact
        out.append(r.reshape(x.shape[0], math.prod(size[c] for c in rows), math.prod(size[c] for c in columns)))
    return out[0] if len(out) == 1 else m.concat(out, 1)


class EinsumDenseForm(DenseForm):
    def pre(self, layer, inputs):
        x = keras.ops.einsum(layer.equation, inputs, layer.kernel)
        return x if layer.bias is None else keras.ops.add(x, layer.bias)

    def sq_norms(self, layer, calls, trainable):
        """Where the kernel's gradient is a sum of outer products of rows (:func:`einsum_rows`) and the Gram form
        costs less than the product (:func:`gram_cheaper`; one row: ``||a||²·||δ||²``), the kernel's norm from the
        calls' rows (:func:`outer_sq_norms`), and a bias along the U axes takes ``||Σ_t δ_t||²``; else None (each
        example's gradient materialized, which the release then sums). None under LoRA."""
        letters = None if layer.lora_enabled or self.arrays is None else einsum_rows(layer.equation)
        if letters is None or (layer.bias is not None and set(layer.bias_axes) != set(letters[4])):
            return None  # (a bias along other axes: materialized with the kernel)
        x, y, rows, d_letters, u_letters = letters
        size = dict(zip(x, calls[0][0].shape[1:]))
        size.update(zip(y, calls[0][1].shape[1:]))
        count = sum(math.prod(a.shape[1:]) for a, _ in calls) // math.prod(size[c] for c in d_letters)
        d_in, d_out = (math.prod(size[c] for c in group) for group in (d_letters, u_letters))
        if count > 1 and not gram_cheaper(count, d_in, d_out):
            return None
        m = self.arrays
        a = _einsum_rows(m, x, rows, d_letters, [a for a, _ in calls])
        d = _einsum_rows(m, y, rows, u_letters, [g for _, g in calls])
        kernel, bias = outer_sq_norms(m, a, d)
        out = {id(layer._kernel): kernel}
        if layer.bias is not None:
            out[id(layer.bias)] = bias
        keep = {id(t) for t in trainable}
        return {k: v for k, v in out.items() if k in keep}

    def grads(self, layer, calls, variables):
        """Each example's gradient in closed form where the kernel's is a sum of outer products of rows
        (:func:`einsum_rows`): ``einsum("Zx,Zy->Zw")`` of the calls' inputs and output gradients (the vector-Jacobian
        product of ``einsum("x,w->y")`` in w, each example Z apart), a bias the sum of the output gradient over the
        letters it does not hold; None under LoRA or for another equation (the vector-Jacobian product of each
        example). The norm and the clipped sum then read these values (self-consistent)."""
        letters = None if layer.lora_enabled or self.arrays is None else einsum_rows(layer.equation)
        if letters is None:
            return None
        x, y = letters[:2]
        w = layer.equation.replace(" ", "").split("->")[0].split(",")[1]
        z = next(c for c in string.ascii_letters if c not in x + y + w)
        m = self.arrays

        def kernel():
            return sum(m.einsum(f"{z}{x},{z}{y}->{z}{w}", m.float32(a), m.float32(d)) for a, d in calls)

        def bias():
            kept = "".join(c for c in y if c in layer.bias_axes)
            shape = (calls[0][1].shape[0],) + tuple(layer.bias.shape)
            return sum(m.einsum(f"{z}{y}->{z}{kept}", m.float32(d)).reshape(shape) for _, d in calls)

        found = {id(layer._kernel): kernel}
        if layer.bias is not None:
            found[id(layer.bias)] = bias
        return [found[id(v)]() for v in variables] if all(id(v) in found for v in variables) else None


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


class DepthwiseConvForm(ConvForm):
    def pre(self, layer, inputs):
        outputs = keras.ops.depthwise_conv(  # BaseDepthwiseConv.call, before the activation
            inputs,
            layer.kernel,
            strides=layer.strides,
            padding=layer.padding,
            dilation_rate=layer.dilation_rate,
            data_format=layer.data_format,
        )
        if not layer.use_bias:
            return outputs
        channels = layer.kernel.shape[-2] * layer.kernel.shape[-1]
        if layer.data_format == "channels_last":
            shape = (1,) * (layer.rank + 1) + (channels,)
        else:
            shape = (1, channels) + (1,) * layer.rank
        return keras.ops.add(outputs, keras.ops.reshape(layer.bias, shape))


class EmbeddingForm(Rule):
    def pre(self, layer, inputs):
        return keras.layers.Embedding.call(layer, inputs)

    def sq_norms(self, layer, calls, trainable):
        """The Gram form with id equality, ``Σ_{t,s} [id_t = id_s] δ_t·δ_s`` (the one-hot rows' Gram is exact), while
        it is cheaper than the direct form (one [V, d] gradient per example: None)."""
        m = self.arrays
        ids = None if m is None else m.concat([x.reshape(x.shape[0], -1) for x, _ in calls], 1)
        if m is None or ids.shape[1] ** 2 > layer.input_dim:
            return None
        d = _rows(m, [g for _, g in calls])
        same = m.float32(ids[:, :, None] == ids[:, None, :])
        terms = same * _gram(m, d)
        gram, absolute = m.sum(terms, (1, 2)), m.sum(abs(terms), (1, 2))
        norms = _row_norms(m, d)
        lengths = m.sum(norms, 1)  # S = Σ_t ‖δ_t‖ (a one-hot row has norm 1)
        weighted = _weighted(m, norms, same)  # Σ β|x̂|; the exact x̂ needs no α term
        widths, rows = (0, d.shape[2]), ids.shape[1]
        return {
            id(layer.embeddings): _rounding.gram_upper(gram, absolute, lengths, 0.0, weighted, widths=widths, rows=rows)
        }


class ReversibleEmbeddingForm(EmbeddingForm):
    """``keras.layers.ReversibleEmbedding`` (keras_hub's token embeddings): a lookup of integer ids, or with
    ``reverse=True`` the hidden states times the table transposed (``tie_weights``) or times the reverse table:
    linear in the variables either way. Without a logit soft cap or a reverse dtype (then ``post`` is nothing)."""

    def covers(self, layer) -> bool:
        return super().covers(layer) and layer.logit_soft_cap is None and layer.reverse_dtype is None

    def pre(self, layer, inputs):
        if "int" in keras.backend.standardize_dtype(inputs.dtype):
            return keras.layers.Embedding.call(layer, inputs)
        kernel = keras.ops.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
        return keras.ops.matmul(inputs, kernel)

    def computes(self, layer, inputs, args: tuple, kwargs: dict) -> bool:
        """``pre`` tells the two calls apart by the inputs' dtype: the call's ``reverse`` must agree."""
        reverse = kwargs.get("reverse", args[0] if args else False)
        integer = "int" in keras.backend.standardize_dtype(inputs.dtype)
        return isinstance(reverse, bool) and reverse != integer and len(args) + len(kwargs) <= 1


class LayerNormForm(Rule):
    """LayerNormalization over the last axis in float32 as ``x̂ · gamma + beta``: the tap is the normalized rows x̂ (no
    variable read), so each example's gradient of gamma and beta is a sum over its rows of ``δ ⊙ x̂`` and ``δ``.
    Elsewhere (other axes, other dtypes) the tap is the input and ``pre`` the layer's own call, affine in gamma and
    beta given it."""

    @staticmethod
    def _normalized_first(layer, inputs) -> bool:
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        last = len(inputs.shape) - 1
        return (
            len(axes) == 1
            and axes[0] in (-1, last)
            and keras.backend.standardize_dtype(inputs.dtype) == "float32"
            and layer.compute_dtype == "float32"
        )

    def tap(self, layer, inputs):
        """The normalized rows: Keras's normalization with gamma 1 and beta 0 (no variable read), on the rows as a
        matrix [rows, D] (under JAX's vmap an example's [1, T, D] would make its reductions [B, 1, T, 1], which XLA
        on CPU runs about 10x slower than the same over [B, T, 1])."""
        if not self._normalized_first(layer, inputs):
            return inputs
        rows = keras.ops.reshape(inputs, (-1, inputs.shape[-1]))
        normalized = keras.ops.layer_normalization(
            rows, None, None, axis=-1, epsilon=layer.epsilon, rms_scaling=layer.rms_scaling
        )
        return keras.ops.reshape(normalized, inputs.shape)

    def pre(self, layer, inputs):
        if not self._normalized_first(layer, inputs):
            return keras.layers.LayerNormalization.call(layer, inputs)  # affine in gamma and beta
        out = inputs if layer.gamma is None else keras.ops.multiply(inputs, layer.gamma)
        return out if layer.beta is None else keras.ops.add(out, layer.beta)  # Keras makes no beta with RMS


class ReadWatch:
    """Reads of some layers' variables outside their own calls (weight tying, a custom layer or a compiled loss
    reading a kernel): a rule on the layer's call alone would lose that use's gradient.

    Keras reads a variable in a stateless call through ``StatelessScope.get_current_value``; while :meth:`reads_seen`
    is open that read is checked: a read of a watched layer's variable while :meth:`watching` is open and the
    innermost call running (:meth:`own_call`) is not that layer's puts the layer in ``violations``.
    """

    def __init__(self, layers):
        self.owner = {id(v): layer for layer in layers for v in layer.variables}
        self.inside: list = []  # the watched layers' calls running, innermost last
        self.violations: set = set()
        self.watching = False

    @contextlib.contextmanager
    def watch(self):
        """Reads are checked while this is open (the model's call, the compiled loss)."""
        before, self.watching = self.watching, True
        try:
            yield
        finally:
            self.watching = before

    @contextlib.contextmanager
    def own_call(self, layer):
        """`layer`'s own call runs: its reads of its variables are its own."""
        self.inside.append(layer)
        try:
            yield
        finally:
            self.inside.pop()

    @contextlib.contextmanager
    def reads_seen(self):
        """``StatelessScope.get_current_value`` checks each read while this is open."""
        original = StatelessScope.get_current_value

        def read(scope, variable):
            owner = self.owner.get(id(variable))
            if owner is not None and self.watching and (not self.inside or self.inside[-1] is not owner):
                self.violations.add(owner)
            return original(scope, variable)

        StatelessScope.get_current_value = read
        try:
            yield self
        finally:
            StatelessScope.get_current_value = original


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


# What a class holds when its body defines nothing (``class ReversibleEmbedding(keras.layers.ReversibleEmbedding):
# pass``, keras_hub's): Python's own entries.
_EMPTY_CLASS = frozenset(
    {"__module__", "__doc__", "__qualname__", "__dict__", "__weakref__", "__firstlineno__", "__static_attributes__"}
)


def registered_type(layer, rules: dict) -> type | None:
    """The type of `layer` in `rules`: its own, or the nearest base its class and the classes between add nothing
    to (a subclass that defines nothing computes what its base does; any other subclass may compute something
    else), or None."""
    for cls in type(layer).__mro__:
        if cls in rules:
            return cls
        if set(vars(cls)) - _EMPTY_CLASS:
            return None
    return None


def rule_for(layer, rules: dict[type, Rule]) -> Rule | None:
    """The rule of `layer` in `rules` (its exact type, or a base that a subclass defining nothing inherits from:
    :func:`registered_type`), or None."""
    cls = registered_type(layer, rules)
    rule = rules.get(cls) if cls is not None else None
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

"""Per-example rules for tf_keras's LSTM and GRU layers (their ``standard_lstm``/``standard_gru`` call).

In a traced step, ``tf_keras.layers.LSTM`` (and ``GRU`` with ``reset_after=True``) with the
default activations, no recurrent dropout and ``unroll=False`` calls one function,
``standard_lstm`` (``standard_gru``), as a ``PartitionedCall`` op whose inputs are the sequence
``x`` [B, T, D], the initial states, the kernel K, the recurrent kernel R, the bias and the mask,
and whose Python arguments (``time_major``, ``go_backwards``, ``zero_output_for_mask``,
``return_sequences``, ``sequence_lengths``) are kept in the function's signature. The op is
recognized from its function's name, its ``api_implements`` attribute and that signature; any
other call (or any other argument value) is not, and stays on the reference path.

An example's gradients are sums over the time steps of rank-one terms,

    ∂ℓ_i/∂K = Σ_t x_itᵀ δ_it,    ∂ℓ_i/∂R = Σ_t h_i,t-1ᵀ δ_it,    ∂ℓ_i/∂b = Σ_t δ_it,

with ``δ_it = ∂ℓ_i/∂z_it`` the gradient at the gate pre-activations ``z_t = x_t K + h_t-1 R + b``
(the GRU has two, ``x_t K + b_in`` and ``h_t-1 R + b_rec``). The ``while`` loop of the layer keeps
``δ`` inside; so the rule recomputes the recurrence, unrolled over the static length T, from the
call's own inputs (the same function, the same ops), and the backend backpropagates through that
copy instead of the call (``Site.through``): the call's output gradients ∂(Σ_i ℓ_i)/∂(outputs)
flow into the copy, which gives ``δ`` and the gradients of the call's inputs (an Embedding below
the LSTM) in the same backward pass, without the layer's own ``while``-loop gradient. The kernels' uses are then
:class:`~keras_dpsgd.backends.tensorflow.uses.OuterUse` with T time steps (ghost norm or per-example
materialization, whichever is cheaper for the shape), the bias a :class:`DenseUse`. A run-time
assertion checks that the copy's last output equals the layer's (finite entries, float32).
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from typing import Optional

import tensorflow as tf

from keras_dpsgd.backends.tensorflow import _calls, _loops, uses as _uses

_ARGS = {
    "lstm": (
        "inputs",
        "init_h",
        "init_c",
        "kernel",
        "recurrent_kernel",
        "bias",
        "mask",
        "time_major",
        "go_backwards",
        "sequence_lengths",
        "zero_output_for_mask",
        "return_sequences",
    ),
    "gru": (
        "inputs",
        "init_h",
        "kernel",
        "recurrent_kernel",
        "bias",
        "mask",
        "time_major",
        "go_backwards",
        "sequence_lengths",
        "zero_output_for_mask",
        "return_sequences",
    ),
}
_STATES = {"lstm": ("init_h", "init_c"), "gru": ("init_h",)}
_WEIGHTS = ("kernel", "recurrent_kernel", "bias")
_FUNCTION_NAME = re.compile(r"^__inference_standard_(lstm|gru)_\d+$")


@dataclasses.dataclass(frozen=True)
class Call:
    """A recognized ``standard_lstm``/``standard_gru`` call: its tensor inputs and flags."""

    kind: str  # "lstm" or "gru"
    op: tf.Operation
    tensors: dict  # argument name -> the op's input tensor (mask absent when None)
    go_backwards: bool
    zero_output_for_mask: bool
    return_sequences: bool

    @property
    def outputs(self) -> tuple:
        """The float outputs: last output, output sequence, final state(s)."""
        return tuple(self.op.outputs[: 2 + len(_STATES[self.kind])])

    def index_of(self, name: str) -> int:
        return next(i for i, t in enumerate(self.op.inputs) if t is self.tensors[name])


def recognize(op) -> Optional[Call]:
    """The call of ``standard_lstm``/``standard_gru`` that ``op`` is, or None."""
    found = _calls.definition(op)
    if found is None:
        return None
    fn, fdef = found
    match = _FUNCTION_NAME.match(fdef.signature.name)
    sig = getattr(getattr(fn, "graph", None), "structured_input_signature", None) if match else None
    if sig is None or sig[1]:
        return None
    kind, args = match.group(1), sig[0]
    attrs = fdef.attr
    implements = attrs["api_implements"].s.decode() if "api_implements" in attrs else ""
    if not implements.startswith(kind + "_") or len(args) != len(_ARGS[kind]):
        return None
    values, tensors, k = dict(zip(_ARGS[kind], args)), {}, 0
    for arg, value in values.items():
        if isinstance(value, tf.TensorSpec):
            if value.name != arg or k >= len(op.inputs):
                return None
            tensors[arg] = op.inputs[k]
            k += 1
    flags = ("time_major", "go_backwards", "zero_output_for_mask", "return_sequences")
    if any(not isinstance(values[f], bool) for f in flags) or values["sequence_lengths"] is not None:
        return None
    if values["time_major"] or set(tensors) - {"mask"} != set(_ARGS[kind][:-6]):
        return None
    return Call(kind, op, tensors, values["go_backwards"], values["zero_output_for_mask"], values["return_sequences"])


def _shapes_known(call: Call) -> bool:
    x = call.tensors["inputs"]
    return (
        x.shape.rank == 3
        and x.shape[1] is not None
        and x.shape[2] is not None
        and all(call.tensors[w].shape.is_fully_defined() for w in _WEIGHTS)
    )


# ----------------------------------------------------------------- rows (``_rows``)
def rows_rule(op, ins, opaque, mixed):
    """Rows of a recognized call's outputs: those of its (batch-major) data inputs; None if ``op``
    is not recognized.

    The recurrence runs per example (row ``i`` of every output depends on row ``i`` of the
    sequence, the mask and the initial states only); other data inputs make it opaque.
    """
    call = recognize(op)
    if call is None:
        return None
    data = {name: ins[call.index_of(name)] for name in call.tensors}
    if any(data[w] is not None for w in _WEIGHTS):
        return mixed(op, "runs a recurrence with weights computed from the batch")
    inputs = [r for r in data.values() if r is not None]
    if data["inputs"] is None or any(
        r.axis != 0 or r.k != 1 or r.depth != 0 or r.order != data["inputs"].order for r in inputs
    ):
        return opaque
    return [data["inputs"]] * len(call.outputs) + [opaque] * (len(op.outputs) - len(call.outputs))


# ---------------------------------------------------------- the rule (``_handlers``)
def site_for(op, index, w, var, clean, static_batch, site_cls):
    """The use of K, R or the bias in a recognized call (None when not recognized)."""
    call = recognize(op)
    if call is None or w.dtype == tf.resource or not _shapes_known(call):
        return None
    name = next((n for n in _WEIGHTS if call.tensors[n] is op.inputs[index]), None)
    if name is None or int(index) != call.index_of(name):
        return None
    if w.shape.num_elements() != var.shape.num_elements():
        return None
    x = call.tensors["inputs"]
    if not clean.clean(x) or (static_batch is not None and x.shape[0] not in (None, static_batch)):
        return None
    for arg in ("mask",) + _STATES[call.kind]:
        t = call.tensors.get(arg)
        if t is not None and clean.rows.get(t.ref()) is not None and not clean.clean(t):
            return None

    copy = _copy_of(call)

    def make(deltas, batch):
        return copy.uses(deltas)[name]

    return site_cls(copy.pre_flat, make, through=(call.outputs, copy.outputs))


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _copy_of(call: Call) -> "_Copy":
    """The unrolled copy of one call (built once per call and traced graph)."""
    per_graph = _CACHE.setdefault(call.op.graph, {})
    if call.op.name not in per_graph:
        per_graph[call.op.name] = _Copy(call)
    return per_graph[call.op.name]


def _f32(t):
    return t if t.dtype == tf.float32 else tf.cast(t, tf.float32)


def _projected(x_seq, kernel, input_bias=None):
    """``x_t K`` (+ the input bias) for every step at once: [B, T, G] (one matmul, not T)."""
    steps, width = int(x_seq.shape[1]), int(x_seq.shape[2])
    xk = tf.matmul(tf.reshape(x_seq, [-1, width]), kernel)
    if input_bias is not None:
        xk = tf.nn.bias_add(xk, input_bias)
    return tf.reshape(xk, [-1, steps, int(kernel.shape[-1])])


def _lstm_step(xk_t, states, recurrent_kernel, bias):
    """One step of ``standard_lstm`` from ``x_t K``; returns (per-step pre-activations, output, states)."""
    h, c = states
    z = xk_t + tf.matmul(h, recurrent_kernel)
    z = tf.nn.bias_add(z, bias)
    z0, z1, z2, z3 = tf.split(z, 4, axis=1)
    c_new = tf.sigmoid(z1) * c + tf.sigmoid(z0) * tf.tanh(z2)
    h_new = tf.sigmoid(z3) * tf.tanh(c_new)
    return (), h_new, (h_new, c_new)


def _gru_step(mx_t, states, recurrent_kernel, recurrent_bias):
    """One step of ``standard_gru`` (reset_after) from ``x_t K + b_in``; returns (per-step
    pre-activations, output, states)."""
    (h,) = states
    mi = tf.nn.bias_add(tf.matmul(h, recurrent_kernel), recurrent_bias)
    x_z, x_r, x_h = tf.split(mx_t, 3, axis=1)
    r_z, r_r, r_h = tf.split(mi, 3, axis=1)
    z = tf.sigmoid(x_z + r_z)
    r = tf.sigmoid(x_r + r_r)
    hh = tf.tanh(x_h + r * r_h)
    h_new = z * h + (1 - z) * hh
    return (mi,), h_new, (h_new,)


def _unrolled(call: Call):
    """The recurrence of ``backend.rnn`` unrolled: (outputs like the call's, the input projection
    ``x K`` [B, T, G] in step order, the per-step pre-activations, h_{t-1} per step, x in step order).

    The input projection of every step is one matmul (the same products as the loop's
    ``x_t K``, batched); only the recurrent part runs step by step.
    """
    t = call.tensors
    x, mask = t["inputs"], t.get("mask")
    x_seq = tf.reverse(x, [1]) if call.go_backwards else x
    steps = range(int(x.shape[1]))
    order = list(reversed(steps)) if call.go_backwards else list(steps)
    if call.kind == "lstm":
        projected = _projected(x_seq, t["kernel"])
        step, weights = _lstm_step, (t["recurrent_kernel"], t["bias"])
    else:
        input_bias, recurrent_bias = tf.unstack(t["bias"])
        projected = _projected(x_seq, t["kernel"], input_bias)
        step, weights = _gru_step, (t["recurrent_kernel"], recurrent_bias)
    states = tuple(t[s] for s in _STATES[call.kind])
    prev = tf.zeros_like(states[0])
    pre, h_prev, outs = [], [], []
    for k, xk_t in zip(order, tf.unstack(projected, axis=1)):
        h_prev.append(states[0])
        z, out, new_states = step(xk_t, states, *weights)
        pre.extend(z)
        if mask is not None:
            m = tf.cast(mask[:, k], tf.bool)[:, None]
            out = tf.where(m, out, tf.zeros_like(out) if call.zero_output_for_mask else prev)
            new_states = tuple(tf.where(m, n, s) for n, s in zip(new_states, states))
        outs.append(out)
        prev, states = out, new_states
    last = outs[-1]
    seq = tf.stack(outs, axis=1) if call.return_sequences else last[:, None]
    return (last, seq) + tuple(states), projected, pre, h_prev, x_seq


class _Copy:
    """The recurrence of one call, unrolled: its outputs (like the call's) and pre-activations.

    ``pre_flat``: the tensors whose gradients give the per-step deltas: the input projection
    ``x K (+ b_in)`` [B, T, G], then (GRU) each step's ``h_t-1 R + b_rec``. In the LSTM both
    products enter one sum ``z_t``, so the projection's gradient is ``δ_t`` of both kernels.
    """

    def __init__(self, call: Call):
        self.call = call
        self.outputs, projected, pre, h_prev, self.x_seq = _unrolled(call)
        self.pre_flat = (projected, *pre)
        self.h_seq = tf.stack([_f32(h) for h in h_prev], axis=1)
        self._uses = {}

    def uses(self, deltas: tuple) -> dict:
        """Uses of K, R and the bias from ∂(Σℓ)/∂(pre-activations), in the order of ``pre_flat``."""
        key = tuple(d.ref() for d in deltas)
        if key not in self._uses:
            self._uses[key] = self._make_uses(deltas)
        return self._uses[key]

    def _make_uses(self, deltas: tuple) -> dict:
        call = self.call
        with tf.control_dependencies(_loops.same_values(self.outputs[0], call.op.outputs[0])):
            delta_x = tf.identity(_f32(deltas[0]))  # [B, T, G]
        if call.kind == "lstm":
            delta_h = delta_x
            bias = tf.reduce_sum(delta_x, axis=1)
        else:
            delta_h = tf.stack([_f32(d) for d in deltas[1:]], axis=1)
            bias = tf.stack([tf.reduce_sum(delta_x, axis=1), tf.reduce_sum(delta_h, axis=1)], axis=1)
        return {
            "kernel": _uses.OuterUse(_f32(self.x_seq), delta_x),
            "recurrent_kernel": _uses.OuterUse(self.h_seq, delta_h),
            "bias": _uses.DenseUse(bias),
        }

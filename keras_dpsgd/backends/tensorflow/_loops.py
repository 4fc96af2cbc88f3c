"""Recurrent ``while`` loops, unrolled: Keras 3 RNNs (and tf_keras's ``backend.rnn``) on TensorFlow.

Keras 3's ``keras.layers.LSTM``/``GRU``/``SimpleRNN`` (TensorFlow backend, no cuDNN) and tf_keras's
generic recurrent layers run ``backend.rnn``: one ``tf.while_loop`` whose body reads the time step
``t`` of the sequence from a TensorList (``TensorListGetItem``), calls the cell (MatMuls with the
kernel and recurrent kernel, read from the captured variables), masks, and writes the output to
another TensorList (``TensorListSetItem``). An example's gradient is the sum over the time steps of
each step's use of the weights (``Σ_t x_tᵀ δ_t`` for the kernel, ``Σ_t h_t-1ᵀ δ_t`` for the
recurrent kernel), but the loop keeps the step's ``δ_t`` inside.

:func:`unrolled` therefore copies the body of the loop, op for op, ``T`` times into the step's
graph (``T`` = the static length of the sequence the body reads), feeding step ``t`` the inputs'
time slices (``tf.unstack``) and step ``t - 1``'s loop values. The copy is the same function of the
same inputs as the loop (the same ops in the same order), so its outputs and its gradients are the
loop's; its uses of a weight are ordinary ops (a MatMul per step) that the registered rules handle,
and the backend backpropagates the loop's output gradients through the copy (``Site.through``).
Anything the copy cannot reproduce exactly is refused at trace time (the loop then stays on the
reference path): a body with a stateful op other than a variable read (random dropout masks, an
assignment), with a nested function (``If``, ``While``, a call), a sequence of unknown length, or a
TensorList used other than read at a static step or written at a static index. At run time the
step asserts that the loop ran exactly ``T`` iterations and that the copy's outputs equal the
loop's (finite float32 entries).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import numpy as np
import tensorflow as tf

from keras_dpsgd.backends.tensorflow import _checks
from keras_dpsgd.dp.refusals import refusal_message

WHILE_OPS = frozenset({"While", "StatelessWhile"})
# The ops whose outputs an unrolled copy stands for: the loop and the stacks of its output lists.
COPIED_OPS = WHILE_OPS | {"TensorListStack"}
_FLOATS = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
# Longest copy built (ops): beyond it the loop stays on the reference path.
_MAX_COPIED_OPS = 50_000
# The unrolled copy must equal the loop up to float rounding.
_RTOL, _ATOL = 1e-3, 1e-4


class _Decline(Exception):
    """The body has something the copy cannot reproduce exactly."""


@dataclasses.dataclass
class _Source:
    """A captured TensorList built from a tensor: its time slices (unstacked once)."""

    items: list


@dataclasses.dataclass
class _Written:
    """A TensorList the body writes: the items written so far, by index."""

    size: int
    items: dict


@dataclasses.dataclass
class Unrolled:
    """The copy of one ``while`` loop: new ops, the loop's outputs and their copies, reads."""

    op: tf.Operation
    steps: int
    ops: list  # the copy's ops, in creation order
    originals: tuple  # float outputs of the loop (and stacks of its output TensorLists)
    copies: tuple  # the same values computed by the copy
    reads: dict  # input index of a captured variable handle -> the copy's read of it

    @property
    def through(self) -> tuple:
        return (self.originals, self.copies)

    def checks(self) -> list:
        """Run-time assertions: the loop ran ``steps`` iterations and the copy equals it."""
        if not hasattr(self, "_built_checks"):
            count = _checks.check(
                tf.equal(self.op.outputs[0], tf.constant(self.steps, self.op.outputs[0].dtype)),
                refusal_message(
                    "per-example-check",
                    f"keras_dpsgd: the loop {self.op.name!r} did not run {self.steps} iterations, "
                    "the length of its sequence; use per_example_backend='reference' and report this",
                ),
            )
            self._built_checks = count + [c for o, k in zip(self.originals, self.copies) for c in same_values(k, o)]
        return self._built_checks


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def unrolled(op: tf.Operation) -> Optional[Unrolled]:
    """The unrolled copy of the ``while`` loop ``op`` (built once per op and graph), or None."""
    if op.type not in WHILE_OPS:
        return None
    per_graph = _CACHE.setdefault(op.graph, {})
    if op.name not in per_graph:
        try:
            per_graph[op.name] = _unroll(op)
        except _Decline:
            per_graph[op.name] = None
    return per_graph[op.name]


def _static_int(t) -> Optional[int]:
    if t.dtype not in (tf.int32, tf.int64) or t.shape.rank != 0:
        return None
    value = tf.get_static_value(t)
    return None if value is None else int(value)


def _lists(op, body) -> tuple:
    """(T, {input index: _Source}) of the TensorLists the body reads, all of static length T."""
    sources, steps = {}, set()
    for j, (outer, inner) in enumerate(zip(op.inputs, body.inputs)):
        if outer.dtype != tf.variant or outer.op.type != "TensorListFromTensor":
            continue
        if body.outputs[j] is not inner:
            raise _Decline()  # Not loop-invariant.
        src = outer.op.inputs[0]
        if src.shape.rank is None or src.shape.rank < 1 or src.shape[0] is None:
            raise _Decline()
        steps.add(int(src.shape[0]))
        sources[j] = src
    if len(steps) != 1 or 0 in steps:
        raise _Decline()
    (t,) = steps
    return t, sources


def _fold(op, values: list) -> Optional[np.ndarray]:
    """Integer scalar arithmetic of the loop's counters, evaluated at trace time."""
    if any(v is None for v in values):
        return None
    if op.type == "Identity":
        return values[0]
    if op.type in ("AddV2", "Add"):
        return values[0] + values[1]
    if op.type == "Sub":
        return values[0] - values[1]
    return None


def _has_function(op) -> bool:
    return any(value.HasField("func") or value.list.func for value in op.node_def.attr.values())


class _Builder:
    """Copies the body ``steps`` times into the outer graph (see the module doc)."""

    def __init__(self, op, body, steps, sources):
        self.op, self.body, self.steps = op, body, steps
        self.sources = {j: _Source(tf.unstack(src, num=steps)) for j, src in sources.items()}
        self.reads, self.consts = {}, {}

    def initial(self) -> list:
        values = []
        for j, outer in enumerate(self.op.inputs):
            if j in self.sources:
                values.append(self.sources[j])
            elif outer.dtype == tf.variant:
                if outer.op.type != "TensorListReserve":
                    raise _Decline()
                size = _static_int(outer.op.inputs[1])
                if size is None:
                    raise _Decline()
                values.append(_Written(size, {}))
            else:
                values.append(outer)
        return values

    def step(self, values: list) -> list:
        env = {inner.ref(): v for inner, v in zip(self.body.inputs, values)}
        static = {}
        for inner, v in zip(self.body.inputs, values):
            value = _static_int(v) if isinstance(v, tf.Tensor) else None
            if value is not None:
                static[inner.ref()] = np.asarray(value)
        for bop in self.body.get_operations():
            if bop.type in ("Placeholder", "NoOp"):
                continue
            outs = self._copy(bop, env, static)
            for t, v in zip(bop.outputs, outs):
                env[t.ref()] = v
        return [env[t.ref()] for t in self.body.outputs]

    def _copy(self, bop, env, static) -> list:
        ins = [env[t.ref()] for t in bop.inputs]
        if bop.type == "Const":
            if bop.name not in self.consts:
                self.consts[bop.name] = tf.constant(tf.make_ndarray(bop.get_attr("value")))
            const = self.consts[bop.name]
            value = _static_int(const)
            if value is not None:
                static[bop.outputs[0].ref()] = np.asarray(value)
            return [const]
        folded = _fold(bop, [static.get(t.ref()) for t in bop.inputs])
        if folded is not None and bop.outputs[0].dtype in (tf.int32, tf.int64):
            static[bop.outputs[0].ref()] = folded
            return [tf.constant(folded, bop.outputs[0].dtype)]
        if bop.type == "Identity" and isinstance(ins[0], (_Source, _Written)):
            return ins
        if bop.type == "TensorListGetItem":
            index = static.get(bop.inputs[1].ref())
            if not isinstance(ins[0], _Source) or index is None or not 0 <= int(index) < self.steps:
                raise _Decline()
            return [ins[0].items[int(index)]]
        if bop.type == "TensorListSetItem":
            index = static.get(bop.inputs[1].ref())
            if not isinstance(ins[0], _Written) or index is None or not 0 <= int(index) < ins[0].size:
                raise _Decline()
            if not isinstance(ins[2], tf.Tensor):
                raise _Decline()
            return [_Written(ins[0].size, {**ins[0].items, int(index): ins[2]})]
        if bop.type == "ReadVariableOp":
            return [self._read(bop, ins[0])]
        if any(not isinstance(v, tf.Tensor) for v in ins) or _has_function(bop):
            raise _Decline()
        if bop.op_def.is_stateful:
            raise _Decline()  # Random ops, assignments: a copy would not reproduce them.
        graph = self.op.graph
        new = graph._create_op_internal(  # pylint: disable=protected-access
            bop.type,
            ins,
            [t.dtype for t in bop.outputs],
            name=bop.name.rpartition("/")[2],
            attrs=dict(bop.node_def.attr),
            op_def=bop.op_def,
        )
        return list(new.outputs)

    def _read(self, bop, handle) -> tf.Tensor:
        j = next((j for j, t in enumerate(self.op.inputs) if t is handle), None)
        if j is None or handle.dtype != tf.resource or self.body.outputs[j] is not self.body.inputs[j]:
            raise _Decline()
        if j not in self.reads:
            dtype = bop.get_attr("dtype")
            self.reads[j] = tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
        return self.reads[j]


def _unroll(op) -> Unrolled:
    body = getattr(op, "_body_graph", None)
    if body is None or len(body.inputs) != len(op.inputs) or len(body.outputs) != len(op.inputs):
        raise _Decline()
    if _static_int(op.inputs[0]) != 0:
        raise _Decline()  # while_v2's iteration counter starts at 0.
    steps, sources = _lists(op, body)
    if steps * len(body.get_operations()) > _MAX_COPIED_OPS:
        raise _Decline()
    graph = op.graph
    before = len(graph.get_operations())
    with graph.as_default(), graph.name_scope(op.name + "_unrolled/"):
        builder = _Builder(op, body, steps, sources)
        values = builder.initial()
        for _ in range(steps):
            values = builder.step(values)
        originals, copies = [], []
        for out, value in zip(op.outputs, values):
            if out.dtype in _FLOATS:
                if not isinstance(value, tf.Tensor):
                    raise _Decline()
                originals.append(out)
                copies.append(value)
            elif isinstance(value, _Written):
                stacks = _stacks(out, value)
                originals += [o for o, _ in stacks]
                copies += [c for _, c in stacks]
    new_ops = graph.get_operations()[before:]
    return Unrolled(op, steps, new_ops, tuple(originals), tuple(copies), dict(builder.reads))


def _stacks(out: tf.Tensor, written: _Written) -> list:
    """(TensorListStack of a written output list, the stack of the copy's items)."""
    consumers = out.consumers()
    if any(c.type != "TensorListStack" for c in consumers):
        raise _Decline()
    if not consumers:
        return []
    if sorted(written.items) != list(range(written.size)):
        raise _Decline()
    stacked = tf.stack([written.items[i] for i in range(written.size)])
    return [(c.outputs[0], stacked) for c in consumers]


def same_values(mine: tf.Tensor, theirs: tf.Tensor, atol: float = _ATOL, rtol: float = _RTOL) -> list:
    """Run-time check that a recomputed tensor equals the layer's (finite float32 entries)."""
    if mine.dtype != tf.float32 or theirs.dtype != tf.float32:
        return []
    finite = tf.math.is_finite(mine) & tf.math.is_finite(theirs)
    excess = tf.abs(mine - theirs) - (atol + rtol * tf.abs(theirs))
    worst = tf.reduce_max(tf.where(finite, excess, tf.zeros_like(excess)))
    return _checks.check(
        worst <= 0.0,
        refusal_message(
            "per-example-check",
            f"keras_dpsgd: the per-example rule of op {theirs.op.name!r} does not reproduce "
            "the layer's output; use per_example_backend='reference' and report this",
        ),
    )

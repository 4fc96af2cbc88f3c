"""The rows of ``IdentityN``: ``tf.identity_n`` and every ``tf.custom_gradient`` (``tf.nn.silu``, swish).

In a graph, ``tf.custom_gradient`` returns its results through one ``IdentityN`` op over
``results + arguments + variables`` whose gradient is the user's function (registered under a
generated name, the op's ``_gradient_op_type``). Forward, output ``i`` *is* input ``i``: its rows are
the input's. Backward, the gradient reaching the arguments is whatever that function computes from
the results' gradients, so the per-example gradients the backends read (row ``i`` of
``∂(Σ_j ℓ_j)/∂x`` is ``∂ℓ_i/∂x_i``) need it to keep the examples apart too. :func:`rows_rule` traces
the gradient function once in a scratch graph and analyzes it with the same rules, each result's
gradient having the rows of that result and each forward tensor it reads the rows of that tensor
(an intermediate of the forward analyzed from the op's inputs): the gradient of every data argument
must have the argument's rows. A gradient that mixes the examples (a sum over the batch of a data
argument's gradient, a batch mean read back) makes the outputs mixed; one the rules cannot see
through (a gradient function that fails to trace, a data read of its own) makes them opaque.
Gradients of non-data arguments (silu's ``beta``) are not read.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf
from tensorflow.python.framework import func_graph  # pylint: disable=no-name-in-module
from tensorflow.python.framework import ops as tf_ops  # pylint: disable=no-name-in-module


def _backward(op, name: str) -> Optional[tuple]:
    """``(graph, result_gradients, argument_gradients)`` of the gradient function ``name`` of
    ``op``, traced in a scratch graph nested in ``op.graph``; None if it cannot be traced."""
    try:
        fn = tf_ops._gradient_registry.lookup(name)  # pylint: disable=protected-access
        with op.graph.as_default():
            graph = func_graph.FuncGraph("keras_dpsgd_custom_gradient")
            with graph.as_default():
                dys = [tf.compat.v1.placeholder(t.dtype, t.shape) for t in op.outputs]
                grads = fn(op, *dys)
    except Exception:  # noqa: BLE001  (anything it cannot trace is not proven: opaque)
        return None
    grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
    if len(grads) != len(op.inputs) or any(g is not None and not isinstance(g, tf.Tensor) for g in grads):
        return None
    return graph, dys, grads


def _forward_rows(op, inputs: dict, externals: list, body_rows: Callable):
    """The rows of the forward tensors the gradient function reads (``externals``) that are not inputs of
    ``op`` (an intermediate of the forward, ``e = exp(x)`` read back as ``dy * e``): the rules over the ops
    between ``op``'s inputs (their rows known) and them, in ``op.graph``; None where that cannot be done
    (a tensor of another graph that is no constant, a data read of its own on the way)."""
    ops, stack = set(), []
    for t in externals:
        if t.ref() in inputs or t.dtype == tf.resource:
            continue
        if t.graph is not op.graph:
            if tf.get_static_value(t) is None:
                return None
            continue
        stack.append(t.op)
    while stack:
        o = stack.pop()
        if o in ops:
            continue
        ops.add(o)
        stack.extend(t.op for t in o.inputs if t.ref() not in inputs)
    seeds = {ref: r for ref, r in inputs.items() if r is not None}
    args = set(inputs) | {t.ref() for t in getattr(op.graph, "internal_captures", ())}
    return body_rows(sorted(ops, key=lambda o: o._id), seeds, args)  # pylint: disable=protected-access


def rows_rule(op, ins: list, body_rows: Callable, mixed: Callable, opaque) -> list:
    """Rows of the outputs of the ``IdentityN`` ``op`` (output ``i`` has the rows of input ``i``) if
    its gradient keeps the examples apart; else all mixed or all opaque.

    Args:
      op: the ``IdentityN`` op.
      ins: the rows of each input (None: not data).
      body_rows: ``_rows._body_rows(ops, seeds, args)``, the rules over a graph's ops.
      mixed: ``_rows.mixed(op, what)``.
      opaque: ``_rows.OPAQUE``.
    """
    n = len(op.outputs)
    try:
        name = op.get_attr("_gradient_op_type")
    except ValueError:
        return list(ins)  # tf.identity_n: its gradient is the identity too.
    found = _backward(op, name.decode() if isinstance(name, bytes) else name)
    if found is None:
        return [opaque] * n
    graph, dys, grads = found
    seeds = {dy.ref(): r for dy, r in zip(dys, ins) if r is not None}
    inputs = {t.ref(): r for t, r in zip(op.inputs, ins)}
    forward = _forward_rows(op, inputs, [e for e, _ in graph.captures], body_rows)
    if forward is None:
        return [opaque] * n
    for external, internal in graph.captures:
        r = inputs.get(external.ref()) if external.ref() in inputs else forward.rows.get(external.ref())
        if r is not None:
            seeds[internal.ref()] = r
    args = {t.ref() for t in dys} | {internal.ref() for _, internal in graph.captures}
    inner = body_rows(graph.get_operations(), seeds, args)
    if inner is None:
        return [opaque] * n
    for g, r in zip(grads, ins):
        got = None if g is None or r is None else inner.rows.get(g.ref())
        if got is None:
            continue  # Not a data argument, or a gradient that depends on no example.
        if got.kind == "mixed":
            return [mixed(op, f"has a custom gradient that mixes the examples ({got.reason})")] * n
        if got.kind != "rows" or (got.axis, got.order, got.depth) != (r.axis, r.order, r.depth):
            return [opaque] * n
    return list(ins)

"""The body of a function-call op (``PartitionedCall``/``StatefulPartitionedCall``) of a traced step.

A ``tf.function`` called inside a layer (Keras's own XLA-compiled convolution, tf_keras's LSTM/GRU
kernels, or a user's helper) shows up in the step's graph as one call op whose ops live in a
function of the graph's library. :func:`body_graph` returns the ``FuncGraph`` that function was
traced from (and its output tensors), only if its ops are those of the function's definition
(what executes): same names, same types, inputs and outputs matching the call's. Anything else (a function imported without
its Python graph, a definition rewritten after tracing) is ``None``: the caller must then treat
the call as unknown.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})


def definition(op):
    """``(function, FunctionDef)`` of the call ``op``, or None."""
    if op.type not in CALL_OPS:
        return None
    try:
        fn = op.graph._get_function(op.get_attr("f").name)  # pylint: disable=protected-access
        fdef = fn.cached_definition if hasattr(fn, "cached_definition") else fn.definition
    except (AttributeError, KeyError, ValueError):
        return None
    return fn, fdef


def body_graph(op) -> Optional[tuple]:
    """``(FuncGraph, outputs)`` of the call ``op``: the graph it runs and the tensors of that graph
    that are the call's outputs, checked against the function's definition; or None.

    TensorFlow may append outputs to a function's graph after the call was made (intermediates for
    a gradient), so the call's outputs are the graph tensors the definition returns, in order.
    """
    found = definition(op)
    if found is None:
        return None
    fn, fdef = found
    graph = getattr(fn, "graph", None)
    sig = fdef.signature
    if not isinstance(graph, tf.Graph) or len(graph.inputs) != len(op.inputs) or len(sig.input_arg) != len(op.inputs):
        return None
    if len(sig.output_arg) != len(op.outputs) or len(graph.outputs) < len(op.outputs):
        return None
    outputs = list(graph.outputs[: len(op.outputs)])
    for arg, t in zip(sig.output_arg, outputs):
        if fdef.ret[arg.name].split(":")[0] != t.op.name:
            return None
    try:
        if any(graph.get_operation_by_name(node.name).type != node.op for node in fdef.node_def):
            return None
    except KeyError:
        return None
    return graph, outputs

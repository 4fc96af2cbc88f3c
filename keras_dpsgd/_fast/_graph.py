"""Finding how each trainable variable enters the per-example loss of a traced train step.

Inside the ``FuncGraph`` of the train step, every variable is a captured resource handle. We
follow it through ``ReadVariableOp`` and value-preserving ops (Identity, Cast, reshapes) to the
ops that *use* it, keeping only ops from which the loss is reachable (gradient flows only along
those). A variable is handled by the fast path only if *every* use is one of the known ops of
``_handlers`` and its activation side depends on the input data; otherwise it falls back to
per-example jacobians (never to anything weaker).

Assumption, as in every ghost-clipping implementation: activations that feed a handled op are
batch-major, i.e. their axis 0 indexes the examples of the batch in order, possibly repeated
contiguously (``[B·T, D]`` from ``tf.tensordot`` on ``[B, T, D]``). All built-in tf_keras
layers satisfy it; the loss itself must be per-example (row ``i`` depends on example ``i`` only),
which DP-SGD requires anyway.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_dpsgd._fast._handlers import HANDLERS, gather_site

# Ops whose output is the variable's value, reshaped or cast (same elements, same order).
_TRANSPARENT = frozenset({"Identity", "Cast", "ExpandDims", "Reshape", "Squeeze"})
# Ops that read only metadata (no gradient flows through them).
_NO_GRADIENT = frozenset({"Shape", "ShapeN", "Size", "Rank"})
# Ops whose outputs are not data even when they have no data inputs.
_NOT_DATA_SOURCES = frozenset({"Const", "ReadVariableOp", "ResourceGather", "VarHandleOp"})

def ancestors(loss: tf.Tensor) -> set:
    """All ops from which ``loss`` is reachable along data edges."""
    seen = {loss.op}
    stack = [loss.op]
    while stack:
        op = stack.pop()
        for t in op.inputs:
            if t.op not in seen:
                seen.add(t.op)
                stack.append(t.op)
    return seen


def batch_major_ops(ops: set) -> dict:
    """Data-dependent ops among ``ops`` -> whether their outputs are still batch-major.

    Forward propagation from the data sources (graph inputs, iterator outputs), in creation
    order (a topological order of a FuncGraph). An output stops being batch-major after an op
    that reorders or mixes axis 0: a Transpose moving axis 0, a reverse, reduction or data gather
    along axis 0, and SpaceToBatchND (dilated convolutions) until
    the matching BatchToSpaceND. Ops fed by a non-batch-major tensor are not handled by the fast
    path (their variables use per-example jacobians).

    Reshapes keep the property in the sense that matters: the elements of each example stay
    contiguous and in order, so ``group_rows`` can regroup rows [B·T, ...] into [B, T, ...]; a
    leading size that is not a multiple of B makes that reshape fail loudly.
    """
    status = {}  # op -> (mixed, space_to_batch_depth)
    for op in ops_in_order(ops):
        data_inputs = [status[t.op] for t in op.inputs if t.op in status]
        is_source = (
            op.type not in _NOT_DATA_SOURCES
            and all(t.dtype == tf.resource for t in op.inputs)
            and any(t.dtype != tf.resource for t in op.outputs)
        )
        if (not data_inputs and not is_source) or op.type in _NO_GRADIENT:
            continue  # Shapes are metadata, not rows of examples.
        mixed = any(m for m, _ in data_inputs)
        depth = max((d for _, d in data_inputs), default=0)
        if op.type in ("SpaceToBatchND", "SpaceToBatch"):
            depth += 1
        elif op.type in ("BatchToSpaceND", "BatchToSpace"):
            depth -= 1
            mixed = mixed or depth < 0
        elif _reorders_batch(op, status):
            mixed = True
        status[op] = (mixed, depth)
    return {op: (not mixed and depth == 0) for op, (mixed, depth) in status.items()}


def ops_in_order(ops: set) -> list:
    """``ops`` in graph creation order."""
    graph = next(iter(ops)).graph
    return [op for op in graph.get_operations() if op in ops]


_REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "Cumsum", "Cumprod", "ArgMax", "ArgMin"})


def _reorders_batch(op, status) -> bool:
    if op.type in _REDUCTIONS:  # Across examples (axis 0), or unknown axes.
        axes = tf.get_static_value(op.inputs[1])
        rank = op.inputs[0].shape.rank
        if rank == 0:
            return False
        return axes is None or rank is None or any(int(a) % rank == 0 for a in np.ravel(axes))
    if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMulV3"):  # xᵀ·(...) contracts examples.
        flag = "transpose_a" if op.type == "MatMul" else "adj_x"
        return op.inputs[0].op in status and bool(op.get_attr(flag))
    if op.type in ("ConcatV2", "Roll"):
        axis = tf.get_static_value(op.inputs[-1] if op.type == "ConcatV2" else op.inputs[2])
        return axis is None or 0 in np.ravel(axis)
    if op.type == "Transpose":
        perm = tf.get_static_value(op.inputs[1])
        return perm is None or int(perm[0]) != 0
    if op.type == "ReverseV2":
        axes = tf.get_static_value(op.inputs[1])
        rank = op.inputs[0].shape.rank
        if rank == 0:
            return False
        return axes is None or rank is None or any(int(a) % rank == 0 for a in np.ravel(axes))
    if op.type in ("GatherV2", "Gather", "ResourceGather"):
        if op.inputs[0].op not in status:
            return False  # A lookup in a table: the output follows the ids.
        axis = tf.get_static_value(op.inputs[2]) if op.type == "GatherV2" else 0
        return axis is None or int(axis) == 0
    return False


def internal_handles(graph, var) -> list:
    """The placeholders standing for ``var``'s handle in ``graph`` (following nested captures)."""
    handle = var.handle
    if getattr(handle, "graph", None) is graph:
        return [handle]
    outer = getattr(graph, "outer_graph", None)
    externals = [handle]
    if outer is not None and hasattr(outer, "captures"):
        externals += internal_handles(outer, var)
    found = []
    for external, internal in getattr(graph, "captures", ()):
        if any(external is e for e in externals):
            found.append(internal)
    return found


def find_sites(handles: list, var, ops: set, clean: dict, static_batch):
    """All uses of the variable on the way to the loss, or None if one of them is unknown."""
    sites = []
    stack = list(handles)
    while stack:
        t = stack.pop()
        for consumer in t.consumers():
            if consumer not in ops:
                continue
            for index, inp in enumerate(consumer.inputs):
                if inp is not t:
                    continue
                if t.dtype == tf.resource:
                    if consumer.type == "ReadVariableOp":
                        stack.append(consumer.outputs[0])
                        continue
                    site = gather_site(consumer, index, var, clean, static_batch)
                elif consumer.type in _TRANSPARENT and index == 0:
                    stack.append(consumer.outputs[0])
                    continue
                elif consumer.type in _NO_GRADIENT:
                    continue
                else:
                    handler = HANDLERS.get(consumer.type)
                    site = handler(consumer, index, t, var, clean, static_batch) if handler else None
                if site is None:
                    return None
                sites.append(site)
    return sites



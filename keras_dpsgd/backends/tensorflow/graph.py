"""Finding how each trainable variable enters the per-example loss of a traced train step.

Inside the ``FuncGraph`` of the train step, every variable is a captured resource handle. We
follow it through ``ReadVariableOp`` and value-preserving ops (Identity, Cast, reshapes) to the
ops that *use* it, keeping only ops from which the loss is reachable (gradient flows only along
those). A variable is handled by the fast path only if *every* use is one of the known ops of
``_handlers`` (``register_rule``) and its activation side depends on the input data; otherwise it falls back to
per-example jacobians (never to anything weaker).

Activations that feed a handled op must be *proven* batch-major by ``_rows`` (an allowlist of
ops that keep axis 0 as the examples of the batch in order, possibly repeated contiguously:
``[B·T, D]`` from ``tf.tensordot`` on ``[B, T, D]``); ``analyze`` raises where an op upstream
of the loss mixes the examples (then no per-example clipping is private).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

from keras_dpsgd.backends.tensorflow.eager_loss import eager_batch

from keras_dpsgd.backends.tensorflow import _checks, _derived, _grouped, _rows, _weight_region
from keras_dpsgd.backends.tensorflow import state as _state, uses as _uses
from keras_dpsgd.backends.tensorflow.handlers import rule_for, set_walker
from keras_dpsgd.dp.refusals import refusal_message, refuse

# Ops whose output is the variable's value, reshaped or cast (same elements, same order).
_TRANSPARENT = frozenset({"Identity", "Cast", "ExpandDims", "Reshape", "Squeeze"})
# Ops that read only metadata (no gradient flows through them).
_NO_GRADIENT = _state.METADATA

# Two-operand products: the variable's gradient through one is 0 when the other operand is 0.
_PRODUCTS = frozenset({"MatMul", "BatchMatMulV2", "BatchMatMulV3", "Mul"})


def is_zeros(t: tf.Tensor) -> bool:
    """Whether ``t`` is zeros by construction (``tf.zeros`` of any shape, ``zeros_like``)."""
    while t.op.type == "Identity":
        t = t.op.inputs[0]
    if t.op.type == "ZerosLike":
        return True
    value = tf.get_static_value(t.op.inputs[1] if t.op.type == "Fill" else t)
    return value is not None and not np.any(value)


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


_MIXING_HINT = (
    "DP-SGD clips each example's gradient, which bounds nothing when one example changes the "
    "loss of the others. Make the loss per example: {fix}, and return one loss value per example of the batch."
)
_BATCH_NORM_FIX = (
    "compute statistics per example (keras.layers.LayerNormalization or GroupNormalization instead of "
    "BatchNormalization, or freeze a pretrained BatchNormalization: `layer.trainable = False` runs it in "
    "inference mode)"
)
_OTHER_FIX = (
    "reduce, sort, tile or normalize over the non-batch axes only (an axis of each example's own values), "
    "never along the batch axis"
)


def mixing_message(reason: str) -> str:
    """The refusal of a loss that mixes the examples: the advice fits what was found (batch norm or not)."""
    batch_norm = any(word in reason.lower() for word in ("batch statistics", "batch_norm", "batchnorm", "moments"))
    fix = _BATCH_NORM_FIX if batch_norm else _OTHER_FIX
    return f"The per-example loss mixes the examples of the batch: {reason}. " + _MIXING_HINT.format(fix=fix)


_NO_INPUT_MESSAGE = (
    "keras_dpsgd cannot find the batch the per-example loss {loss!r} is computed from: no input of the "
    "step (a placeholder argument or a dataset read) it knows is upstream of the loss, so it cannot prove "
    "that each example's loss depends on that example alone. Feed the batch through Model.fit / the "
    "train step's arguments; a custom input pipeline inside the step is not supported."
)
_UNKNOWN_OP_MESSAGE = (
    "keras_dpsgd cannot prove that the per-example loss depends on each example alone: the batch goes "
    "through {ops}, which the per-example analysis does not know (an op outside its allowlist, a loop or "
    "a condition it cannot see into, a function without its graph). Such an op may mix the examples of "
    "the batch, and then no per-example clipping bounds one example's influence, so keras_dpsgd refuses "
    "rather than guess. Write the layer with standard TensorFlow ops (elementwise math, matmul, "
    "convolutions, reductions over non-batch axes); for a recurrent layer, give the sequences a static "
    "length (its loop is read only when the number of steps is known when the step is traced: pad to a "
    "fixed length, e.g. fit on arrays or padded_batch with fixed padded_shapes); or train with a static "
    "batch of one example, where nothing can mix."
)


def unknown_ops(loss: tf.Tensor, analysis: _rows.Analysis, limit: int = 3) -> list:
    """The ops where the batch first becomes opaque on its way to ``loss`` (at most ``limit``):
    an opaque output whose data inputs are not opaque, named with their layer."""
    opaque = lambda t: getattr(analysis.rows.get(t.ref()), "kind", None) == "opaque"  # noqa: E731
    found, seen, stack = [], {loss.op}, [loss.op]
    while stack:
        op = stack.pop()
        upstream = [t for t in op.inputs if opaque(t)]
        if not upstream and any(opaque(t) for t in op.outputs):
            found.append(f"op {op.name!r} ({op.type}) in layer {_rows.layer_scope(op)!r}")
        for t in upstream:
            if t.op not in seen:
                seen.add(t.op)
                stack.append(t.op)
    return sorted(found)[:limit]


def analyze(loss: tf.Tensor) -> _rows.Analysis:
    """Rows of every data tensor upstream of ``loss``; raises if the loss mixes examples.

    Raises:
      ValueError: an op upstream of the loss mixes the examples of the batch (the message names
        the op and its Keras layer), the batch reaches the loss through an op the analysis does
        not know (it cannot prove the loss is per example), no known input of the step is upstream
        of the loss, the loss reads a variable the step wrote a value of the batch into
        (``_state``), or the loss has a static size other than the inputs' batch.
    """
    graph = loss.graph
    captured = {t.ref() for t in getattr(graph, "internal_captures", ())}
    ops = ops_in_order(ancestors(loss))
    analysis = _rows.propagate(ops, captured, eager_batch(graph, loss, ops))
    if analysis.sources and all(s.shape[0] == 1 for s in analysis.sources):
        # One example (static shapes): nothing can mix or mis-group, every row is example 0.
        analysis = _rows.Analysis({ref: _rows.Rows() for ref in analysis.rows}, analysis.sources, [])
    status = analysis.rows.get(loss.ref())
    if status is None:
        raise refuse("no-input", _NO_INPUT_MESSAGE.format(loss=loss.name))
    if status.kind == "mixed":
        raise refuse("mixing-op", mixing_message(status.reason))
    if status.kind == "opaque":
        raise refuse(
            "unknown-op", _UNKNOWN_OP_MESSAGE.format(ops=", ".join(unknown_ops(loss, analysis)) or "unknown ops")
        )
    if status.kind == "rows" and status.k not in (None, 1):
        raise refuse(
            "loss-entries",
            f"The per-example loss must have one entry per example; it has {status.k} per example "
            f"(loss shape {loss.shape}). Average the entries of each example (shape [batch_size]).",
        )
    _state.refuse_state_reads(loss)  # A statistic of the batch kept in a variable, then read back.
    for source in analysis.sources:
        n, b = loss.shape[0], source.shape[0]
        if n is not None and b is not None and n != b:
            raise refuse(
                "loss-entries",
                f"The per-example loss must have one entry per example of the batch: the loss has "
                f"shape {loss.shape} but the input {source.name!r} has {b} examples (shape "
                f"{source.shape}). Return the unreduced loss, shape [batch_size] (no "
                f"reduce_mean(..., keepdims=True) over the batch).",
            )
    return analysis


def runtime_checks(loss: tf.Tensor, analysis: _rows.Analysis) -> list:
    """Assertions of what the trace could not prove: sizes known only at run time.

    The loss has as many entries as every input has examples, and each reshape with unknown
    sizes keeps whole examples in its rows (its batch axis is a multiple of the batch size).
    """
    if not analysis.sources:
        return []
    batch = tf.shape(analysis.sources[0])[0]
    checks = []
    for source in analysis.sources:
        checks += _checks.check(
            tf.equal(tf.shape(loss)[0], tf.shape(source)[0]),
            refusal_message(
                "loss-entries",
                f"keras_dpsgd: the per-example loss must have one entry per example of the "
                f"batch (input {source.name!r}); return the unreduced loss, shape [batch_size]",
            ),
        )
    for t, axis in analysis.reshapes:
        checks += _checks.check(
            tf.equal(tf.math.floormod(tf.shape(t)[axis], tf.maximum(batch, 1)), 0),
            refusal_message(
                "mixing-op",
                f"keras_dpsgd: op {t.op.name!r} (layer {_rows.layer_scope(t.op)!r}) "
                "reshapes values of several examples into one row; the loss is not per example",
            ),
        )
    return checks


def with_checks(tensors, checks):
    """``tensors`` (a list, or a tensor) made to depend on the run-time ``checks``."""
    if not checks:
        return tensors
    with tf.control_dependencies(checks):
        if isinstance(tensors, (list, tuple)):
            return [tf.identity(t) for t in tensors]
        return tf.identity(tensors)


def ops_in_order(ops: set) -> list:
    """``ops`` in graph creation order."""
    graph = next(iter(ops)).graph
    return [op for op in graph.get_operations() if op in ops]


def find_sites(handles: list, var, ops: set, clean: dict, static_batch, stopped: list | None = None):
    """All uses of the variable on the way to the loss, or None if one of them is unknown (then
    ``(op, reason)`` of the use that stopped the analysis is appended to ``stopped``).

    Where a use of a value computed from weights alone has no rule, the whole region of such ops after that value
    is taken at once (``_weight_region``), before giving up."""
    sites = []
    stack = list(handles)
    while stack:
        t = stack.pop()
        said = len(stopped) if stopped is not None else 0
        found = _consumer_sites(t, var, ops, clean, static_batch, stopped)
        if found is None and t.dtype != tf.resource and clean.rows.get(t.ref()) is None:
            region = _weight_region.region_sites(t, var, ops, clean, static_batch)
            found = None if region is None else ([], region)
            if found is not None and stopped is not None:
                del stopped[said:]
        if found is None:
            return None
        more, got = found
        stack += more
        sites.extend(got)
    return sites


def _consumer_sites(t, var, ops: set, clean, static_batch, stopped: list | None):
    """(the values to follow further, the sites) of the uses of ``t``, or None (see :func:`find_sites`)."""
    sites, more = [], []
    for consumer in t.consumers():
        if consumer not in ops:
            continue
        for index, inp in enumerate(consumer.inputs):
            if inp is not t:
                continue
            if t.dtype == tf.resource and consumer.type == "ReadVariableOp":
                more.append(consumer.outputs[0])
                continue
            if t.dtype != tf.resource and consumer.type in _TRANSPARENT and index == 0:
                more.append(consumer.outputs[0])
                continue
            if t.dtype != tf.resource and consumer.type in _NO_GRADIENT:
                continue
            if t.dtype != tf.resource and _SPLITS.get(consumer.type) == index:
                pieces = _split_sites(consumer, t, var, ops, clean, static_batch, stopped)
                if pieces is None:
                    return None
                sites.extend(pieces)
                continue
            if consumer.type in _PRODUCTS and is_zeros(consumer.inputs[1 - index]):
                continue  # A product with zeros (a recurrence's initial state): no gradient.
            if t.dtype != tf.resource and _derived.is_derived(consumer, index, clean):
                pulled = _derived.sites(consumer, index, t, var, ops, clean, static_batch, stopped)
                if pulled is None:
                    if not stopped or stopped[-1][0] is not consumer:
                        _stop(stopped, consumer, f"no pullback through this {consumer.type} on weights")
                    return None
                sites.extend(pulled)
                continue
            rule = rule_for(consumer.type)
            if rule is None:
                return _stop(stopped, consumer, "no per-example rule for this op type")
            site = rule(consumer, index, t, var, clean, static_batch)
            if site is None:
                return _stop(stopped, consumer, f"the {consumer.type} rule does not cover this use")
            sites.extend(site if isinstance(site, list) else [site])
    return more, sites


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One piece of a split variable, standing for it in the rules of its uses."""

    shape: tf.TensorShape
    dtype: tf.DType
    name: str


_SPLITS = {"Unpack": 0, "Split": 1, "SplitV": 0}  # op type -> index of the split value


def _pieces(op, w) -> list | None:
    """(piece, axis, offset, kept) of each output of a split of ``w`` along a static axis.

    ``kept``: the piece keeps the split axis (Split, SplitV) rather than dropping it (Unpack).
    """
    rank = w.shape.rank
    if op.type == "Unpack":
        axis = op.get_attr("axis") % rank
        return [(p, axis, k, False) for k, p in enumerate(op.outputs)]
    axis = tf.get_static_value(op.inputs[0] if op.type == "Split" else op.inputs[2])
    if axis is None:
        return None
    axis, out, offset = int(axis) % rank, [], 0
    for p in op.outputs:
        if p.shape[axis] is None:
            return None
        out.append((p, axis, offset, True))
        offset += int(p.shape[axis])
    return out if offset == int(w.shape[axis]) else None


def _stop(stopped: list | None, op, reason: str) -> None:
    """Records why the analysis of a variable stopped at ``op``; returns None (no sites)."""
    if stopped is not None:
        stopped.append((op, reason))
    return None


def _split_sites(op, w, var, ops: set, clean, static_batch, stopped: list | None = None):
    """Uses of the pieces of a split of ``w`` (Keras 3 GRU's input and recurrent biases:
    ``ops.unstack`` is a Split and Squeezes).

    Each piece's uses are found by their own rules, then embedded as per-example gradients
    [B, *var.shape] that are zero outside the piece (the variable's other uses are summed before
    the norm, as for any shared weight).
    """
    pieces = _pieces(op, w) if w.shape.is_fully_defined() else None
    if pieces is None:
        return _stop(stopped, op, "a split of the variable along an axis of unknown size")
    sites = []
    for piece, axis, offset, kept in pieces:
        found = find_sites([piece], _Piece(piece.shape, piece.dtype, var.name), ops, clean, static_batch, stopped)
        if found is None:
            return None
        embed = _embedded(piece.shape, w.shape, axis, offset, kept, var)
        sites += [dataclasses.replace(s, make=embed(s.make)) for s in found]
    return sites


def _embedded(piece_shape, w_shape, axis: int, offset: int, kept: bool, var):
    """Wraps ``make``: its use becomes a dense [B, *var.shape] gradient, zero outside the piece."""
    size = int(piece_shape[axis]) if kept else 1
    after = int(w_shape[axis]) - offset - size

    def wrap(make):
        def embedded(g, batch):
            p = _uses.materialize(make(g, batch), piece_shape)
            if not kept:
                p = tf.expand_dims(p, axis + 1)
            paddings = [[0, 0]] * (axis + 1) + [[offset, after]] + [[0, 0]] * (w_shape.rank - axis - 1)
            full = tf.pad(p, paddings)
            return _uses.DenseUse(tf.reshape(full, tf.concat([tf.shape(full)[:1], var.shape], axis=0)))

        return embedded

    return wrap


GROUPED_CONVOLUTION_MESSAGE = (
    "{what} is a grouped convolution (groups > 1), and TensorFlow's vectorized jacobian (pfor) computes "
    "wrong per-example gradients for grouped convolutions, so clipping them would not bound each example's "
    "contribution. {why} Use groups=1 (e.g. G parallel convolutions on channel slices, concatenated) otherwise."
)
# Why the per-example jacobian path would be taken, for the message.
_NOT_TRACED = "This step runs eagerly (run_eagerly=True): there is no graph for the fast backend's rule to read."
_NOT_FAST = (
    "Only the fast per-example backend (per_example_backend='auto' or 'fast') computes them exactly, for "
    "Conv1D/Conv2D with channels_last data, in a traced step (the default of fit)."
)
_NO_RULE = (
    "The fast backend computes them exactly for Keras's Conv1D/Conv2D(groups=G) with channels_last data, "
    "static spatial sizes and the layer's own float32 kernel, when the rest of the model needs no per-example "
    "jacobians either; here it could not (an unknown op or a variable without a fast rule)."
)


def grouped_convolutions(loss: tf.Tensor) -> list:
    """The grouped convolution ops (input channels a multiple > 1 of the kernel's) ``loss`` depends on:
    in the step's graph, and in the bodies of Keras's XLA-compiled convolution calls (``_grouped``)."""
    found = []
    for op in ancestors(loss):
        if _grouped.is_grouped(op):
            found.append(op)
        elif op.type in _grouped.CALL_OPS:
            found += [op] if _grouped.grouped_bodies(op) else []
    return found


def refuse_grouped_convolutions(loss: tf.Tensor) -> None:
    """Raises ValueError if a per-example jacobian of ``loss`` would go through a grouped convolution."""
    ops = grouped_convolutions(loss)
    if ops:
        raise refuse(
            "grouped-convolution", GROUPED_CONVOLUTION_MESSAGE.format(what=f"op {ops[0].name!r}", why=_NO_RULE)
        )


def grouped_convolution_layers(model: Any) -> list:
    """The convolution layers of ``model`` with ``groups > 1`` (either Keras)."""
    if model is None:
        return []
    # tf_keras models list their layers as `submodules`, Keras 3 ones through `_flatten_layers`.
    every = (
        model.submodules if hasattr(model, "submodules") else model._flatten_layers(include_self=True, recursive=True)
    )
    # DepthwiseConv2D has no ``groups`` (its pfor jacobian is right): only a ``groups`` > 1 counts.
    return [layer for layer in every if "Conv" in type(layer).__name__ and _groups(layer) > 1]


def _groups(layer) -> int:
    groups = getattr(layer, "groups", 1)
    return groups if isinstance(groups, int) else 1


def _fast_rule_covers(layer) -> bool:
    """Whether the grouped-convolution rule (``_grouped``) reads this layer's call: a Conv1D or
    Conv2D (not transposed) on channels_last data."""
    return (
        getattr(layer, "rank", None) in (1, 2)
        and getattr(layer, "data_format", None) == "channels_last"
        and "Transpose" not in type(layer).__name__
    )


def refuse_grouped_convolution_layers(model: Any, backend: Any = None) -> None:
    """Raises ValueError for a grouped convolution layer whose per-example gradients would come from
    per-example jacobians (pfor, wrong for them): unless the step is traced and ``backend`` is the fast
    backend, whose rule covers the layer (in the trace, a grouped convolution the rule cannot read is
    refused by :func:`refuse_grouped_convolutions`)."""
    layers = grouped_convolution_layers(model)
    if not layers:
        return
    fast = getattr(backend, "name", None) == "fast"
    if tf.executing_eagerly():
        why = _NOT_TRACED
    elif not fast or not all(_fast_rule_covers(layer) for layer in layers):
        layers = [layer for layer in layers if not fast or not _fast_rule_covers(layer)]
        why = _NOT_FAST
    else:
        return
    what = f"layer {layers[0].name!r} ({type(layers[0]).__name__}, groups={layers[0].groups})"
    raise refuse("grouped-convolution", GROUPED_CONVOLUTION_MESSAGE.format(what=what, why=why))


set_walker(find_sites)  # the rules that look through an op walk on from it (``_handlers.walk_sites``)

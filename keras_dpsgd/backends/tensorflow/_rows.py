"""Which tensors of a traced train step keep the examples of the batch apart (an allowlist).

DP-SGD's sensitivity bound needs the per-example loss ``ℓ_i`` to depend on example ``i`` alone;
the fast backend further needs every activation it uses to be *batch-major*: along one axis (the
batch axis), example ``i`` owns the contiguous block of indices ``[i·k, (i+1)·k)``.

``analyze(loss)`` propagates a :class:`Rows` status forward from the data sources (the step's
inputs: placeholders and iterator outputs), in graph creation order. An op keeps the status only
if it is in the allowlist of ``_RULES`` *and* its attributes show that it keeps the examples apart
(an elementwise op whose data operands have the batch on the same axis, a reduction over other
axes, a reshape whose rows hold whole examples, a slice taking the whole batch axis in order...).
The outcomes, per tensor:

* batch-major (``Rows.order is None``): ghost norms may use it;
* reordered (``Rows.order`` names the op): rows are whole examples, in another order (``x[::-1]``,
  ``tf.tile``, a gather or concat along the batch axis): per-example jacobians stay exact, ghost
  norms would mis-group them; anything later that would pair rows of two orders, or restructure
  the batch axis, is *mixing*;
* opaque (``Rows.kind == "opaque"``): an op outside the allowlist (control flow, custom ops, a call
  whose body cannot be read): nothing is proven about the rows any more, so a loss that depends on
  the batch only through opaque tensors is refused by ``_graph.analyze`` (an unknown op could mix
  the examples), unless the batch is statically one example. A function call's body is analyzed
  with the same rules (``_call_body``);
* mixing (``Rows.kind == "mixed"``): a reduction over the batch axis, a matmul contracting it,
  batch statistics, a reshape putting values of two examples in one row, ... No per-example
  clipping can bound the sensitivity then: ``analyze`` raises ``ValueError`` naming the layer.

Where a reshape's rows can only be checked when the shapes are known (a sequence length that is
None at trace time), ``analyze`` returns run-time assertions: the rows along the batch axis are a
multiple of the batch size, and the loss has exactly one entry per example of the inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import tensorflow as tf

from keras_dpsgd.backends.tensorflow import _calls, _custom_gradients, _grouped, _loops, _recurrent


@dataclasses.dataclass(frozen=True)
class Rows:
    """How a data tensor lays out the examples of the batch."""

    kind: str = "rows"  # "rows", "opaque", "mixed" or "ragged" (see _ragged)
    axis: int = 0  # the batch axis (kind "rows")
    k: Optional[int] = 1  # indices per example along it (None: unknown at trace time)
    depth: int = 0  # SpaceToBatchND nesting (dilated convolutions)
    order: Optional[str] = None  # None: examples in order; else the op that reordered them
    reason: str = ""  # kind "mixed": what mixes, naming the op
    partition: Optional[str] = None  # kind "ragged": the StringSplitV2 op whose row ids group the values

    @property
    def clean(self) -> bool:
        return self.kind == "rows" and self.order is None and self.axis == 0 and self.depth == 0


OPAQUE = Rows(kind="opaque")
_NO_DATA = frozenset({"Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike"})
_SOURCES = frozenset({"Placeholder", "IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue"})


def layer_scope(op) -> str:
    """The name scope of ``op``, i.e. the Keras layer that created it (``model/layer``)."""
    return op.name.rpartition("/")[0] or op.name


def mixed(op, what: str) -> Rows:
    return Rows(
        kind="mixed",
        reason=f"op {op.name!r} ({op.type}) in layer {layer_scope(op)!r} {what}",
    )


def _reordered(r: Rows, op) -> Rows:
    """Rows reordered (or repeated, or dropped) along the batch axis by ``op``: a new order."""
    return dataclasses.replace(r, order=op.name, k=None)


def _static(t):
    value = tf.get_static_value(t)
    return None if value is None else np.asarray(value)


def _norm_axes(axes, rank):
    return sorted({int(a) % rank for a in np.ravel(axes)})


def _dim(t, axis):
    return t.shape[axis] if t.shape.rank is not None and 0 <= axis < t.shape.rank else None


# -------------------------------------------------------------------------- rules
# A rule gets (op, rows of each input or None for a non-data input) and returns one Rows for
# every output, or a single Rows for all of them. Rules run only when every data input is "rows";
# `_combine` (same batch axis, same order) has already been applied to elementwise ops.

_UNARY = frozenset(
    """Identity Cast StopGradient PreventGradient EnsureShape CheckNumerics PlaceholderWithDefault
    Snapshot Relu Relu6 Elu Selu LeakyRelu Softplus Softsign Tanh Sigmoid Exp Expm1 Log Log1p Neg
    Abs Square Sqrt Rsqrt Reciprocal Inv Sign Floor Ceil Round Rint Erf Erfc Sin Cos Tan Asin Acos
    Atan Sinh Cosh Asinh Acosh Atanh IsFinite IsNan IsInf LogicalNot Lgamma Digamma Real Imag
    LRN ResizeBilinear ResizeNearestNeighbor ResizeBicubic ResizeArea DepthToSpace SpaceToDepth
    """.split()
)
_ELEMENTWISE = frozenset(
    """Add AddV2 AddN Sub Mul MulNoNan RealDiv Div DivNoNan FloorDiv FloorMod Mod TruncateDiv
    TruncateMod Maximum Minimum Pow SquaredDifference Atan2 Xlogy Xdivy Xlog1py BiasAdd BiasAddV1
    Equal NotEqual Greater GreaterEqual Less LessEqual LogicalAnd LogicalOr Select SelectV2
    ClipByValue BroadcastTo""".split()
)
_IMAGE_AXIS0_OPS = frozenset(
    {"LRN", "ResizeBilinear", "ResizeNearestNeighbor", "ResizeBicubic", "ResizeArea", "DepthToSpace", "SpaceToDepth"}
)
_REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"})


def _data(ins):
    return [(i, r) for i, r in enumerate(ins) if r is not None]


def _unary(op, ins):
    ((_, r),) = _data(ins)
    if op.type in _IMAGE_AXIS0_OPS and r.axis != 0:
        return mixed(op, "works across the batch axis")
    return r


def _softmax(op, ins):
    ((_, r),) = _data(ins)
    rank = op.inputs[0].shape.rank
    if rank is None or r.axis == rank - 1:
        return mixed(op, "normalizes across the examples (softmax over the batch axis)")
    return r


def _elementwise(op, ins):
    out = op.outputs[0]
    rank = out.shape.rank
    data = _data(ins)
    if op.type == "Select" and len(data) and rank is not None:
        # tf.compat.v1.where: a rank-1 condition picks rows.
        cond = op.inputs[0]
        if ins[0] is not None and cond.shape.rank == 1 and ins[0].axis == 0:
            data = [(i, r) for i, r in data if i != 0]
            if not data:
                return dataclasses.replace(ins[0])
    if rank is None:
        return mixed(op, "has an output of unknown rank")
    for i, r in data:
        t = op.inputs[i]
        if t.shape.rank != rank:
            return mixed(op, f"broadcasts input {i} of rank {t.shape.rank} against rank {rank}")
        if r.axis != data[0][1].axis:
            return mixed(op, "pairs tensors with the batch on different axes")
        if t.shape[r.axis] == 1 and out.shape[r.axis] != 1:
            return mixed(op, "broadcasts one row over the batch")
    k = next((r.k for _, r in data if r.k is not None), None)
    return dataclasses.replace(data[0][1], k=k)


def _reduction(op, ins):
    ((_, r),) = _data(ins)
    rank = op.inputs[0].shape.rank
    axes = _static(op.inputs[1])
    if rank is None or axes is None:
        return mixed(op, "reduces over axes unknown at trace time (possibly the batch axis)")
    if rank == 0:
        return r
    axes = _norm_axes(axes, rank)
    if r.axis in axes:
        return mixed(op, "reduces over the batch axis")
    if op.get_attr("keep_dims"):
        return r
    return dataclasses.replace(r, axis=r.axis - sum(a < r.axis for a in axes))


def _arg_reduction(op, ins):
    ((_, r),) = _data(ins)
    rank = op.inputs[0].shape.rank
    axis = _static(op.inputs[1])
    if rank is None or axis is None or int(axis) % rank == r.axis:
        return mixed(op, "reduces over the batch axis")
    return dataclasses.replace(r, axis=r.axis - (int(axis) % rank < r.axis))


def _cumulative(op, ins):
    ((_, r),) = _data(ins)
    rank = op.inputs[0].shape.rank
    axis = _static(op.inputs[1])
    if rank is None or axis is None or int(axis) % rank == r.axis:
        return mixed(op, "accumulates along the batch axis")
    return r


def _top_k(op, ins):
    """``tf.math.top_k`` / ``tf.sort`` (TopKV2 works along the last axis): rows kept unless that
    axis is the batch axis."""
    data = _data(ins)
    if [i for i, _ in data] != [0]:
        return mixed(op, "takes k from the data")
    r, rank = data[0][1], op.inputs[0].shape.rank
    if rank is None or r.axis == rank - 1:
        return mixed(op, "sorts along the batch axis")
    return r


def _transpose(op, ins):
    ((_, r),) = _data(ins)
    perm = _static(op.inputs[1])
    if perm is None:
        return mixed(op, "moves axes by a permutation unknown at trace time")
    return dataclasses.replace(r, axis=[int(p) for p in perm].index(r.axis))


def _expand_dims(op, ins):
    ((_, r),) = _data(ins)
    rank = op.inputs[0].shape.rank
    axis = _static(op.inputs[1])
    if rank is None or axis is None:
        return mixed(op, "inserts an axis at a position unknown at trace time")
    a = int(axis) % (rank + 1)
    return dataclasses.replace(r, axis=r.axis + (a <= r.axis))


def _squeeze(op, ins):
    ((_, r),) = _data(ins)
    x = op.inputs[0]
    if x.shape.rank is None:
        return mixed(op, "squeezes a tensor of unknown rank")
    dims = [int(d) % x.shape.rank for d in op.get_attr("squeeze_dims")]
    if not dims:
        if x.shape[r.axis] is None or x.shape[r.axis] == 1:
            return mixed(op, "may squeeze the batch axis")
        dims = [i for i, s in enumerate(x.shape) if s == 1]
    if r.axis in dims:
        return mixed(op, "squeezes the batch axis")
    return dataclasses.replace(r, axis=r.axis - sum(d < r.axis for d in dims))


def _partial_value(t, depth: int = 0):
    """The value of the int32/int64 shape computation ``t`` as far as the trace knows it: an int or
    None for a scalar, a list of (int or None) for a vector, None if unknown.

    Follows what ``tf.tensordot`` (tf_keras's Dense on sequences) and ``tf.reshape`` callers build
    from ``tf.shape(x)``: constants, ``Shape`` (the static dims of ``x``), ``GatherV2`` and
    ``StridedSlice`` of a vector with constant indices, ``Prod`` of a vector, ``Pack`` and
    ``ConcatV2``. TensorFlow's own shape inference stops at ``GatherV2`` and ``Prod``.
    """
    value = _static(t)
    if value is not None:
        return value.tolist() if value.ndim <= 1 else None
    if depth > 16 or t.shape.rank not in (0, 1):
        return None
    op, deeper = t.op, depth + 1
    if op.type in ("Identity", "Cast"):
        return _partial_value(op.inputs[0], deeper)
    if op.type == "Shape":
        x = op.inputs[0]
        return None if x.shape.rank is None else list(x.shape)
    if op.type == "Pack" and op.get_attr("axis") == 0:
        parts = [_partial_value(i, deeper) for i in op.inputs]
        return None if any(isinstance(p, list) for p in parts) else parts
    if op.type == "ConcatV2" and _static(op.inputs[-1]) is not None and int(_static(op.inputs[-1])) == 0:
        parts = [_partial_value(i, deeper) for i in op.inputs[:-1]]
        return None if any(not isinstance(p, list) for p in parts) else [d for p in parts for d in p]
    if op.type == "GatherV2":
        return _gathered(op, deeper)
    if op.type == "Prod":
        v, axis = _partial_value(op.inputs[0], deeper), _static(op.inputs[1])
        if (
            not isinstance(v, list)
            or axis is None
            or set(np.ravel(axis).tolist()) - {0, -1}
            or op.get_attr("keep_dims")
        ):
            return None
        return int(np.prod(v)) if all(d is not None for d in v) else None
    if op.type == "StridedSlice":
        return _sliced(op, deeper)
    return None


def _gathered(op, depth: int):
    v, indices, axis = _partial_value(op.inputs[0], depth), _static(op.inputs[1]), _static(op.inputs[2])
    if not isinstance(v, list) or indices is None or axis is None or int(axis) != 0 or op.get_attr("batch_dims"):
        return None
    if indices.ndim > 1 or any(not 0 <= int(i) < len(v) for i in np.ravel(indices)):
        return None
    picked = [v[int(i)] for i in np.ravel(indices)]
    return picked if indices.ndim == 1 else picked[0]


def _sliced(op, depth: int):
    """A StridedSlice of a vector with constant bounds (no ellipsis, no new axis)."""
    v = _partial_value(op.inputs[0], depth)
    begin, end, strides = (_static(t) for t in op.inputs[1:4])
    masks = [op.get_attr(m) for m in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")]
    if not isinstance(v, list) or begin is None or end is None or strides is None or begin.size != 1:
        return None
    if masks[2] or masks[3]:
        return None
    b = None if masks[0] & 1 else int(begin[0])
    e = None if masks[1] & 1 else int(end[0])
    if masks[4] & 1:
        return v[b] if b is not None and -len(v) <= b < len(v) else None
    return v[slice(b, e, int(strides[0]))]


def _target_shape(op) -> list:
    """The output dims of a Reshape: its static shape, completed from its shape operand."""
    y = op.outputs[0]
    dims = list(y.shape)
    value = _partial_value(op.inputs[1])
    if isinstance(value, list) and len(value) == len(dims):
        dims = [d if d is not None else (v if v is not None and v >= 0 else None) for d, v in zip(dims, value)]
    return dims


def _reshape(op, ins):
    r = ins[0]
    x, y = op.inputs[0], op.outputs[0]
    if x.shape.rank is None or y.shape.rank is None:
        return mixed(op, "reshapes to or from an unknown rank")
    if any(s != 1 for s in x.shape[: r.axis]):
        return mixed(op, "merges the batch axis with the axes before it")
    target = _target_shape(op)
    j = next((i for i, s in enumerate(target) if s != 1), 0)
    per_example = [r.k, *x.shape[r.axis + 1 :]]
    row = target[j + 1 :]
    if all(s is not None for s in per_example + row):
        e, w = int(np.prod(per_example)), int(np.prod(row))
        if e % w:
            return mixed(op, "puts values of several examples into one row")
        return dataclasses.replace(r, axis=j, k=e // w)
    if r.order is not None:
        return mixed(op, "reshapes reordered examples")
    return dataclasses.replace(r, axis=j, k=None)  # Checked at run time (`analyze`).


def _strided_slice(op, ins):
    r = ins[0]
    x = op.inputs[0]
    if any(b is not None for b in ins[1:4]):  # one example's values would place every example's slice
        return mixed(op, "slices with bounds computed from the data")
    # Bounds of other axes may be unknown (a random crop): only the batch axis's decide the rows.
    begin, strides = _partial_value(op.inputs[1]), _static(op.inputs[3])
    if x.shape.rank is None or not isinstance(begin, list) or strides is None:
        return mixed(op, "slices with bounds unknown at trace time")
    masks = {
        m: op.get_attr(m) for m in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")
    }
    n = len(begin)
    real = sum(1 for i in range(n) if not ((masks["ellipsis_mask"] | masks["new_axis_mask"]) >> i) & 1)
    in_dim = out_dim = 0
    result = None
    for i in range(n):
        bit = 1 << i
        if masks["ellipsis_mask"] & bit:
            span = x.shape.rank - real
            if in_dim <= r.axis < in_dim + span:
                result = out_dim + r.axis - in_dim
            in_dim, out_dim = in_dim + span, out_dim + span
            continue
        if masks["new_axis_mask"] & bit:
            out_dim += 1
            continue
        if in_dim == r.axis:
            if masks["shrink_axis_mask"] & bit:
                return mixed(op, "picks one example out of the batch")
            if begin[i] is None and not masks["begin_mask"] & bit:
                return mixed(op, "slices the batch axis with bounds unknown at trace time")
            whole = (
                int(strides[i]) == 1 and (masks["begin_mask"] & bit or int(begin[i]) == 0) and masks["end_mask"] & bit
            )
            result = out_dim if whole else None
            if not whole:
                return _reordered(dataclasses.replace(r, axis=out_dim), op)
        in_dim += 1
        out_dim += 0 if masks["shrink_axis_mask"] & bit else 1
    if result is None and r.axis >= in_dim:
        result = out_dim + r.axis - in_dim
    if result is None:
        return mixed(op, "slices the batch axis in a way the analysis does not follow")
    return dataclasses.replace(r, axis=result)


def _slice(op, ins):
    r = ins[0]
    begin, size = _static(op.inputs[1]), _static(op.inputs[2])
    if begin is None or size is None:
        return mixed(op, "slices with bounds unknown at trace time")
    if int(begin[r.axis]) == 0 and int(size[r.axis]) == -1:
        return r
    return _reordered(r, op)


def _along_axis(op, ins, axis_value, rank, data):
    """Concat/Pad-like ops: rows kept unless ``axis_value`` is the batch axis (then reordered)."""
    r = data[0][1]
    if axis_value is None or rank is None:
        return mixed(op, "works along an axis unknown at trace time")
    if r.axis in _norm_axes(axis_value, rank):
        return _reordered(r, op)
    return r


def _concat(op, ins):
    data = _data(ins[:-1])
    if any(r.axis != data[0][1].axis for _, r in data):
        return mixed(op, "concatenates tensors with the batch on different axes")
    return _along_axis(op, ins, _static(op.inputs[-1]), op.outputs[0].shape.rank, data)


def _pack(op, ins):
    data = _data(ins)
    if any(r.axis != data[0][1].axis for _, r in data):
        return mixed(op, "stacks tensors with the batch on different axes")
    r = data[0][1]
    a = op.get_attr("axis") % (op.outputs[0].shape.rank or 1)
    return dataclasses.replace(r, axis=r.axis + (a <= r.axis))


def _unpack(op, ins):
    ((_, r),) = _data(ins)
    rank = op.inputs[0].shape.rank
    a = op.get_attr("axis") % rank
    if a == r.axis:
        return mixed(op, "unstacks the batch into single examples")
    return dataclasses.replace(r, axis=r.axis - (a < r.axis))


def _split(op, ins):
    value, axis = (1, 0) if op.type == "Split" else (0, 2)
    r = ins[value]
    if r is None or ins[axis] is not None:
        return mixed(op, "splits along a data-dependent axis")
    return _along_axis(op, ins, _static(op.inputs[axis]), op.inputs[value].shape.rank, [(value, r)])


def static_entry(t, index: int):
    """The static value of ``t[index]`` for a rank-1 ``t`` (None if unknown): ``t`` static, or a
    ``Pack`` of scalars (``tf.repeat``'s multiples ``[1, ..., repeats, ...]``) whose entry is."""
    value = _static(t)
    if value is not None:
        return value[index]
    if t.op.type == "Pack" and t.op.get_attr("axis") == 0 and index < len(t.op.inputs):
        scalar = t.op.inputs[index]
        while scalar.op.type in ("Reshape", "Identity", "Cast") and scalar.op.inputs[0].shape.num_elements() == 1:
            scalar = scalar.op.inputs[0]  # tf.repeat's repeats, reshaped to a scalar
        entry = _static(scalar)
        return None if entry is None or entry.size != 1 else entry.reshape(())
    return None


def _tile(op, ins):
    """``tf.tile`` (and ``tf.repeat``, ``keras.ops.repeat``): rows kept when the batch axis is tiled
    by a static 1 (the other axes may be tiled by anything, e.g. K/V heads repeated for grouped-query
    attention); a batch axis tiled by more is reordered, by an unknown multiple mixed."""
    r = ins[0]
    multiple = static_entry(op.inputs[1], r.axis)
    if multiple is None:
        return mixed(op, "tiles the batch axis by a multiple unknown at trace time")
    return r if int(multiple) == 1 else _reordered(r, op)


def _pad(op, ins):
    r = ins[0]
    paddings = _static(op.inputs[1])
    if paddings is None:
        return mixed(op, "pads by amounts unknown at trace time")
    return r if not np.any(paddings[r.axis]) else _reordered(r, op)


def _reverse_or_roll(op, ins):
    r = ins[0]
    axes = _static(op.inputs[1] if op.type == "ReverseV2" else op.inputs[2])
    return _along_axis(op, ins, axes, op.inputs[0].shape.rank, [(0, r)])


def _gather(op, ins):
    params, ids = ins[0], ins[1]
    p = op.inputs[0]
    axis = 0 if op.type in ("Gather", "ResourceGather") else _static(op.inputs[2])
    batch_dims = op.get_attr("batch_dims") if op.type != "Gather" else 0
    if axis is None or p.shape.rank is None:
        return mixed(op, "gathers along an axis unknown at trace time")
    axis = int(axis) % max(p.shape.rank, 1)
    ids_rank = op.inputs[1].shape.rank
    if params is None:  # A table lookup: the output follows the ids.
        return (
            dataclasses.replace(ids, axis=axis + ids.axis) if batch_dims == 0 else mixed(op, "gathers with batch_dims")
        )
    if ids is None:
        if axis == params.axis:
            return _reordered(params, op)
        if axis > params.axis or ids_rank is None:
            return params if ids_rank is not None else mixed(op, "gathers with ids of unknown rank")
        return dataclasses.replace(params, axis=params.axis - 1 + ids_rank)
    if batch_dims >= 1 and params.axis == 0 and ids.axis == 0 and params.order == ids.order:
        return params  # Per-example gather (tf.gather(x, i, batch_dims=1)).
    return mixed(op, "indexes rows of one tensor by data")


def _resource_gather(op, ins):
    ids = ins[1]
    if op.get_attr("batch_dims") != 0:
        return mixed(op, "gathers with batch_dims")
    return ids


def _one_hot(op, ins):
    r = ins[0]
    a = op.get_attr("axis")
    if a == -1 or a > r.axis:
        return r
    return dataclasses.replace(r, axis=r.axis + 1)


def _matmul(op, ins):
    a, b = ins[0], ins[1]
    if b is not None:
        col = 0 if op.get_attr("transpose_b") else 1
        if a is None and b.axis == col:
            return dataclasses.replace(b, axis=1)
        return mixed(op, "multiplies by a matrix computed from the batch (contracts or pairs examples)")
    row = 1 if op.get_attr("transpose_a") else 0
    if a.axis != row:
        return mixed(op, "contracts the batch axis (xᵀ·...)")
    return dataclasses.replace(a, axis=0)


def _batch_matmul(op, ins):
    out_rank = op.outputs[0].shape.rank
    if out_rank is None:
        return mixed(op, "has an output of unknown rank")
    axes = []
    for i, r in _data(ins):
        rank = op.inputs[i].shape.rank
        adj = op.get_attr("adj_x" if i == 0 else "adj_y")
        if rank is None:
            return mixed(op, "multiplies a tensor of unknown rank")
        if r.axis < rank - 2:
            axes.append(r.axis + out_rank - rank)
        elif i == 0 and r.axis == rank - 2 + adj:
            axes.append(out_rank - 2)
        elif i == 1 and r.axis == rank - 1 - adj:
            axes.append(out_rank - 1)
        else:
            return mixed(op, "contracts the batch axis")
    data = _data(ins)
    if len(set(axes)) != 1 or len({r.order for _, r in data}) != 1:
        return mixed(op, "pairs the examples of two tensors")
    if len(data) == 2 and axes[0] >= out_rank - 2:
        return mixed(op, "multiplies two matrices computed from the batch")
    return dataclasses.replace(data[0][1], axis=axes[0])


def _einsum(op, ins):
    equation = op.get_attr("equation").decode().replace(" ", "")
    if "->" not in equation:
        return mixed(op, "has an implicit einsum output")
    subs, out = equation.split("->")
    subs = subs.split(",")
    letters = []
    for i, r in _data(ins):
        sub = subs[i]
        dots = sub.find("...")
        if dots != -1 and r.axis >= dots:
            return mixed(op, "puts the batch axis under an einsum ellipsis")
        letter = sub[r.axis]
        if letter not in out:
            return mixed(op, "sums over the batch axis")
        letters.append(letter)
    data = _data(ins)
    if len(set(letters)) != 1 or len({r.order for _, r in data}) != 1:
        return mixed(op, "pairs the examples of two tensors")
    out_axis = out.index(letters[0])
    if "..." in out and out.find("...") < out_axis:
        return mixed(op, "puts the batch axis after an einsum ellipsis")
    return dataclasses.replace(data[0][1], axis=out_axis)


def _conv(op, ins):
    data_index = 2 if op.type.endswith("BackpropInput") else 0
    r = ins[data_index]
    if r is None or len(_data(ins)) != 1:
        return mixed(op, "convolves with a filter computed from the batch")
    if r.axis != 0:
        return mixed(op, "convolves over the batch axis")
    for attr in ("strides", "ksize"):
        try:
            values = list(op.get_attr(attr))
        except ValueError:
            continue
        if values and values[0] != 1:
            return mixed(op, f"has {attr}[0] != 1 (works across examples)")
    return r


def _patches(op, ins):
    r = ins[0]
    if r.axis != 0 or list(op.get_attr("ksizes"))[0] != 1 or list(op.get_attr("strides"))[0] != 1:
        return mixed(op, "takes patches across examples")
    return r


def _space_to_batch(op, ins):
    r = ins[0]
    if r.axis != 0 or any(x is not None for x in ins[1:]):
        return mixed(op, "moves data-dependent blocks into the batch")
    return dataclasses.replace(r, depth=r.depth + 1, k=None)


def _batch_to_space(op, ins):
    r = ins[0]
    if r.axis != 0 or r.depth == 0:
        return mixed(op, "moves blocks of the batch into space")
    return dataclasses.replace(r, depth=r.depth - 1, k=None)


def _fused_batch_norm(op, ins):
    r = ins[0]
    if any(x is not None for x in ins[1:]):
        return mixed(op, "normalizes with statistics computed from the batch")
    if not op.get_attr("is_training"):
        return r
    fmt = op.get_attr("data_format").decode()
    channel = 1 if fmt.startswith("NC") else op.inputs[0].shape.rank - 1
    if r.axis != channel:
        return mixed(op, "normalizes with batch statistics (BatchNormalization in training)")
    # One channel per row: LayerNormalization's fused kernel on [1, B·T, D, 1].
    stats = dataclasses.replace(r, axis=0)
    return [r] + [stats] * (len(op.outputs) - 1)


def _image_transform(op, ins):
    """``ImageProjectiveTransformV2/V3`` (Keras's RandomTranslation, RandomRotation, RandomZoom ...): image j
    of the batch axis is warped by transform j (or by the one transform of a [1, 8] input); nothing
    crosses images. Data transforms must be row-paired with the images; shape and fill from data mix."""
    images, transforms = ins[0], ins[1]
    if images is None or images.axis != 0:
        return mixed(op, "transforms images with the batch on another axis than the first")
    if transforms is not None and (transforms.axis, transforms.k, transforms.order) != (0, images.k, images.order):
        return mixed(op, "pairs the images with transforms of other rows")
    if any(r is not None for r in ins[2:]):
        return mixed(op, "takes its output shape or fill value from the data")
    return images


def _call(op, ins):
    """Keras's grouped-convolution call (``_grouped.recognize``), tf_keras's LSTM/GRU function
    call (``_recurrent.recognize``), or any other call through its body (``_call_body``)."""
    rows = _grouped.rows_rule(op, ins, mixed)
    if rows is None:
        rows = _recurrent.rows_rule(op, ins, OPAQUE, mixed)
    return rows if rows is not None else _call_body(op, ins)


def _call_body(op, ins) -> list:
    """Rows of a call's outputs, from its function body (``_calls.body_graph``) analyzed with the
    same rules, the body's arguments having the rows of the call's inputs.

    A body that mixes the examples makes the outputs mixed (the reason names the op inside);
    a body the rules cannot see through (no body graph, a loop, a reshape checked only at run
    time, a data read of its own) makes them opaque.
    """
    n = len(op.outputs)
    found = _calls.body_graph(op)
    if found is None:
        return [OPAQUE] * n
    body, outputs = found
    seeds = {arg.ref(): r for arg, r in zip(body.inputs, ins) if r is not None}
    inner = _body_rows(body.get_operations(), seeds, {t.ref() for t in body.inputs})
    if inner is None:
        return [OPAQUE] * n
    return [_inside(inner.rows.get(t.ref()), op) for t in outputs]


def _body_rows(ops: list, seeds: dict, args: set) -> Optional["Analysis"]:
    """The rows of a graph's ``ops`` whose arguments (``args``, placeholders) have the rows of
    ``seeds``; None where the rules cannot see through it (a data read of its own, a reshape
    checked only at run time). A loop inside makes its outputs opaque."""
    inner = Analysis(dict(seeds), [], [])
    for body_op in ops:
        if body_op.type in _loops.WHILE_OPS:
            if any(inner.rows.get(t.ref()) is not None for t in body_op.inputs):
                for t in body_op.outputs:
                    inner.rows[t.ref()] = OPAQUE
            continue
        _visit(body_op, inner, args)
    return None if inner.sources or inner.reshapes else inner


def _identity_n(op, ins):
    """``tf.identity_n``, and the ``IdentityN`` of a ``tf.custom_gradient`` (silu/swish): its
    custom backward proven too (``_custom_gradients``)."""
    return _custom_gradients.rows_rule(op, ins, _body_rows, mixed, OPAQUE)


def _inside(r: Optional[Rows], call) -> Optional[Rows]:
    """``r`` of a call's body output, a mixing reason naming the call too."""
    if r is None or r.kind != "mixed":
        return r
    return dataclasses.replace(
        r, reason=f"{r.reason}, inside the function called by op {call.name!r} (layer {layer_scope(call)!r})"
    )


def _xent(op, ins):
    data = _data(ins)
    if any(r.axis != 0 for _, r in data) or len({r.order for _, r in data}) != 1:
        return mixed(op, "pairs logits and labels of different examples")
    return data[0][1]


# ----------------------------------------------------------------- ragged strings (TextVectorization)
# ``StringSplitV2`` splits a batch of strings [B] into the tokens of all examples, flat (``values``),
# with their (example, position) ``indices`` and the dense ``shape`` [B, longest]: kind "ragged", the
# values grouped by example through the split's row ids. Elementwise ops on the values (a vocabulary
# lookup, comparisons with constants) keep the grouping; ``RaggedTensorToTensor`` whose row partition
# is exactly that split's (its row count and the row ids ``indices[:, 0]``) puts example i's tokens in
# row i of a [B, T] tensor: rows again, provided T is static (``output_sequence_length``). With T
# unknown the rows are padded to the longest example of the batch: each example's tensor then depends
# on the others (refused as mixing). Anything else that reads ragged values is opaque.
# String ops applied to each string alone (TextVectorization's standardization); the pattern, rewrite
# and other operands after the first must be constants.
_STRING_ELEMENTWISE = frozenset({"StringLower", "StringUpper", "StringStrip", "StaticRegexReplace", "RegexReplace"})
_RAGGED_ELEMENTWISE = (_UNARY - _IMAGE_AXIS0_OPS) | (_ELEMENTWISE - {"BroadcastTo"}) | {"LookupTableFindV2"}


def _string_elementwise(op, ins):
    data = _data(ins)
    return data[0][1] if [i for i, _ in data] == [0] else OPAQUE


def _string_split(op, ins):
    ((i, r),) = _data(ins)
    if i != 0 or not r.clean or op.inputs[0].shape.rank != 1:
        return OPAQUE
    return Rows(kind="ragged", k=None, partition=op.name)


def _is_slice(t, source, begin, end, strides, shrink, end_mask=0) -> bool:
    """Whether ``t`` is ``source[begin:end:strides]`` with exactly these masks (static)."""
    op = t.op
    if op.type != "StridedSlice" or op.inputs[0] is not source:
        return False
    got = [_static(x) for x in op.inputs[1:4]]
    if any(g is None for g in got) or [list(g) for g in got] != [begin, end, strides]:
        return False
    masks = {m: op.get_attr(m) for m in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask")}
    return (
        op.get_attr("shrink_axis_mask") == shrink
        and masks["end_mask"] == end_mask
        and not (masks["ellipsis_mask"] or masks["new_axis_mask"] or masks["begin_mask"] & ~1)
    )


def _ragged_to_tensor(op, ins):
    """``RaggedTensorToTensor`` of values grouped by one split's row ids, to a static length (see above)."""
    values = ins[1]
    if values is None or values.kind != "ragged" or any(r is not None for r in ins[:1] + ins[2:3]):
        return OPAQUE
    types = [t.decode() if isinstance(t, bytes) else t for t in op.get_attr("row_partition_types")]
    split = op.graph.get_operation_by_name(values.partition)
    if types != ["FIRST_DIM_SIZE", "VALUE_ROWIDS"] or op.inputs[2].shape.rank != 0:
        return OPAQUE
    nrows, rowids = op.inputs[3], op.inputs[4]
    if not (
        _is_slice(nrows, split.outputs[2], [0], [1], [1], shrink=1)
        and _is_slice(rowids, split.outputs[0], [0, 0], [0, 1], [1, 1], shrink=2, end_mask=1)
    ):
        return OPAQUE
    shape = _static(op.inputs[0])
    if shape is None or shape.shape != (2,) or int(shape[0]) != -1:
        return OPAQUE
    if int(shape[1]) < 0:
        return mixed(op, "pads every example to the longest one of the batch (give a static output_sequence_length)")
    return Rows()


def _ragged(op, ins) -> list:
    """Rows of the outputs of an op reading ragged values (see above)."""
    n = len(op.outputs)
    if op.type == "RaggedTensorToTensor":
        return [_ragged_to_tensor(op, ins)] * n
    data = _data(ins)
    partitions = {r.partition for _, r in data}
    same = all(r.kind == "ragged" for _, r in data) and len(partitions) == 1
    # Elementwise over the flat values, with constants (scalars) as the only other operands.
    scalars = all(r is not None or t.shape.rank == 0 for t, r in zip(op.inputs, ins))
    if op.type in _RAGGED_ELEMENTWISE and same and scalars and n == 1:
        if all(op.inputs[i].shape.rank == 1 for i, _ in data) and op.outputs[0].shape.rank == 1:
            return [data[0][1]]
    return [OPAQUE] * n


_RULES = {
    **{name: _unary for name in _UNARY},
    **{name: _elementwise for name in _ELEMENTWISE},
    **{name: _reduction for name in _REDUCTIONS},
    "Softmax": _softmax,
    "LogSoftmax": _softmax,
    "ArgMax": _arg_reduction,
    "ArgMin": _arg_reduction,
    "Cumsum": _cumulative,
    "Cumprod": _cumulative,
    "CumulativeLogsumexp": _cumulative,
    "TopKV2": _top_k,
    "Transpose": _transpose,
    "ExpandDims": _expand_dims,
    "Squeeze": _squeeze,
    "Reshape": _reshape,
    "StridedSlice": _strided_slice,
    "Slice": _slice,
    "ConcatV2": _concat,
    "Pack": _pack,
    "Unpack": _unpack,
    "Split": _split,
    "SplitV": _split,
    "Tile": _tile,
    "Pad": _pad,
    "PadV2": _pad,
    "MirrorPad": _pad,
    "ReverseV2": _reverse_or_roll,
    "Roll": _reverse_or_roll,
    "GatherV2": _gather,
    "Gather": _gather,
    "ResourceGather": _resource_gather,
    "OneHot": _one_hot,
    "MatMul": _matmul,
    "BatchMatMul": _batch_matmul,
    "BatchMatMulV2": _batch_matmul,
    "BatchMatMulV3": _batch_matmul,
    "Einsum": _einsum,
    "Conv2D": _conv,
    "Conv3D": _conv,
    "DepthwiseConv2dNative": _conv,
    "Conv2DBackpropInput": _conv,
    "MaxPool": _conv,
    "AvgPool": _conv,
    "MaxPool3D": _conv,
    "AvgPool3D": _conv,
    "ExtractImagePatches": _patches,
    "SpaceToBatchND": _space_to_batch,
    "BatchToSpaceND": _batch_to_space,
    "FusedBatchNorm": _fused_batch_norm,
    "FusedBatchNormV2": _fused_batch_norm,
    "FusedBatchNormV3": _fused_batch_norm,
    "SparseSoftmaxCrossEntropyWithLogits": _xent,
    "SoftmaxCrossEntropyWithLogits": _xent,
    "ImageProjectiveTransformV2": _image_transform,
    "ImageProjectiveTransformV3": _image_transform,
    "PartitionedCall": _call,
    "StatefulPartitionedCall": _call,
    "IdentityN": _identity_n,
    **{name: _string_elementwise for name in _STRING_ELEMENTWISE},
}
# Ops whose data inputs are paired row by row: rows of two different orders must not meet.
_PAIRING = _ELEMENTWISE | {
    "ConcatV2",
    "Pack",
    "MatMul",
    "BatchMatMul",
    "BatchMatMulV2",
    "BatchMatMulV3",
    "Einsum",
    "GatherV2",
    "SparseSoftmaxCrossEntropyWithLogits",
    "SoftmaxCrossEntropyWithLogits",
}
# Ops that keep the relative order of rows along the batch axis (a reordered tensor may pass).
_ROW_WISE = (
    _UNARY
    | _STRING_ELEMENTWISE
    | _ELEMENTWISE
    | _REDUCTIONS
    | {
        "Softmax",
        "LogSoftmax",
        "ArgMax",
        "ArgMin",
        "Cumsum",
        "Cumprod",
        "CumulativeLogsumexp",
        "TopKV2",
        "Transpose",
        "ExpandDims",
        "Squeeze",
        "StridedSlice",
        "Slice",
        "ConcatV2",
        "Pack",
        "Split",
        "SplitV",
        "Tile",
        "Pad",
        "PadV2",
        "MirrorPad",
        "ReverseV2",
        "Roll",
        "GatherV2",
        "Gather",
        "ResourceGather",
        "OneHot",
        "MatMul",
        "BatchMatMulV2",
        "BatchMatMulV3",
        "Einsum",
        "Conv2D",
        "Conv3D",
        "DepthwiseConv2dNative",
        "Conv2DBackpropInput",
        "MaxPool",
        "AvgPool",
        "MaxPool3D",
        "AvgPool3D",
        "ExtractImagePatches",
        "SparseSoftmaxCrossEntropyWithLogits",
        "SoftmaxCrossEntropyWithLogits",
        "Reshape",
    }
)


def _propagate(op, ins) -> list:
    """Rows of each output of ``op`` given those of its inputs (None: not data)."""
    n = len(op.outputs)
    data = _data(ins)
    if op.type == "StringSplitV2" and data and all(r.kind == "rows" for _, r in data):
        return [_string_split(op, ins)] * n
    if any(r.kind == "ragged" for _, r in data) and not any(r.kind == "mixed" for _, r in data):
        return _ragged(op, ins)
    for _, r in data:
        if r.kind == "mixed":
            return [r] * n
    if any(r.kind == "opaque" for _, r in data):
        return [OPAQUE] * n
    orders = {r.order for _, r in data}
    if len(orders) > 1 and op.type in _PAIRING:
        return [mixed(op, "pairs rows of tensors whose examples are in different orders")] * n
    rule = _RULES.get(op.type)
    if rule is None or (orders != {None} and op.type not in _ROW_WISE):
        return [OPAQUE] * n
    out = rule(op, ins)
    out = out if isinstance(out, list) else [out] * n
    return out


def is_source(op, captured: set) -> bool:
    """An input of the step: a placeholder argument (not a capture), an iterator output, or
    tf.distribute's choice between iterator outputs (:func:`is_element_choice`)."""
    if op.type in _IFS:
        return is_element_choice(op)
    if op.type not in _SOURCES:
        return False
    if op.type == "Placeholder":
        t = op.outputs[0]
        return t.dtype != tf.resource and t.ref() not in captured and t.shape.rank != 0
    return True


_IFS = frozenset({"If", "StatelessIf"})
_ELEMENTS = frozenset({"IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue"})


def is_element_choice(op) -> bool:
    """Whether the ``If`` op ``op`` returns, whichever branch runs, components of the elements of
    input iterators (or empty batches): then each of its outputs is batch-major, like an iterator's.

    tf.distribute reads a MultiWorkerMirroredStrategy step's batch so (``input_lib``'s partial
    batch handling): ``cond(any worker has data, [cond(has_value, optional.get_value(), dummy)
    for each local replica], iterator.get_next())``, where a dummy has 0 rows. Recognized: in
    every branch (nested ``If`` ops included), every output is, through ``Identity`` ops, an
    output of an iterator read (``IteratorGetNext``, ``OptionalGetValue``), or a tensor with no
    rows (static size 0 on axis 0). Anything else is not a source (its outputs stay unknown to
    the analysis, and the step takes the reference path).
    """
    if op.type not in _IFS:
        return False
    branches = [getattr(op, name, None) for name in ("_true_graph", "_false_graph")]
    return all(b is not None and all(_element_or_empty(t) for t in b.outputs) for b in branches)


def _element_or_empty(t: tf.Tensor) -> bool:
    """``t`` is an output of an iterator read (through ``Identity`` ops), or has no rows."""
    while t.op.type == "Identity":
        t = t.op.inputs[0]
    if t.shape.rank is None or t.shape.rank == 0:
        return False
    if t.shape[0] == 0:
        return True  # The dummy of a replica without data: no rows, no example.
    return t.op.type in _ELEMENTS or is_element_choice(t.op)


@dataclasses.dataclass
class Analysis:
    rows: dict  # tensor ref -> Rows (data tensors only)
    sources: list  # the step's data inputs upstream of the loss
    reshapes: list  # (tensor, axis) whose rows are checked at run time

    def clean(self, t) -> bool:
        r = self.rows.get(t.ref())
        return r is not None and r.clean


def propagate(ops: list, captured: set, inputs: frozenset = frozenset()) -> Analysis:
    """Forward propagation of :class:`Rows` over ``ops`` (in creation order). `inputs`: refs of op outputs
    that are inputs of the step too (an eager loss callable's batch: ``eager_loss.eager_batch``)."""
    analysis = Analysis({}, [], [])
    for op in ops:
        if inputs and op.outputs and op.outputs[0].ref() in inputs:
            rows_of = analysis.rows
            rows_of[op.outputs[0].ref()] = Rows()
            analysis.sources.append(op.outputs[0])
            continue
        _visit(op, analysis, captured)
    return analysis


def _batch_of_zeros(op, analysis: Analysis) -> Optional[Rows]:
    """The rows of ``tf.zeros([batch_size, ...])`` (else None): a Fill of 0 whose first axis is
    that of a batch-major data tensor ``x`` (``tf.shape(x)[0]``: ``x``'s rows), or zeros whose
    first axis is the inputs' static batch size (one row per example).

    Its rows are zeros whichever example owns them, so ghost norms may pair them with examples.
    """
    if op.type not in ("Fill", "Const") or op.outputs[0].dtype not in (tf.float16, tf.bfloat16, tf.float32, tf.float64):
        return None
    out, batch = op.outputs[0], {s.shape[0] for s in analysis.sources}
    if out.shape.rank is None or out.shape.rank < 2:
        # A state is [batch, units]; a rank-1 vector of batch size is not one (tf_keras's fused
        # LayerNormalization folds the batch into FusedBatchNorm's channels with zero offsets).
        return None
    if out.shape[0] is not None and batch == {out.shape[0]}:
        layout = Rows()
    else:
        layout = _batch_sized(op.inputs[0], analysis) if op.type == "Fill" else None
    if layout is None:
        return None
    value = _static(op.inputs[1] if op.type == "Fill" else out)
    return layout if value is not None and not np.any(value) else None


def _tiled_weight(op, analysis: Analysis) -> Optional[Rows]:
    """The rows of ``tf.tile(w, [..., tf.shape(x)[0], ...])`` (else None): ``w`` no data but computed from a
    weight, with a size-1 axis tiled by the rows of a batch-major data tensor ``x`` (or by the inputs' static batch
    size), the only such axis.

    Row j along that axis is a copy of ``w`` that the example owning row j of ``x`` reads: ViT's class token
    (``keras.ops.tile(class_token, (B, 1, 1))``), DeBERTa-v3's normalized relative-position table
    (``keras.ops.repeat(table, B, axis=0)``: an ExpandDims, a Tile along the new axis, a Reshape). Tracked as that
    example's row, so that a later op mixing the copies of different examples is seen (and the weight's per-example
    gradient is the gradient of its own copy, ``handlers``). A tiled constant stays no data.
    """
    if op.type != "Tile" or analysis.rows.get(op.inputs[0].ref()) is not None:
        return None
    w = op.inputs[0]
    if w.shape.rank is None or w.shape.rank < 1 or not w.dtype.is_floating or not reads_a_variable(w):
        return None
    batch = {s.shape[0] for s in analysis.sources}
    found = []
    for axis in range(w.shape.rank):
        if w.shape[axis] != 1:
            continue
        entry = static_entry(op.inputs[1], axis)
        if entry is not None:
            rows = Rows() if len(batch) == 1 and None not in batch and int(entry) == next(iter(batch)) else None
        else:
            rows = _batch_sized(op.inputs[1], analysis, axis)
        if rows is not None:
            found.append(dataclasses.replace(rows, axis=axis))
    return found[0] if len(found) == 1 else None


def reads_a_variable(t: tf.Tensor, limit: int = 256) -> bool:
    """Whether ``t`` is computed from the value of a float variable (a ``ReadVariableOp`` upstream, at most
    ``limit`` ops away)."""
    seen, stack = {t.op}, [t.op]
    while stack and len(seen) <= limit:
        op = stack.pop()
        if op.type == "ReadVariableOp" and op.outputs[0].dtype.is_floating:
            return True
        for i in op.inputs:
            if i.op not in seen and i.dtype != tf.resource:
                seen.add(i.op)
                stack.append(i.op)
    return False


def _batch_sized(dims: tf.Tensor, analysis: Analysis, index: int = 0) -> Optional[Rows]:
    """The rows of ``x`` if ``dims[index]`` is ``tf.shape(x)[0]`` for a batch-major data tensor ``x`` (``dims`` a
    ``Pack``; the entry possibly reshaped to a scalar or cast, as ``tf.repeat`` does)."""
    if dims.op.type != "Pack" or len(dims.op.inputs) <= index or dims.op.get_attr("axis") != 0:
        return None
    first = dims.op.inputs[index].op
    while first.type in ("Reshape", "Identity", "Cast") and first.inputs[0].shape.num_elements() == 1:
        first = first.inputs[0].op
    if first.type != "StridedSlice" or first.inputs[0].op.type != "Shape":
        return None
    begin, end, strides = (_static(t) for t in first.inputs[1:4])
    if begin is None or list(begin) != [0] or list(strides) != [1] or first.get_attr("shrink_axis_mask") != 1:
        return None
    x = first.inputs[0].op.inputs[0]
    return Rows(k=analysis.rows[x.ref()].k) if analysis.clean(x) else None


def _visit(op, analysis: Analysis, captured: set) -> None:
    """Rows of the outputs of ``op`` (a source, a ``while`` loop, or a rule of ``_RULES``)."""
    rows = analysis.rows
    if is_source(op, captured):
        for t in op.outputs:
            if t.dtype != tf.resource and t.shape.rank != 0:
                rows[t.ref()] = Rows()
                analysis.sources.append(t)
        return
    zeros = _batch_of_zeros(op, analysis)
    if zeros is not None:
        rows[op.outputs[0].ref()] = zeros  # Zero rows per example (a recurrence's initial state).
        return
    tiled = _tiled_weight(op, analysis)
    if tiled is not None:
        rows[op.outputs[0].ref()] = tiled  # A weight's copy per row of the batch (ViT's class token).
        return
    ins = [rows.get(t.ref()) for t in op.inputs]
    if op.type in _NO_DATA or all(r is None for r in ins):
        return
    loop = _loops.unrolled(op) if op.type in _loops.WHILE_OPS else None
    if loop is not None:
        # The loop's outputs have the rows of its unrolled copy (the same ops, step by step).
        for copied in loop.ops:
            _visit(copied, analysis, captured)
        for original, copy in zip(loop.originals, loop.copies):
            if rows.get(copy.ref()) is not None:
                rows[original.ref()] = rows[copy.ref()]
        return
    for t, r in zip(op.outputs, _propagate(op, ins)):
        if r is None:
            continue  # Not data (an IdentityN output of a non-data input).
        rows[t.ref()] = r
        if op.type == "Reshape" and r.kind == "rows" and r.k is None and r.depth == 0:
            analysis.reshapes.append((t, r.axis))

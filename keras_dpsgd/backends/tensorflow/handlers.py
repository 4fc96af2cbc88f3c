"""Per-example rules: how one use of a variable turns ∂L/∂(op output) into a per-example use.

The contract of a rule (``register_rule`` adds one, keyed by op type):

    rule(op, index, w, var, clean, static_batch) -> Site | None

* ``op``: the op that uses the variable, ``op.inputs[index] is w``; ``w`` is the variable's
  value (after ReadVariableOp and value-preserving reshapes/casts), or its resource handle for an
  op that reads the variable itself (ResourceGather);
* ``var``: the ``tf.Variable``; ``clean``: the ``_rows.Analysis`` of the step (``clean.clean(t)``:
  ``t`` is proven batch-major, example ``i`` owns a contiguous block of rows); ``static_batch``:
  the batch size if known at trace time.
* It returns None when it does not recognize the use (then the variable gets exact per-example
  jacobians: a rule may decline, it must never guess), else a :class:`Site` (or a list of them,
  one per use inside the op: a ``while`` loop's unrolled copy): the op output(s)
  ``y`` whose gradient ∂(Σ_i ℓ_i)/∂y the backend computes (row ``i`` of it is ∂ℓ_i/∂y), and
  ``make(grad, batch)`` turning that gradient into one *use* of ``_uses`` (``OuterUse``: the
  per-example gradient is ``A_iᵀ G_i``; ``IndexUse``: rows of a table; ``DenseUse`` or
  ``PiecesUse``: the per-example gradient itself, [B, *var.shape]). ``through`` (optional) lets
  ``y`` live in a recomputed copy of the op (see :class:`Site`). From the uses the backend gets
  the per-example squared norms ``‖∂ℓ_i/∂var‖²`` and, once clipped, the sum
  ``Σ_i c_i ∂ℓ_i/∂var`` (ghost norms and book-keeping, ``_uses``).

A rule must be exact: its use, summed with the variable's other uses, is ∂ℓ_i/∂var for every
example ``i``. Where the op's attributes allow something it does not handle, it returns None.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from keras_dpsgd.backends.tensorflow import _checks, _conv, _grouped, _loops, _recurrent, _rows, uses as _uses
from keras_dpsgd.dp.refusals import refusal_message

MakeUse = Callable[..., object]

# The graph walk (``_graph.find_sites``: every use of a variable on the way to the loss, each by its rule), which a
# rule that looks through an op (a loop's body, a weight-only op: ``_derived``) continues from that op's output.
# ``_graph`` calls the rules and sets it when it is imported: the walk calls the rules, the rules call the walk.
_WALKER: list[Callable[..., object]] = []


def set_walker(find_sites: Callable[..., object]) -> None:
    """Sets the graph walk that :func:`walk_sites` continues (``_graph.find_sites``)."""
    _WALKER[:] = [find_sites]


def walk_sites(*args, **kwargs):
    """``_graph.find_sites(handles, var, ops, clean, static_batch, stopped=None)``, from a rule."""
    return _WALKER[0](*args, **kwargs)


@dataclasses.dataclass
class Site:
    """One use of a variable: output ``y`` of the using op and how to turn ∂L/∂y into a use.

    ``y`` may be a tuple of tensors (an op with several outputs the loss may depend on); ``make``
    then receives the tuple of their gradients.
    """

    y: object  # tf.Tensor or tuple of tf.Tensor
    make: MakeUse  # (grad wrt y, batch size) -> OuterUse | IndexUse | DenseUse | PiecesUse
    # Optional (originals, copies): the op's outputs and a recomputation of them from the op's
    # inputs (same function) in which ``y`` lives; gradients are backpropagated through the copies
    # instead of the op (the recurrent rule: ``y`` are the pre-activations of each time step).
    through: Optional[tuple] = None


Rule = Callable[..., Optional[Site]]
_RULES: dict[str, Rule] = {}


def register_rule(*op_types: str) -> Callable[[Rule], Rule]:
    """Decorator: ``rule`` is the per-example rule of ops of these types (see the module doc).

    Raises:
      ValueError: no op type given, or one already has a rule (one rule per op type).
    """
    if not op_types:
        raise ValueError("register_rule needs at least one op type, got none")

    def register(rule: Rule) -> Rule:
        for op_type in op_types:
            if op_type in _RULES:
                raise ValueError(f"op type {op_type!r} already has the per-example rule {_RULES[op_type].__name__}")
            _RULES[op_type] = rule
        return rule

    return register


def rule_for(op_type: str) -> Optional[Rule]:
    """The registered per-example rule of ``op_type``, or None."""
    return _RULES.get(op_type)


def _batch_major(t: tf.Tensor, static_batch) -> bool:
    if t.shape.rank is None or t.shape.rank < 1:
        return False
    n = t.shape[0]
    return n is None or static_batch is None or (static_batch > 0 and n % static_batch == 0)


def group_rows(t: tf.Tensor, batch: tf.Tensor, rest: int) -> tf.Tensor:
    """[N, *dims] with N = B·T (batch-major) and prod(dims) = rest -> [B, T, rest]."""
    n = tf.shape(t)[0]
    steps = n // tf.maximum(batch, 1)
    return tf.reshape(t, tf.stack([batch, steps, rest]))


def _to_var_shape(p: tf.Tensor, var) -> tf.Tensor:
    """[B, *w'.shape] -> [B, *var.shape] (w' is a reshape of the variable; a stand-in whose static shape is not
    fully known, ``_weight_region``'s exits, gives its shape as ``dynamic_shape``)."""
    return _uses.with_rows(p, var.shape if var.shape.is_fully_defined() else var.dynamic_shape)


def _f32(t: tf.Tensor) -> tf.Tensor:
    return t if t.dtype == tf.float32 else tf.cast(t, tf.float32)


@register_rule("MatMul")
def _matmul(op, index, w, var, clean, static_batch):
    """y = a @ w (Dense on 2-D inputs; on [B, T, D] through tf.tensordot's reshape)."""
    if index != 1 or op.get_attr("transpose_a"):
        return None
    a, y = op.inputs[0], op.outputs[0]
    if not clean.clean(a) or a.shape.rank != 2 or not _batch_major(a, static_batch):
        return None
    transposed = op.get_attr("transpose_b")
    if w.shape.rank != 2:
        return None
    d, u = (int(w.shape[1]), int(w.shape[0])) if transposed else (int(w.shape[0]), int(w.shape[1]))

    def make(g, batch):
        a3, g3 = group_rows(_f32(a), batch, d), group_rows(_f32(g), batch, u)
        return _uses.OuterUse(g3, a3) if transposed else _uses.OuterUse(a3, g3)

    return Site(y, make)


@register_rule("BatchMatMulV2", "BatchMatMulV3")
def _batch_matmul(op, index, w, var, clean, static_batch):
    """y = x @ w with x of shape [B, ..., D] and a 2-D weight broadcast over the batch."""
    if index != 1 or w.shape.rank != 2 or op.get_attr("adj_x"):
        return None
    x, y = op.inputs[0], op.outputs[0]
    if not clean.clean(x) or x.shape.rank is None or x.shape.rank < 3:
        return None
    if not _batch_major(x, static_batch):
        return None
    adjoint = op.get_attr("adj_y")
    d = int(x.shape[-1])

    def make(g, batch):
        a3 = tf.reshape(_f32(x), tf.stack([batch, -1, d]))
        g3 = tf.reshape(_f32(g), tf.stack([batch, -1, int(g.shape[-1])]))
        return _uses.OuterUse(g3, a3) if adjoint else _uses.OuterUse(a3, g3)

    return Site(y, make)


def _conv_geometry(op, index, w):
    """(x, y, strides, rates, padding) of an NHWC convolution using kernel ``w``, or None."""
    if index != 1 or op.get_attr("data_format") != b"NHWC":
        return None
    padding = op.get_attr("padding").decode()
    strides, rates = list(op.get_attr("strides")), list(op.get_attr("dilations"))
    x, y = op.inputs[0], op.outputs[0]
    if padding not in ("SAME", "VALID") or strides[0] != 1 or strides[3] != 1:
        return None
    if rates[0] != 1 or rates[3] != 1 or w.shape.rank != 4 or x.shape.rank != 4:
        return None
    return x, y, strides, rates, padding


def _blocks(x: tf.Tensor, clean, static_batch) -> Optional[int]:
    """How many blocks of each example the convolution input ``x`` holds along its batch axis.

    1 for a batch-major ``x``; ``prod(block_shape)`` for ``x = SpaceToBatchND(x0, ...)`` (or its
    ExpandDims) of a batch-major ``x0`` (a dilated convolution: row ``j·B + i`` is block ``j`` of
    example ``i``); else None.
    """
    if clean.clean(x):
        return 1 if _batch_major(x, static_batch) else None
    while x.op.type == "ExpandDims" and tf.get_static_value(x.op.inputs[1]) not in (None, 0):
        x = x.op.inputs[0]  # Conv1D: ExpandDims(SpaceToBatchND(x0)), the batch axis unchanged.
    x0 = x.op.inputs[0] if x.op.type == "SpaceToBatchND" else None
    if x0 is None or not clean.clean(x0) or not _batch_major(x0, static_batch):
        return None
    block = tf.get_static_value(x.op.inputs[1])
    return None if block is None else int(np.prod(block))


def _by_example(t: tf.Tensor, blocks: int, batch) -> tf.Tensor:
    """[blocks·B·k, P, K] (rows block-major, then example-major) -> [B, blocks·k·P, K]: each
    example's rows of every block as positions."""
    k = int(t.shape[2])
    t4 = tf.reshape(t, tf.stack([blocks, batch, -1, k]))
    return tf.reshape(tf.transpose(t4, [1, 0, 2, 3]), tf.stack([batch, -1, k]))


def _per_example(parts: list, blocks: int, x: tf.Tensor, static_batch, batch) -> list:
    """Per-row kernel gradients [rows, ...] as per-example ones [B, ...]: as they are where each
    example is one row of ``x`` (statically known), else summed over each example's rows (several
    blocks, or k rows per example: a reshape [B, T, ...] -> [B·T, ...], the K views of augmentation multiplicity)."""
    if blocks == 1 and static_batch is not None and x.shape[0] == static_batch:
        return parts
    return _summed_blocks(parts, blocks, batch)


def _summed_blocks(parts: list, blocks: int, batch) -> list:
    """Per-row gradients [blocks·B·k, ...] summed over each example's rows of every block."""
    summed = []
    for q in parts:
        rows = tf.reduce_sum(tf.reshape(q, tf.stack([blocks, batch, -1, tf.size(q) // tf.shape(q)[0]])), axis=[0, 2])
        summed.append(tf.reshape(rows, tf.concat([[batch], tf.shape(q)[1:]], axis=0)))
    return summed


@register_rule("Conv2D")
def _conv2d(op, index, w, var, clean, static_batch):
    """Conv2D (and Conv1D, which is Conv2D on ExpandDims), dilated ones too (TensorFlow runs
    them on the SpaceToBatchND blocks of the input: each example's blocks are summed).

    Mixed ghost norm by shape: ghost norms over im2col patches when the output has few positions,
    else per-example kernel gradients from input slices (``_conv``).
    """
    geometry = _conv_geometry(op, index, w)
    if geometry is None:
        return None
    x, y, strides, rates, padding = geometry
    kh, kw, cin, cout = (int(s) for s in w.shape)
    blocks = _blocks(x, clean, static_batch)
    if x.shape[3] != cin or blocks is None:  # A grouped conv (cin < channels): the reference path refuses it.
        return None

    positions = int(y.shape[1]) * int(y.shape[2]) * blocks if _conv.geometry_known(x, y) else None
    if positions is not None and not _uses.ghost_preferred(positions, kh * kw * cin, cout):
        # Mixed ghost norm (Bu et al. 2023): materializing is cheaper for this shape; slices
        # of the input give the per-example kernel gradients without im2col patches.
        def make_dense(g, batch):
            parts = _conv.per_example_kernel_grads(_f32(x), _f32(g), (kh, kw), strides, rates, padding)
            return _uses.PiecesUse(_per_example(parts, blocks, x, static_batch, batch))

        return Site(y, make_dense)

    def make(g, batch):
        patches = tf.image.extract_patches(_f32(x), sizes=[1, kh, kw, 1], strides=strides, rates=rates, padding=padding)
        if blocks == 1:
            a3 = tf.reshape(patches, tf.stack([batch, -1, kh * kw * cin]))
            return _uses.OuterUse(a3, tf.reshape(_f32(g), tf.stack([batch, -1, cout])))
        a3 = tf.reshape(patches, tf.concat([tf.shape(patches)[:1], [-1, kh * kw * cin]], axis=0))
        g3 = tf.reshape(_f32(g), tf.concat([tf.shape(g)[:1], [-1, cout]], axis=0))
        return _uses.OuterUse(_by_example(a3, blocks, batch), _by_example(g3, blocks, batch))

    return Site(y, make)


@register_rule("Tile")
def _tiled_weight(op, index, w, var, clean, static_batch):
    """``tf.tile(w, [m_0, ..., m_k])`` of a weight (or of a tensor computed from weights alone) tiled along a size-1
    axis by the batch: ViT's class token (``keras.ops.tile(class_token, (B, 1, 1))``), DeBERTa-v3's relative-position
    table (``keras.ops.repeat``: the Tile along a new axis 1). The row analysis proves each copy along that axis is
    read by one example (``_rows._tiled_weight``): example i's gradient is its copies' output gradient summed over
    its copies and over the copies along the other axes (exact, materialized: [B, *var.shape])."""
    y = op.outputs[0]
    rows = clean.rows.get(y.ref())
    if index != 0 or rows is None or rows.kind != "rows" or rows.order is not None or rows.depth != 0:
        return None
    axis = rows.axis
    if not w.shape.is_fully_defined() or not 0 <= axis < w.shape.rank or w.shape[axis] != 1:
        return None
    others = [k for k in range(w.shape.rank) if k != axis]
    reps = [_rows.static_entry(op.inputs[1], k) for k in others]
    if any(m is None for m in reps):
        return None
    sizes = [int(w.shape[k]) for k in others]

    def make(g, batch):
        g = tf.transpose(_f32(g), [axis] + others)  # the copies along the batch axis first
        split = [d for m, s in zip(reps, sizes) for d in (int(m), s)]  # each other axis as (copies, w's size)
        g = tf.reshape(g, tf.concat([tf.stack([batch, -1]), tf.constant(split, tf.int32)], axis=0))
        p = tf.reduce_sum(g, axis=[1] + [2 + 2 * k for k in range(len(sizes))])  # [B, *w.shape without the axis]
        return _uses.DenseUse(tf.reshape(p, tf.concat([tf.stack([batch]), var.shape.as_list()], axis=0)))

    return Site(y, make)


@register_rule("DepthwiseConv2dNative")
def _depthwise_conv2d(op, index, w, var, clean, static_batch):
    """DepthwiseConv2D (and the depthwise half of SeparableConv2D): per-example kernel gradients
    from slices of the input, per channel (``_conv.per_example_depthwise_grads``)."""
    geometry = _conv_geometry(op, index, w)
    if geometry is None:
        return None
    x, y, strides, rates, padding = geometry
    kh, kw, cin, mult = (int(s) for s in w.shape)
    if x.shape[3] != cin or y.shape[3] != cin * mult or not _conv.geometry_known(x, y):
        return None
    blocks = _blocks(x, clean, static_batch)
    if blocks is None:
        return None

    def make(g, batch):
        parts = _conv.per_example_depthwise_grads(_f32(x), _f32(g), (kh, kw), strides, rates, padding)
        return _uses.PiecesUse(_per_example(parts, blocks, x, static_batch, batch))

    return Site(y, make)


def _index_site(ids, y, var, vocab_dim):
    def make(g, batch):
        ids2 = tf.reshape(ids, tf.stack([batch, -1]))
        g3 = tf.reshape(_f32(g), tf.stack([batch, -1, vocab_dim]))
        return _uses.IndexUse(ids2, g3, int(var.shape[0]))

    return Site(y, make)


@register_rule("ResourceGather")
def _resource_gather(op, index, w, var, clean, static_batch):
    """ResourceGather on the handle ``w``: an Embedding lookup (rows of a [V, D] table)."""
    if op.type != "ResourceGather" or index != 0 or op.get_attr("batch_dims") != 0:
        return None
    if var.shape.rank != 2:
        return None
    ids, y = op.inputs[1], op.outputs[0]
    if not clean.clean(ids) or not _batch_major(ids, static_batch):
        return None
    return _index_site(ids, y, var, int(var.shape[1]))


@register_rule("GatherV2")
def _gather_v2(op, index, w, var, clean, static_batch):
    """GatherV2 on the variable's value along axis 0 (tf.gather(table, ids))."""
    if index != 0 or op.get_attr("batch_dims") != 0 or w.shape.rank != 2:
        return None
    axis = tf.get_static_value(op.inputs[2])
    ids, y = op.inputs[1], op.outputs[0]
    if axis is None or int(axis) != 0 or not clean.clean(ids):
        return None
    if not _batch_major(ids, static_batch) or var.shape.num_elements() != w.shape.num_elements():
        return None
    return _index_site(ids, y, var, int(w.shape[1]))


@register_rule("BiasAdd", "Add", "AddV2", "Sub", "Mul")
def _elementwise(op, index, w, var, clean, static_batch):
    """Bias adds and scales: y = x + w, x - w, w - x, x * w (LayerNormalization γ and β).

    The per-example gradient is ∂ℓ_i/∂y (times x for a product) summed over the axes along which
    ``w`` is broadcast, so it is materialized ([B, *w.shape], as small as the variable).
    """
    y = op.outputs[0]
    other = op.inputs[1 - index]
    if op.type == "BiasAdd":
        if index != 1 or op.get_attr("data_format") != b"NHWC":
            return None
    y_rank, w_rank = y.shape.rank, w.shape.rank
    if y_rank is None or w_rank is None or y_rank < 1 or w_rank > y_rank:
        return None
    if w_rank == y_rank and w.shape[0] != 1:
        return None  # w is not broadcast over axis 0: y's rows are not examples.
    if not clean.clean(y) or not _batch_major(y, static_batch):
        return None
    if op.type == "BiasAdd":
        w_shape = [1] * (y_rank - 1) + [w.shape[0]]
    else:
        w_shape = [1] * (y_rank - w_rank) + list(w.shape)
    # A size unknown at trace time (a relative-position bias's key length) is taken as y's, checked at run time.
    unknown = [k for k in range(1, y_rank) if w_shape[k] is None]
    if w_shape[0] is None:
        return None
    axes = [k for k in range(1, y_rank) if w_shape[k] == 1]
    sign = -1.0 if op.type == "Sub" and index == 1 else 1.0

    def make(g, batch):
        p = _f32(g) * _f32(other) if op.type == "Mul" else _f32(g)
        # One axis at a time: a conv's bias ([B, H, W, C] over H and W) is 2x faster on CPU than both at once.
        for k in axes:
            p = tf.reduce_sum(p, axis=k, keepdims=True)
        p = tf.reshape(p, tf.concat([tf.stack([batch, -1]), tf.shape(p)[1:]], axis=0))  # [B, rows, *w's sizes]
        p = tf.reduce_sum(p, axis=1)
        if sign < 0:
            p = -p
        if unknown:
            lead = y_rank - w.shape.rank
            same = [tf.equal(tf.shape(w)[k - lead], tf.shape(y)[k]) for k in unknown]
            message = refusal_message(
                "per-example-check",
                f"keras_dpsgd: op {op.name!r} broadcasts a weight along an axis whose size was unknown when the step "
                "was traced, which its per-example rule took whole",
            )
            with tf.control_dependencies(_checks.check(tf.reduce_all(tf.stack(same)), message)):
                p = tf.identity(p)
        return _uses.DenseUse(_to_var_shape(p, var))

    return Site(y, make)


@register_rule("Einsum")
def _einsum(op, index, w, var, clean, static_batch):
    """Two-operand einsum with the weight (EinsumDense, MultiHeadAttention projections).

    With ``x`` the data operand, the batch letter leads ``x`` and ``y`` and is not in ``w``. When
    ``w``'s letters split into a prefix contracted with ``x`` (D) and a suffix kept in ``y`` (U),
    the use is an :class:`OuterUse` (A = x as [B, T, D], G = ∂L/∂y as [B, T, U], T = the other
    letters shared by x and y); otherwise the per-example gradient is materialized by the einsum
    ``x_sub,y_sub->b w_sub``.
    """
    equation = op.get_attr("equation").decode().replace(" ", "")
    if "..." in equation or len(op.inputs) != 2 or "->" not in equation:
        return None
    subs, y_sub = equation.split("->")
    subs = subs.split(",")
    x, x_sub, w_sub = op.inputs[1 - index], subs[1 - index], subs[index]
    y = op.outputs[0]
    if any(len(set(s)) != len(s) for s in (x_sub, w_sub, y_sub)) or not x_sub or not y_sub:
        return None
    b = x_sub[0]
    if y_sub[0] != b or b in w_sub or not clean.clean(x) or not _batch_major(x, static_batch):
        return None
    if any(c not in x_sub and c not in y_sub for c in w_sub) or not w.shape.is_fully_defined():
        return None
    dims = dict(zip(w_sub, (int(s) for s in w.shape)))
    d_letters = [c for c in w_sub if c in x_sub and c not in y_sub]
    u_letters = [c for c in w_sub if c in y_sub and c not in x_sub]
    t_letters = [c for c in x_sub[1:] if c in y_sub and c not in w_sub]
    outer = "".join(d_letters + u_letters) == w_sub

    def make(g, batch):
        xf, gf = _f32(x), _f32(g)
        if not outer:
            p = tf.einsum(f"{x_sub},{y_sub}->{b}{w_sub}", xf, gf)
            return _uses.DenseUse(_to_var_shape(p, var))
        a = tf.einsum(f"{x_sub}->{b}{''.join(t_letters + d_letters)}", xf)  # sums only_x letters
        gt = tf.einsum(f"{y_sub}->{b}{''.join(t_letters + u_letters)}", gf)
        d = int(np.prod([dims[c] for c in d_letters]))
        u = int(np.prod([dims[c] for c in u_letters]))
        return _uses.OuterUse(tf.reshape(a, tf.stack([batch, -1, d])), tf.reshape(gt, tf.stack([batch, -1, u])))

    return Site(y, make)


@register_rule(*_grouped.CALL_OPS)
def _call(op, index, w, var, clean, static_batch):
    """A function call: Keras's grouped convolution (``_grouped``), or tf_keras LSTM/GRU kernels,
    recurrent kernels and biases (``_recurrent``)."""
    if _grouped.recognize(op) is not None:
        return _grouped_conv(op, index, w, var, clean, static_batch)
    return _recurrent.site_for(op, index, w, var, clean, static_batch, Site)


def _grouped_conv(op, index, w, var, clean, static_batch):
    """The kernel of Keras's grouped Conv1D/Conv2D call (``_grouped.recognize``): per-example
    kernel gradients per group of channels (``_conv.per_example_grouped_kernel_grads``), from the
    body's convolution input and output gradient rebuilt from the call's (``GroupedConv``); each
    example's SpaceToBatchND blocks (a dilated convolution) are summed as for Conv2D."""
    call = _grouped.recognize(op)
    if int(index) != call.kernel_index or var.shape.num_elements() != call.kernel.num_elements():
        return None
    x, y = op.inputs[call.x_index], op.outputs[0]
    if not clean.clean(x) or not _batch_major(x, static_batch):
        return None
    if not x.shape[1:].is_fully_defined() or not y.shape[1:].is_fully_defined():
        return None
    taps = (int(call.kernel[0]), int(call.kernel[1]))

    def make(g, batch):
        xc, gc = call.conv_input(_f32(x)), call.conv_output_grad(_f32(g))
        parts = _conv.per_example_grouped_kernel_grads(
            xc, gc, taps, call.strides, call.rates, call.padding, call.groups
        )
        return _uses.PiecesUse(_per_example(parts, call.blocks, x, static_batch, batch))

    return Site(y, make)


@register_rule(*sorted(_loops.WHILE_OPS))
def _while_loop(op, index, w, var, clean, static_batch):
    """A variable captured by a recurrent ``while`` loop (Keras 3 RNNs): its uses in the loop's
    unrolled copy (``_loops``), each by its own rule, backpropagated through the copy.

    Returns a list of sites (one per use in the copy), or None if the loop has no exact copy or a
    use in it has no rule.
    """
    loop = _loops.unrolled(op)
    read = loop.reads.get(int(index)) if loop is not None else None
    if read is None or w.dtype != tf.resource:
        return None
    sites = walk_sites([read], var, set(loop.ops), clean, static_batch)
    if not sites:
        return None
    return [dataclasses.replace(s, make=_checked(s.make, loop), through=loop.through) for s in sites]


def _checked(make: MakeUse, loop) -> MakeUse:
    """``make`` whose output gradients wait for the loop's run-time checks (``Unrolled.checks``)."""

    def checked(g, batch):
        with tf.control_dependencies(loop.checks()):
            g = tf.nest.map_structure(tf.identity, g)
        return make(g, batch)

    return checked

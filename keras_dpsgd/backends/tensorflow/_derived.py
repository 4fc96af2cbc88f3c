"""Variables used through ops on weights alone: LoRA's ``W + s·A·B``, sliced position embeddings,
RMSNorm's ``1 + scale``, transposed kernels, tables broadcast over the batch.

Such an op's output ``D = f(w, other weights)`` holds no example data (``_rows`` gives it no rows):
it is the same for every example. Its uses on the way to the loss are found by their own rules, as
if ``D`` were a variable; they give each example's gradient of ``D``, and the chain rule through
``f`` (linear in ``w``) gives each example's gradient of ``w`` (a *pullback* of the use):

* ``MatMul`` ``D = A·B`` (Keras 3 LoRA: ``ops.matmul(lora_kernel_a, lora_kernel_b)``):
  ``∂ℓ_i/∂A = G_i Bᵀ`` and ``∂ℓ_i/∂B = Aᵀ G_i``. With ``G_i = X_iᵀ Γ_i`` (a Dense/EinsumDense use,
  ``OuterUse``) these stay factorized, ``X_iᵀ (Γ_i Bᵀ)`` and ``(X_i A)ᵀ Γ_i``, so ghost norms and
  book-keeping apply to A and B (Hu et al. 2022, LoRA; Li et al. 2022, ghost norm); a looked-up
  table (``IndexUse``, Embedding LoRA) gives rows ``Γ_i Bᵀ`` of A and ``A[ids]ᵀ Γ_i`` of B.
* ``Mul`` by a weight-only scalar (LoRA's ``alpha / rank``), ``Add``/``AddV2``/``Sub`` with a
  weight-only tensor of the same shape (the frozen kernel, RMSNorm's ``1 +``): scaled / the same.
* ``Neg`` (PReLU's ``-alpha``, then paired with ``relu(-x)`` by the elementwise rule): the use negated. PReLU's
  alpha thus gets ``Σ g_out · min(x, 0)`` over the axes it is shared along, per example (exact, materialized).
* ``Slice`` of rows of a table (``PositionEmbedding``): the rows ``begin + t`` of the table, an
  ``IndexUse``; ``Transpose``: the use kept in the transposed layout (``PermutedUse``: same norms,
  the clipped sum transposed back; for a 2-D transpose of an ``OuterUse``, its factors swapped).
* ``BroadcastTo`` (a table broadcast over the batch, then added to each example's activations):
  the elementwise rule of the op that pairs it with the examples, applied to the table before the
  broadcast (numpy broadcasting gives the same sums).

Every pullback is exact; where a use has no factorized pullback, it is materialized
([B, *D.shape]) and pulled back densely. Anything else declines (the variable then takes the
per-example jacobians).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from keras_dpsgd.backends.tensorflow import state as _state, uses as _uses
from keras_dpsgd.backends.tensorflow.handlers import Site, _f32, _to_var_shape, rule_for, walk_sites
from keras_dpsgd.backends.tensorflow.handlers import _batch_major as batch_major

# Weight-only op types with a pullback (the variable at input 0 or 1).
_PULLED = frozenset(
    {"MatMul", "Mul", "Add", "AddV2", "Sub", "Neg", "Transpose", "Slice", "StridedSlice", "BroadcastTo", "GatherV2"}
)
_PAIRING = frozenset({"Add", "AddV2", "Sub", "Mul"})


@dataclasses.dataclass(frozen=True)
class _Derived:
    """A weight-only tensor standing for a variable in the rules of its uses."""

    shape: tf.TensorShape
    dtype: tf.DType
    name: str


def is_derived(op, index: int, analysis) -> bool:
    """Whether ``op`` (using a variable's value at ``index``) computes on weights alone and has a
    pullback here."""
    if op.type not in _PULLED or index > 1:
        return False
    return all(analysis.rows.get(t.ref()) is None for t in list(op.inputs[:2]) + list(op.outputs))


def sites(op, index: int, w: tf.Tensor, var, ops: set, analysis, static_batch, stopped: list | None = None):
    """The sites of ``var`` through the weight-only ``op`` (see the module doc), or None (then the
    use that stopped the analysis is appended to ``stopped``, as by ``_graph.find_sites``)."""
    out = op.outputs[0]
    if op.type == "BroadcastTo":
        return _broadcast_sites(op, w, var, ops, analysis, static_batch)
    if op.type == "GatherV2":
        return _gather_sites(op, index, w, ops, analysis, static_batch)
    pull = _pullback(op, index, w)
    if pull is None or not out.shape.is_fully_defined() or not w.shape.is_fully_defined():
        return None
    found = walk_sites([out], _Derived(out.shape, out.dtype, var.name), ops, analysis, static_batch, stopped)
    if found is None:
        return None
    return [dataclasses.replace(s, make=_pulled(s.make, pull, out.shape, var)) for s in found]


def _pulled(make, pull, out_shape, var):
    def pulled(g, batch):
        use = pull(make(g, batch), out_shape)
        if isinstance(use, _uses.DenseUse):
            use = _uses.DenseUse(_to_var_shape(use.p, var))
        return use

    return pulled


def _broadcast_sites(op, w, var, ops, analysis, static_batch):
    """``BroadcastTo(w)`` paired elementwise with the examples: each pairing op's rule on ``w``."""
    found = []
    for consumer, j in _consumers(op.outputs[0], ops):
        site = (
            rule_for(consumer.type)(consumer, j, w, var, analysis, static_batch) if consumer.type in _PAIRING else None
        )
        if site is None:
            return None
        found.append(site)
    return found or None


def _consumers(t, ops):
    """The ops of ``ops`` that take ``t`` (metadata reads aside), with the input index."""
    for consumer in t.consumers():
        if consumer in ops and consumer.type not in _state.METADATA:
            for j, inp in enumerate(consumer.inputs):
                if inp is t:
                    yield consumer, j


def _gather_sites(op, index, w, ops, analysis, static_batch):
    """Rows of a table looked up with ids that hold no example data (``zeros_like(token_ids)``
    segment ids), paired row by row with the examples: ``y = x ± v`` or ``x · v`` where
    ``v = table[ids]`` has ``y``'s shape (or one row, broadcast): example ``i``'s gradient is
    ``Σ_t onehot(ids[i, t]) ∂ℓ_i/∂v[i, t]``."""
    axis = tf.get_static_value(op.inputs[2])
    ids, v = op.inputs[1], op.outputs[0]
    if index != 0 or op.get_attr("batch_dims") != 0 or axis is None or int(axis) != 0 or w.shape.rank != 2:
        return None
    if ids.shape.rank is None or ids.shape.rank < 1 or not v.shape[1:].is_fully_defined():
        return None
    found = []
    for consumer, j in _consumers(v, ops):
        site = _paired_rows(consumer, j, ids, w.shape, analysis, static_batch)
        if site is None:
            return None
        found.append(site)
    return found or None


def _paired_rows(op, j, ids, table_shape, analysis, static_batch):
    y, v, other = op.outputs[0], op.inputs[j], op.inputs[1 - j]
    if op.type not in _PAIRING or not analysis.clean(y) or not batch_major(y, static_batch):
        return None
    if y.shape.rank != v.shape.rank or y.shape[1:].as_list() != v.shape[1:].as_list():
        return None
    vocab, width = int(table_shape[0]), int(table_shape[1])
    sign = -1.0 if op.type == "Sub" and j == 1 else 1.0

    def make(g, batch):
        p = _f32(g) * _f32(other) if op.type == "Mul" else _f32(g) * sign
        rows = tf.broadcast_to(ids, tf.concat([tf.shape(p)[:1], tf.shape(ids)[1:]], axis=0))
        return _uses.IndexUse(
            tf.reshape(rows, tf.stack([batch, -1])), tf.reshape(p, tf.stack([batch, -1, width])), vocab
        )

    return Site(y, make)


def _dense(use, shape) -> tf.Tensor:
    return tf.cast(_uses.materialize(use, shape), tf.float32)


def _scaled(use, s):
    if isinstance(use, _uses.OuterUse):
        return _uses.OuterUse(use.a, use.g * s)
    if isinstance(use, _uses.IndexUse):
        return _uses.IndexUse(use.ids, use.g * s, use.vocab)
    if isinstance(use, _uses.PermutedUse):
        return _uses.PermutedUse(_scale(use.inner, use.inner_shape, s), use.inner_shape, use.perm)
    return None


def _pullback(op, index, w):
    """A function (use of the op's output, its shape) -> use of ``w``, or None."""
    out, other = op.outputs[0], op.inputs[1 - index] if len(op.inputs) > 1 else None
    if op.type in _PAIRING and out.shape != w.shape:
        return None  # w broadcast against a larger weight: not handled.
    if op.type in ("Add", "AddV2") or (op.type == "Sub" and index == 0):
        return lambda use, shape: use
    if op.type == "Neg":
        return lambda use, shape: _scale(use, shape, -1.0)
    if op.type in ("Sub", "Mul"):
        if op.type == "Mul" and (other.shape.rank is None or other.shape.num_elements() != 1):
            return None
        return lambda use, shape: _scale(use, shape, -1.0 if op.type == "Sub" else tf.reshape(_f32(other), []))
    if op.type == "Transpose":
        return _transpose_pullback(op)
    if op.type in ("Slice", "StridedSlice"):
        return _slice_pullback(op, w)
    if op.type == "MatMul":
        if op.get_attr("transpose_a") or op.get_attr("transpose_b") or w.shape.rank != 2 or other.shape.rank != 2:
            return None
        return _matmul_a(other) if index == 0 else _matmul_b(other)
    return None


def _scale(use, shape, s):
    scaled = _scaled(use, s)
    return scaled if scaled is not None else _uses.DenseUse(_dense(use, shape) * s)


def _transpose_pullback(op):
    perm = tf.get_static_value(op.inputs[1])
    if perm is None:
        return None
    inverse = [int(k) for k in np.argsort(perm)]

    def pull(use, shape):
        if list(perm) == [1, 0] and isinstance(use, _uses.OuterUse):
            return _uses.OuterUse(use.g, use.a)  # (A_iᵀ G_i)ᵀ = G_iᵀ A_i.
        return _uses.PermutedUse(use, shape, tuple(inverse))  # Norms and sums in the transposed layout.

    return pull


def _first_row(op, w):
    """The first row of a slice of rows ``[b, b + T)`` of the 2-D table ``w`` taking all its
    columns (``Slice``, or ``StridedSlice`` with unit strides and no axis added or removed), or None."""
    out = op.outputs[0]
    if w.shape.rank != 2 or out.shape.rank != 2 or out.shape[1] != w.shape[1]:
        return None
    begin = tf.get_static_value(op.inputs[1])
    if begin is None:
        return None
    if op.type == "Slice":
        return int(begin[0]) if int(begin[1]) == 0 else None
    strides = tf.get_static_value(op.inputs[3])
    masks = [op.get_attr(m) for m in ("ellipsis_mask", "new_axis_mask", "shrink_axis_mask")]
    if strides is None or any(int(k) != 1 for k in strides) or any(masks):
        return None
    # Axes past the given ones (table[:T] gives one) are taken whole.
    starts = [
        0 if k >= len(begin) or op.get_attr("begin_mask") & (1 << k) else int(begin[k]) % int(w.shape[k])
        for k in (0, 1)
    ]
    return starts[0] if starts[1] == 0 else None


def _slice_pullback(op, w):
    """Rows ``[b, b + T)`` of a 2-D table (all columns): an ``IndexUse`` of the ids ``b + t``."""
    first = _first_row(op, w)
    if first is None:
        return None
    vocab = int(w.shape[0])

    def pull(use, shape):
        if isinstance(use, _uses.IndexUse):
            return _uses.IndexUse(use.ids + first, use.g, vocab)
        p = _dense(use, shape)  # [B, T, D]
        rows = tf.range(first, first + int(shape[0]))
        ids = tf.tile(rows[None, :], tf.stack([tf.shape(p)[0], 1]))
        return _uses.IndexUse(ids, p, vocab)

    return pull


def _matmul_a(b_value):
    """``D = A·B``, the use of A: ``∂ℓ_i/∂A = G_i Bᵀ``."""
    bt = tf.transpose(_f32(b_value))
    n = int(b_value.shape[1])

    def pull(use, shape):
        if isinstance(use, _uses.IndexUse):
            return _uses.IndexUse(use.ids, tf.matmul(use.g, bt), use.vocab)
        if isinstance(use, _uses.OuterUse) and int(use.g.shape[2]) % n == 0:
            # G_i = X_iᵀ Γ_i, Γ_i's columns (k, n) with D's rows (x, k): X_iᵀ (Γ_i Bᵀ) in A's layout.
            k = int(use.g.shape[2]) // n
            b, t = tf.shape(use.g)[0], tf.shape(use.g)[1]
            gb = tf.matmul(tf.reshape(use.g, tf.stack([b, t, k, n])), bt)
            return _uses.OuterUse(use.a, tf.reshape(gb, tf.stack([b, t, k * int(bt.shape[1])])))
        p = tf.reshape(_dense(use, shape), tf.stack([-1, int(shape.num_elements()) // n, n]))
        return _uses.DenseUse(tf.matmul(p, bt))

    return pull


def _matmul_b(a_value):
    """``D = A·B``, the use of B: ``∂ℓ_i/∂B = Aᵀ G_i``."""
    a = _f32(a_value)
    m, r = int(a_value.shape[0]), int(a_value.shape[1])

    def pull(use, shape):
        n = int(shape.num_elements()) // m
        if isinstance(use, _uses.IndexUse) and use.vocab == m:
            return _uses.OuterUse(tf.gather(a, use.ids), use.g)
        if isinstance(use, _uses.OuterUse) and int(use.g.shape[2]) % n == 0:
            # D's rows (x, k): Σ_x,k A[(x,k)]ᵀ G_i[(x,k)] = Σ_t,k (X_i A_k)[t]ᵀ Γ_i[t, k].
            k, d = int(use.g.shape[2]) // n, int(use.a.shape[2])
            xa = tf.einsum("btx,xkr->btkr", use.a, tf.reshape(a, [d, k, r]))
            batch = tf.shape(use.a)[0]
            return _uses.OuterUse(tf.reshape(xa, tf.stack([batch, -1, r])), tf.reshape(use.g, tf.stack([batch, -1, n])))
        p = tf.reshape(_dense(use, shape), tf.stack([-1, m, n]))
        return _uses.DenseUse(tf.einsum("mr,bmn->brn", a, p))

    return pull

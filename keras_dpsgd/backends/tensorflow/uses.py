"""Per-example gradient *uses* of one variable: norms and clipped sums without materializing.

A variable ``w`` enters the per-example loss through one or more *uses* (a MatMul, a Conv2D, a
gather, a bias add, ...). Each use contributes a per-example gradient of one of three forms:

* :class:`OuterUse`: ``grad_i = A_iᵀ G_i`` with ``A`` of shape [B, T, D] and ``G`` of shape
  [B, T, U] (Dense on 2-D inputs has T = 1, sequence Dense has T = sequence length, Conv2D has
  ``A`` = im2col patches and T = output positions). The matrix is in ``w``'s row-major layout.
* :class:`IndexUse`: ``grad_i = Σ_t e_{id_it} g_itᵀ`` (an embedding lookup of ids [B, T]).
* :class:`DenseUse`: the per-example gradient itself, ``P`` of shape [B, *w.shape] (or in
  pieces, :class:`PiecesUse`).

Uses of the same variable are summed *before* the norm (weight sharing), by concatenating along
T when all uses have the same form, else by materializing every use. A :class:`Group` then gives
the per-example squared norms and, once the clip factors ``c`` are known, the clipped sum
``Σ_i c_i grad_i``:

* Goodfellow (2015), "Efficient per-example gradient computations": for T = 1,
  ``‖a_i g_iᵀ‖² = ‖a_i‖² ‖g_i‖²``.
* Li et al. (2022), "Large language models can be strong differentially private learners",
  ghost norm: ``‖A_iᵀ G_i‖²_F = Σ (A_i A_iᵀ) ∘ (G_i G_iᵀ)``, cheaper than materializing when
  ``T (D + U) <= D U`` (Bu et al. 2023, "mixed ghost norm", choose per layer by shape).
* Bu et al. (2023), "Differentially private optimization on large model at small cost"
  (book-keeping): ``Σ_i c_i A_iᵀ G_i = (diag(c) A)ᵀ G`` in one matmul.

Every ``sq_norms`` is a certified upper bound of the example's squared norm, not its float32 value: rows
that cancel would otherwise round it to 0 and release the example unclipped (``keras_dpsgd.dp.rounding``
holds the margins, shared with the JAX backend; :func:`unit_roundoff` their unit).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import tensorflow as tf

from keras_dpsgd.backends.tensorflow import _checks
from keras_dpsgd.dp import rounding as _rounding


@dataclasses.dataclass
class OuterUse:
    """Per-example gradient ``A_iᵀ G_i`` (``a``: [B, T, D], ``g``: [B, T, U])."""

    a: tf.Tensor
    g: tf.Tensor


@dataclasses.dataclass
class IndexUse:
    """Per-example gradient ``Σ_t onehot(ids_it) g_itᵀ`` (``ids``: [B, T], ``g``: [B, T, D])."""

    ids: tf.Tensor
    g: tf.Tensor
    vocab: int


@dataclasses.dataclass
class DenseUse:
    """Materialized per-example gradient ``p``: [B, *var.shape]."""

    p: tf.Tensor


@dataclasses.dataclass
class PiecesUse:
    """Materialized per-example gradient in pieces: ``parts`` [B, ...] whose per-example
    flattenings, concatenated in order, are the row-major flattening of [*var.shape] (the
    Conv2D kernel tap by tap; stacking them would copy the whole [B, *var.shape] once more)."""

    parts: list

    def materialize(self, shape: tf.TensorShape) -> tf.Tensor:
        return with_rows(tf.concat([_flat_rows(q) for q in self.parts], axis=1), shape)


@dataclasses.dataclass
class PermutedUse:
    """Per-example gradient ``transpose(G_i, perm)`` where ``inner`` is a use giving ``G_i`` in
    the layout ``inner_shape`` (the weight's transpose, e.g. Gemma's attention kernels)."""

    inner: object
    inner_shape: tf.TensorShape
    perm: tuple


def with_rows(t: tf.Tensor, shape) -> tf.Tensor:
    """``t`` reshaped to [B, *shape], B its number of rows (the leading dimension, often known only at run time).

    Where `shape` is static with no zero, B is left to ``tf.reshape`` (-1): one op in the traced graph instead of
    four reading ``tf.shape(t)`` (a step builds this for every variable; the values are the same).
    """
    if not tf.is_tensor(shape):
        dims = tf.TensorShape(shape)
        if dims.is_fully_defined() and all(d > 0 for d in dims.as_list()):
            return tf.reshape(t, [-1, *dims.as_list()])
    return tf.reshape(t, tf.concat([tf.shape(t)[:1], shape], axis=0))


def _row_shape(rank: int) -> list:
    """[-1, 1, ..., 1] (`rank` entries): the shape of a [B] vector as one value per row of a rank-`rank` tensor."""
    return [-1] + [1] * (rank - 1)


def _mask_rows(t: tf.Tensor, c: tf.Tensor) -> tf.Tensor:
    """``t`` with the rows of ``c_i == 0`` set to exactly 0 (``t`` itself when there are none).

    Factors are 0 only for examples with a non-finite norm, so the masking ``tf.where`` (three
    passes over ``t``) runs only in steps that have one.
    """
    keep = tf.reshape(c > 0, _row_shape(t.shape.rank))
    return tf.cond(tf.reduce_all(keep), lambda: t, lambda: tf.where(keep, t, tf.zeros_like(t)))


def _scale_rows(t: tf.Tensor, c: tf.Tensor) -> tf.Tensor:
    """Row i of ``t`` times ``c_i``; rows with ``c_i == 0`` are exactly 0 even if they hold NaN/Inf
    (``multiply_no_nan``: x·0 = 0 for every x; one pass, no branch)."""
    return tf.math.multiply_no_nan(t, tf.reshape(tf.cast(c, t.dtype), _row_shape(t.shape.rank)))


def _flat_rows(t: tf.Tensor) -> tf.Tensor:
    rest = t.shape[1:]
    if rest.is_fully_defined():
        return with_rows(t, [rest.num_elements()])
    return tf.reshape(t, tf.stack([tf.shape(t)[0], -1]))


def row_dots(t: tf.Tensor, u: tf.Tensor) -> tf.Tensor:
    """``[Σ_j t_ij u_ij]_i``: the products summed per row (on CPU 2-6x faster than a batched matmul of one-row
    matrices, oneDNN's, at every row length from 64 to 320000)."""
    return tf.reduce_sum(_flat_rows(t) * _flat_rows(u), axis=1)


def row_sq_norms(t: tf.Tensor) -> tf.Tensor:
    """``‖t_i‖²`` per row i of ``t`` [B, ...] (its float32 value)."""
    return row_dots(t, t)


def unit_roundoff() -> dict:
    """The rounding of float32 matmuls here, as ``_rounding``'s keywords: TensorFlow runs them in TensorFloat-32
    on a GPU while ``tf.config.experimental.tensor_float_32_execution_enabled()`` (its default): inputs rounded to
    10 mantissa bits (``u_in``), products and sums in float32. Announced once: the margins are then far wider."""
    if tf.config.experimental.tensor_float_32_execution_enabled() and tf.config.list_physical_devices("GPU"):
        if not _TF32_ANNOUNCED:
            _TF32_ANNOUNCED.append(True)
            logging.getLogger("keras_dpsgd").warning(_TF32_WARNING)
        return {"u": _rounding.U32, "u_in": _rounding.U_TF32}
    return {"u": _rounding.U32}


_TF32_ANNOUNCED: list = []
_TF32_WARNING = (
    "keras_dpsgd: TensorFloat-32 matmuls are enabled on this GPU: the per-example norms' rounding margins use "
    "TF32's precision (2^-10 on the inputs), so norms are bounded far above their float32 values and examples "
    "clipped harder; call tf.config.experimental.enable_tensor_float_32_execution(False) for float32 margins"
)


def staged_sq_norms(t: tf.Tensor) -> tuple[tf.Tensor, int]:
    """(``‖t_i‖²`` per row i of ``t`` [B, ...], how many terms each rounded sum adds at most).

    Summed over the last axis, then over the rest (two kernels): a rounding bound of ``γ_{last + rest}``
    rather than ``γ_{last · rest}`` (``_rounding.positive_upper``). Under XLA (``jit_compile=True``), which may
    merge the two reductions into one, the bound counts every term.
    """
    shape = t.shape.as_list()[1:]
    if len(shape) < 2 or None in shape:
        return row_sq_norms(t), (None if None in shape else max(1, math.prod(shape)))
    last, rest = shape[-1], math.prod(shape[:-1])
    rows = tf.reduce_sum(tf.square(tf.reshape(t, [-1, rest, last])), axis=2)
    merged = not tf.executing_eagerly() and _checks.under_xla(t.graph)
    return tf.reduce_sum(rows, axis=1), (last * rest if merged else last + rest)


def certified_sq_norms(t: tf.Tensor) -> tf.Tensor:
    """An upper bound of ``‖t_i‖²`` per row i of the materialized ``t`` [B, ...] (relative margin)."""
    sq, terms = staged_sq_norms(t)
    if terms is None:
        terms = tf.cast(tf.reduce_prod(tf.shape(t)[1:]), tf.float32)
    return _rounding.positive_upper(sq, terms, **unit_roundoff())


def row_lengths(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """``S_i = Σ_t ‖a_it‖ ‖g_it‖`` for ``a`` [B, T, D] and ``g`` [B, T, U]: [B]."""
    return tf.reduce_sum(tf.sqrt(tf.reduce_sum(tf.square(a), 2) * tf.reduce_sum(tf.square(g), 2)), axis=1)


def weighted_row_sum(t: tf.Tensor, c: tf.Tensor) -> tf.Tensor:
    """``Σ_i c_i t_i`` (shape ``t.shape[1:]``), one matrix-vector product; rows with
    ``c_i == 0`` add exactly 0 even if they hold NaN/Inf."""
    flat = _flat_rows(_mask_rows(t, c))
    rest = t.shape[1:]
    summed = tf.matmul(tf.reshape(c, [1, -1]), flat)
    return tf.reshape(summed, rest.as_list() if rest.is_fully_defined() else tf.shape(t)[1:])


def ghost_preferred(t: int, d: int, u: int) -> bool:
    """Mixed ghost norm rule (Bu et al. 2023), by memory first: the ghost form keeps B·T·(D+U) values of the use (its
    input and output gradient) and adds B·T²·(D+U) work plus the release's B·T·D·U matmul; the materialized form
    keeps B·D·U values and its B·T·D·U product serves the norm and the release. Materialized where it keeps at most
    twice the ghost form's values, ``D·U <= 2·T·(D+U)``: faster there (1.6x at T = 32, D = 64, U = 128 on CPU), and
    small where ``T (D + U)`` is (a wide layer on long sequences keeps the ghost form)."""
    return d * u > 2 * t * (d + u)


class OuterGroup:
    """Sum of :class:`OuterUse` contributions (concatenated along T)."""

    def __init__(self, uses: list[OuterUse], shape: tf.TensorShape):
        self.a = tf.concat([u.a for u in uses], axis=1) if len(uses) > 1 else uses[0].a
        self.g = tf.concat([u.g for u in uses], axis=1) if len(uses) > 1 else uses[0].g
        self.shape = shape
        self._materialized = None

    def sq_norms(self) -> tf.Tensor:
        """Certified upper bounds of the per-example squared norms (``_rounding``)."""
        a, g = self.a, self.g
        t, d, u = a.shape[1], int(a.shape[2]), int(g.shape[2])
        if t == 1:  # Goodfellow: rank-one per-example gradients, ‖a‖²‖g‖² (no cancellation).
            return _rounding.positive_upper(row_sq_norms(a) * row_sq_norms(g), d + u + 1, **unit_roundoff())
        if t is not None:
            if ghost_preferred(t, d, u):
                return _ghost_sq_norms(a, g, t)
            self._materialized = tf.einsum("btd,btu->bdu", a, g)  # the release sums these same tensors
            return certified_sq_norms(self._materialized)
        dyn_t = tf.shape(a)[1]
        return tf.cond(  # the direct norm does not serve the release here: the work of the norms alone decides
            dyn_t * (d + u) <= d * u,
            lambda: _ghost_sq_norms(a, g, tf.cast(dyn_t, tf.float32)),
            lambda: _direct_sq_norms(a, g, tf.cast(dyn_t, tf.float32)),
        )

    def clipped_sum(self, c: tf.Tensor) -> tf.Tensor:
        if self._materialized is not None:
            return tf.reshape(weighted_row_sum(self._materialized, c), self.shape)
        d, u = int(self.a.shape[2]), int(self.g.shape[2])
        a = tf.reshape(_scale_rows(self.a, c), [-1, d])
        g = tf.reshape(_mask_rows(self.g, c), [-1, u])
        return tf.reshape(tf.matmul(a, g, transpose_a=True), self.shape)

    def materialize(self) -> tf.Tensor:
        return with_rows(tf.einsum("btd,btu->bdu", self.a, self.g), self.shape)


def _ghost_sq_norms(a: tf.Tensor, g: tf.Tensor, rows) -> tf.Tensor:
    """Li et al. (2022): ‖A_iᵀ G_i‖²_F = Σ_{t,s} (a_t·a_s)(g_t·g_s), certified (``_rounding.gram_upper``).

    The release is one matmul over all rows, not these products: the bound is of the exact norm.
    """
    aa, gg = tf.matmul(a, a, transpose_b=True), tf.matmul(g, g, transpose_b=True)
    abs_aa, abs_gg = tf.abs(aa), tf.abs(gg)
    na, ng = tf.norm(a, axis=2), tf.norm(g, axis=2)  # [B, T]
    return _rounding.gram_upper(
        row_dots(aa, gg),
        row_dots(abs_aa, abs_gg),
        tf.reduce_sum(na * ng, axis=1),
        tf.reduce_sum(abs_gg * (na[:, :, None] * na[:, None, :]), axis=[1, 2]),  # no batched matvec of T rows
        tf.reduce_sum(abs_aa * (ng[:, :, None] * ng[:, None, :]), axis=[1, 2]),
        widths=(int(a.shape[2]), int(g.shape[2])),
        rows=rows,
        **unit_roundoff(),
    )


def _direct_sq_norms(a: tf.Tensor, g: tf.Tensor, rows) -> tf.Tensor:
    """‖A_iᵀ G_i‖² from the product itself, when the release does not sum it (a sequence length known
    only at run time): the product's rounding is bounded linearly (``_rounding.linear_upper``)."""
    sq, terms = staged_sq_norms(tf.einsum("btd,btu->bdu", a, g))
    return _rounding.linear_upper(sq, terms, row_lengths(a, g), rows, **unit_roundoff())


class IndexGroup:
    """Sum of :class:`IndexUse` contributions (an embedding table looked up one or more times).

    The per-example gradient has one row per *distinct* id of the example; rows of repeated ids
    are summed first (``tf.unique`` over the keys ``i·V + id``), so the norm is exact.
    """

    def __init__(self, uses: list[IndexUse], shape: tf.TensorShape):
        # ids of one table may come as int32 and int64 (a gather and a slice of it).
        self.ids = tf.concat([tf.cast(u.ids, tf.int64) for u in uses], axis=1) if len(uses) > 1 else uses[0].ids
        self.g = tf.concat([u.g for u in uses], axis=1) if len(uses) > 1 else uses[0].g
        self.vocab = uses[0].vocab
        self.shape = shape

    def sq_norms(self) -> tf.Tensor:
        b = tf.shape(self.ids, out_type=tf.int64)[0]
        ids = tf.cast(self.ids, tf.int64)
        keys = tf.range(b)[:, None] * self.vocab + ids
        unique_keys, idx = tf.unique(tf.reshape(keys, [-1]))
        d = int(self.g.shape[2])
        rows = tf.math.unsorted_segment_sum(tf.reshape(self.g, [-1, d]), idx, tf.shape(unique_keys)[0])
        row_sq = tf.reduce_sum(tf.square(rows), axis=1)
        sq = tf.math.unsorted_segment_sum(row_sq, unique_keys // self.vocab, b)
        # The released sum adds the rows apart (one segment sum over the batch): bound the true norm.
        lookups = tf.cast(tf.shape(self.ids)[1], tf.float32)
        lengths = tf.reduce_sum(tf.norm(self.g, axis=2), axis=1)
        return _rounding.linear_upper(sq, d + lookups, lengths, lookups, **unit_roundoff())

    def clipped_sum(self, c: tf.Tensor) -> tf.Tensor:
        d = int(self.g.shape[2])
        g = tf.reshape(_scale_rows(self.g, c), [-1, d])
        return tf.math.unsorted_segment_sum(g, tf.reshape(self.ids, [-1]), self.vocab)

    def materialize(self) -> tf.Tensor:
        onehot = tf.one_hot(self.ids, self.vocab, dtype=self.g.dtype)
        return tf.einsum("btv,btd->bvd", onehot, self.g)


class DenseGroup:
    """Materialized per-example gradients: ``p`` [B, *shape], or :class:`PiecesUse` pieces."""

    def __init__(self, p: tf.Tensor | PiecesUse, shape: tf.TensorShape | None = None):
        self.parts = p.parts if isinstance(p, PiecesUse) else [p]
        self.shape = shape if shape is not None else p.shape[1:]

    def sq_norms(self) -> tf.Tensor:
        """Upper bounds from the materialized gradients that the release sums (a relative margin)."""
        staged = [staged_sq_norms(q) for q in self.parts]
        terms = [n if n is not None else tf.reduce_prod(tf.shape(q)[1:]) for (_, n), q in zip(staged, self.parts)]
        if all(isinstance(n, int) for n in terms):  # static: the bound's constant computed here, not in the graph
            most = max(terms) + len(self.parts)
        else:
            most = tf.cast(tf.reduce_max(tf.stack(terms)), tf.float32) + len(self.parts)
        return _rounding.positive_upper(tf.add_n([sq for sq, _ in staged]), most, **unit_roundoff())

    def clipped_sum(self, c: tf.Tensor) -> tf.Tensor:
        if len(self.parts) == 1:  # A piece may hold the whole variable in another shape.
            return tf.reshape(weighted_row_sum(self.parts[0], c), self.shape)
        flat = tf.concat([tf.reshape(weighted_row_sum(q, c), [-1]) for q in self.parts], axis=0)
        return tf.reshape(flat, self.shape)


class PermutedGroup:
    """Uses of a transposed weight, all through the same transpose: the norms are those of the
    inner group (a transpose keeps the norm), the clipped sum is its sum transposed."""

    def __init__(self, uses: list[PermutedUse], shape: tf.TensorShape):
        self.inner_shape, self.perm, self.shape = uses[0].inner_shape, list(uses[0].perm), shape
        self.inner = make_group([u.inner for u in uses], self.inner_shape)

    def sq_norms(self) -> tf.Tensor:
        return self.inner.sq_norms()

    def clipped_sum(self, c: tf.Tensor) -> tf.Tensor:
        summed = tf.reshape(self.inner.clipped_sum(c), self.inner_shape)
        return tf.reshape(tf.transpose(summed, self.perm), self.shape)


def make_group(uses: list, shape: tf.TensorShape):
    """Combines the uses of one variable into a group (weight sharing: sum before the norm)."""
    if all(isinstance(u, PermutedUse) for u in uses):
        if len({(tuple(u.inner_shape.as_list()), tuple(u.perm)) for u in uses}) == 1:
            return PermutedGroup(uses, shape)
    if all(isinstance(u, OuterUse) for u in uses):
        same = {(int(u.a.shape[2]), int(u.g.shape[2])) for u in uses}
        if len(same) == 1:
            return OuterGroup(uses, shape)
    if all(isinstance(u, IndexUse) for u in uses):
        return IndexGroup(uses, shape)
    if len(uses) == 1 and isinstance(uses[0], PiecesUse):
        return DenseGroup(uses[0], shape)
    total = None
    for use in uses:
        p = materialize(use, shape)
        total = p if total is None else total + p
    return DenseGroup(total)


def materialize(use, shape: tf.TensorShape) -> tf.Tensor:
    """The per-example gradient [B, *shape] of one use."""
    if isinstance(use, OuterUse):
        return OuterGroup([use], shape).materialize()
    if isinstance(use, IndexUse):
        return IndexGroup([use], shape).materialize()
    if isinstance(use, PiecesUse):
        return use.materialize(shape)
    if isinstance(use, PermutedUse):
        return with_rows(tf.transpose(materialize(use.inner, use.inner_shape), [0] + [k + 1 for k in use.perm]), shape)
    return use.p

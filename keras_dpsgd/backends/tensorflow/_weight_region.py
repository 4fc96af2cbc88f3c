"""A variable used through ops on weights alone that have no factorized pullback: LayerNormalization of a table
(DeBERTa-v3's relative-position embeddings), a gamma broadcast against a normalized weight, any such chain.

Where ``_derived`` finds no pullback for a use of ``t`` (the variable's value, or a value computed from it and
other weights only), the whole *weight region* downstream of ``t`` is taken at once: the ops on the way to the loss
whose inputs and outputs hold no example data (``_rows`` gives them no rows), reached from ``t`` through such ops.
Its *exits* are the region's tensors read by an op outside it (an op on the examples' data, or a tile over the
batch that the row analysis proved gives each example its own copy). Each exit ``e`` is then as a variable: its
uses are found by their own rules (``walk_sites`` on the ops outside the region), giving each example's gradient
``P_i,e = ∂ℓ_i/∂e``, materialized. Every path from ``t`` to the loss either leaves ``t`` by an op outside the region
(found by those rules too) or runs through the region to the first exit it meets, so by the chain rule

    ∂ℓ_i/∂t = Σ_(t's own uses outside the region) + Σ_e (∂e/∂t)ᵀ P_i,e,

the second term one vector-Jacobian product of the region (``tf.gradients`` of the exits with cotangents
``P_i,e``), per example (vectorized by ``tf.vectorized_map``, no fallback to a loop). It is exact: the region
computes the same values for every example, so its Jacobian is shared and only the cotangents differ. The result
is a materialized :class:`~keras_dpsgd.backends.tensorflow.uses.DenseUse`, whose norm is certified as every
materialized use's (``uses.DenseGroup``: the release sums the same tensors).

The vectorization is checked at run time, as the per-example jacobians are (``_reference.jacobian_checks``): with
fixed weights ``r_i`` in [0.5, 1.5], one plain vector-Jacobian product at ``Σ_i r_i P_i`` must equal
``Σ_i r_i V_i`` for the vectorized rows ``V_i`` (a wrong or swapped row changes it). Only ops of
:data:`REGION_OPS` (elementwise, reductions, reshapes, slices, products) may be in a region; any other op
declines (the variable then takes the per-example jacobians, named in the warning), as does a step compiled with
XLA.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from keras_dpsgd.backends.tensorflow import _checks, _rows, state as _state, uses as _uses
from keras_dpsgd.backends.tensorflow.handlers import Site, _f32, _to_var_shape, walk_sites
from keras_dpsgd.dp.refusals import refusal_message

# The ops a weight region may hold: their gradients are elementwise, reductions, reshapes and products, which
# TensorFlow's vectorization (pfor) rewrites for a batch of cotangents.
REGION_OPS = (
    (_rows._UNARY - _rows._IMAGE_AXIS0_OPS - {"PreventGradient"})
    | (_rows._ELEMENTWISE - {"Select"})
    | {"Sum", "Mean", "Max", "Min", "Prod", "EuclideanNorm"}
    | {"Reshape", "ExpandDims", "Squeeze", "Transpose", "Tile", "StridedSlice", "Slice", "ConcatV2", "Pack"}
    | {"Unpack", "Split", "SplitV", "GatherV2", "Pad", "PadV2", "MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"}
    | {"Softmax", "LogSoftmax", "AddN"}
)
_CHECK_SEED = (41, 2026)  # the weights r_i of the run-time check (not a privacy mechanism)
_RTOL = 1e-3


@dataclasses.dataclass(frozen=True, eq=False)
class _Exit:
    """An exit of a weight region, standing for a variable in the rules of its uses."""

    shape: tf.TensorShape
    dtype: tf.DType
    name: str
    dynamic_shape: tf.Tensor  # its shape at run time (a size may be unknown at trace time)


def _weight_only(op, analysis) -> bool:
    return all(analysis.rows.get(t.ref()) is None for t in list(op.inputs) + list(op.outputs))


def region_of(t: tf.Tensor, ops: set, analysis) -> set | None:
    """The weight region downstream of ``t`` (see the module doc), or None if it holds an op not in
    :data:`REGION_OPS` or is empty."""
    region, stack = set(), [t]
    while stack:
        u = stack.pop()
        for consumer in u.consumers():
            if consumer not in ops or consumer in region or consumer.type in _state.METADATA:
                continue
            if not _weight_only(consumer, analysis):
                continue
            if consumer.type not in REGION_OPS:
                return None
            region.add(consumer)
            stack += [o for o in consumer.outputs if o.dtype.is_floating]
    return region or None


def region_sites(t: tf.Tensor, var, ops: set, analysis, static_batch, stopped: list | None = None):
    """The sites of ``var`` whose value (or a value computed from it) ``t`` is: its own uses outside the weight
    region of ``t``, each by its rule, and one site for the whole region (see the module doc); None where a use
    has no rule, an exit's gradient cannot be found, or ``t``'s shape is not static."""
    if t.dtype == tf.resource or not t.dtype.is_floating or not t.shape.is_fully_defined():
        return None
    if _checks.under_xla(t.graph):  # the vectorization would trace a function of its own there
        return None
    region = region_of(t, ops, analysis)
    if region is None:
        return None
    outside = ops - region
    sites = walk_sites([t], var, outside, analysis, static_batch, stopped)  # t's own uses outside the region
    if sites is None:
        return None
    exits, parts = [], []
    for op in sorted(region, key=lambda o: o._id):  # pylint: disable=protected-access
        for e in op.outputs:
            if not e.dtype.is_floating or not any(c in outside for c in e.consumers()):
                continue
            if e.shape.rank is None:
                return None
            stand_in = _Exit(e.shape, e.dtype, var.name, tf.shape(e))
            found = walk_sites([e], stand_in, outside, analysis, static_batch, stopped)
            if found is None or any(s.through is not None for s in found):
                return None
            if found:
                exits.append(e)
                parts.append(found)
    if exits:
        sites.append(_region_site(t, exits, parts, var))
    return sites


def _flat_ys(sites: list) -> list:
    return [y for s in sites for y in (s.y if isinstance(s.y, tuple) else (s.y,))]


def _region_site(t, exits: list, parts: list, var) -> Site:
    """One site for the region: ``y`` all its exits' sites' outputs; ``make`` the per-example vector-Jacobian
    product of the region at the exits' per-example gradients."""
    ys = tuple(y for found in parts for y in _flat_ys(found))

    def make(grads, batch):
        grads, cotangents = list(grads), []
        for e, found in zip(exits, parts):
            total = None
            for s in found:
                n = len(s.y) if isinstance(s.y, tuple) else 1
                g, grads = grads[:n], grads[n:]
                use = s.make(tuple(g) if isinstance(s.y, tuple) else g[0], batch)
                p = tf.cast(_uses.materialize(use, e.shape if e.shape.is_fully_defined() else tf.shape(e)), tf.float32)
                total = p if total is None else total + p
            cotangents.append(tf.reshape(total, tf.concat([[batch], tf.shape(e)], axis=0)))
        rows = per_example_vjp(t, exits, cotangents)
        return _uses.DenseUse(_to_var_shape(rows, var))

    return Site(ys, make)


def _vjp(t, exits, cotangents) -> tf.Tensor:
    grads = tf.gradients(
        exits,
        t,
        grad_ys=[tf.cast(c, e.dtype) for e, c in zip(exits, cotangents)],
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    return _f32(tf.convert_to_tensor(grads[0]))


def per_example_vjp(t: tf.Tensor, exits: list, cotangents: list) -> tf.Tensor:
    """``[(∂exits/∂t)ᵀ P_i]_i``: [B, *t.shape] from the cotangents ``P`` ([B, *e.shape] per exit), vectorized over
    the examples, with its run-time check (see the module doc)."""
    rows = tf.vectorized_map(lambda ps: _vjp(t, exits, ps), cotangents, fallback_to_while_loop=False)
    rows = tf.reshape(rows, tf.concat([tf.shape(cotangents[0])[:1], t.shape.as_list()], axis=0))
    batch = tf.shape(rows)[0]
    r = tf.random.stateless_uniform([batch], seed=_CHECK_SEED, minval=0.5, maxval=1.5)
    weighted = [tf.tensordot(r, c, axes=1) for c in cotangents]
    want = tf.reshape(_vjp(t, exits, weighted), [-1])
    flat = tf.reshape(rows, tf.stack([batch, -1]))
    got = tf.linalg.matvec(flat, r, transpose_a=True)
    scale = tf.reduce_sum(r * tf.norm(flat, axis=1)) + tf.norm(want)
    ok = tf.logical_not(tf.math.is_finite(scale)) | (tf.norm(got - want) <= _RTOL * scale)
    message = refusal_message(
        "per-example-check",
        f"keras_dpsgd: the vectorized per-example gradients through the ops on weights alone after {t.op.name!r} "
        "disagree with their plain gradient, so clipping them would not bound each example's contribution; "
        "report this model to keras_dpsgd",
    )
    checks = _checks.check(ok, message)
    if not checks:
        return rows
    with tf.control_dependencies(checks):
        return tf.identity(rows)

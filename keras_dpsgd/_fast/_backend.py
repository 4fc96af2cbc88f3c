"""The fast per-example clipping backend.

Algorithm (one DP-SGD step, Abadi et al. 2016, Alg. 1, lines "compute gradient" and "clip"):

1. In the traced train step, find every use of every variable on the way to the per-example loss
   (``_graph``): Dense/MatMul, BatchMatMul, Conv2D/Conv1D, embedding gathers, bias adds and
   scales (LayerNormalization).
2. One backward pass, ``tf.gradients(Σ_i ℓ_i, [outputs of those uses])``, gives every
   per-example output gradient ``g_i`` (the loss is per-example, so row ``i`` of ∂(Σℓ)/∂y is
   ∂ℓ_i/∂y).
3. Per-example squared norms per variable from ghost norms (``_uses``), or from per-example
   gradients where the shape makes materializing cheaper (Conv2D kernels: one matmul per kernel tap
   on slices of the input, ``_conv``); variables with an unknown use get exact per-example
   jacobians instead (``GradientTape.jacobian``).
   Every op upstream of the loss must be known to keep the examples apart (``_rows``, an
   allowlist): if one reorders them or is unknown, row i of ∂(Σℓ)/∂y need not be ∂ℓ_i/∂y and
   the whole step uses the reference path; if one mixes them (batch statistics, a reduction over
   the batch axis), ``_graph.analyze`` raises ValueError, since no backend is private then.
4. ``clip_factors(sq_norms)`` (flat or per-layer clipping, decided by the caller).
5. Clipped sums ``Σ_i c_iv g_i[v]`` by book-keeping (Bu et al. 2023).

In eager mode (``run_eagerly=True``) there is no graph to inspect: the whole step uses the
reference path. Nothing here adds noise or touches the privacy accounting; the sums are exactly
(up to float rounding) those of the reference path.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

from keras_dpsgd._fast import _graph, _loops, _uses
from keras_dpsgd._fast._reference import ReferenceBackend


def _reference_backend() -> ReferenceBackend:
    """The optimizer's reference backend (per-example jacobians of every variable)."""
    return ReferenceBackend()


def per_example_jacobians(loss: tf.Tensor, variables: Sequence[tf.Variable], tape) -> list:
    """Per-example gradients [B, *var.shape] of ``loss`` ([B]) for each variable (vectorized)."""
    if not variables:
        return []
    if tape is None:
        raise ValueError("tape must be the GradientTape that recorded the loss, got None")
    if not tf.executing_eagerly() and hasattr(loss, "graph"):
        _graph.refuse_grouped_convolutions(loss)
    jac = tape.jacobian(loss, list(variables), unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [tf.cast(j, tf.float32) for j in jac]


def _grad_for(y: tf.Tensor, grad) -> tf.Tensor:
    grad = tf.convert_to_tensor(grad)
    grad.set_shape(y.shape)
    return grad


def _outputs(site) -> tuple:
    return site.y if isinstance(site.y, tuple) else (site.y,)


def _site_grads(site, grads: list, index: dict):
    """∂(Σℓ)/∂y for the site's output(s), in the structure of ``site.y``."""
    got = tuple(_grad_for(y, grads[index[y.ref()]]) for y in _outputs(site))
    return got if isinstance(site.y, tuple) else got[0]


def _output_grads(total: tf.Tensor, ys: list, plans: list):
    """``∂total/∂y`` for each y, backpropagating through the sites' copies (``Site.through``).

    With copies ``c`` of op outputs ``o`` (same function of the same inputs), the gradient of a
    tensor upstream of the op (or inside the copy), whose every path to ``total`` passes through
    the op, is ``∂total/∂o · ∂c/∂(tensor)``; the op's own gradient is never built (``tf.gradients`` would
    differentiate a function-call op even as a stop op, and tf_keras's LSTM/GRU function has no
    gradient function in ``Model.fit``'s graph). Returns None where a tensor reaches ``total``
    also around the op, or where one op is upstream of another (then the caller uses the reference
    path).
    """
    zero = tf.UnconnectedGradients.ZERO
    throughs = {}
    for sites in plans:
        for site in sites or ():
            if site.through is not None:
                throughs.setdefault(site.through[0][0].ref(), site.through)
    if not throughs:
        return tf.gradients(total, ys, unconnected_gradients=zero)
    if all(t.op.type in _loops.COPIED_OPS for o, _ in throughs.values() for t in o):
        return _chained_grads(total, ys, list(throughs.values()))
    originals = [t for o, _ in throughs.values() for t in o]
    copies = [t for _, c in throughs.values() for t in c]
    calls = {t.op for t in originals}
    # A copy may stand for several ops (a loop and the stacks of its output lists).
    upstream = set().union(*(_graph.ancestors(t) for op in calls for t in op.inputs if t.op not in calls))
    if calls & upstream:
        return None  # Stacked recurrent layers: the lower one's output gradient needs the upper's.
    to_total = _graph.ancestors(total)
    up = [k for k, y in enumerate(ys) if y.op in upstream or y.op not in to_total]
    if any(_reaches_around(ys[k].op, total.op, calls, to_total) for k in up):
        return None
    down = [k for k in range(len(ys)) if k not in set(up)]
    grads = [None] * len(ys)
    at = tf.gradients(total, [ys[k] for k in down] + originals, unconnected_gradients=zero)
    for k, g in zip(down, at):
        grads[k] = g
    if up:
        through = tf.gradients(copies, [ys[k] for k in up], grad_ys=at[len(down) :], unconnected_gradients=zero)
        for k, g in zip(up, through):
            grads[k] = g
    return grads


def _chained_grads(total: tf.Tensor, ys: list, throughs: list) -> list:
    """``∂total/∂y`` in the graph whose loops are replaced by their unrolled copies (``_loops``).

    Backpropagation stops at every loop's outputs (``stop_gradients``: a ``while`` op is then
    never differentiated) and continues through its copy instead, with the loop's output
    gradient; those are found from the last loop to the first (creation order is topological),
    each the gradient of ``total`` and of the later loops' copies. Every path counts once: around
    the loops (a skip connection, an input used twice) through ``total``'s own term, through a
    loop only through its copy, through stacked loops along the chain of copies.
    """
    zero = tf.UnconnectedGradients.ZERO
    order = sorted(throughs, key=lambda th: _op_index(th[0][0].op), reverse=True)
    stops = [t for originals, _ in order for t in originals]
    ys_of, grad_ys = [total], [None]
    for originals, copies in order:
        grads = tf.gradients(ys_of, list(originals), grad_ys=grad_ys, stop_gradients=stops, unconnected_gradients=zero)
        ys_of, grad_ys = ys_of + list(copies), grad_ys + grads
    return tf.gradients(ys_of, ys, grad_ys=grad_ys, stop_gradients=stops, unconnected_gradients=zero)


def _op_index(op) -> int:
    return op._id  # pylint: disable=protected-access  (creation order within the graph)


def _reaches_around(start, target, calls: set, within: set) -> bool:
    """Whether ``target`` is reachable from ``start`` along data edges through ``within``,
    avoiding ``calls``."""
    seen, stack = {start}, [start]
    while stack:
        op = stack.pop()
        if op is target:
            return True
        for t in op.outputs:
            for consumer in t.consumers():
                if consumer not in seen and consumer in within and consumer not in calls:
                    seen.add(consumer)
                    stack.append(consumer)
    return False


class FastBackend:
    """Per-example clipped gradient sums from ghost norms (Goodfellow 2015; Li et al. 2022;
    Bu et al. 2023), with per-example jacobians for the variables it cannot analyze.

    ``clipped_sum(loss, var_list, tape, clip_factors)`` returns ``(summed, sq_norms)`` with
    ``sq_norms[i, v] = ‖∂ℓ_i/∂w_v‖²`` and ``summed[v] = Σ_i factors[i, v] · ∂ℓ_i/∂w_v`` where
    ``factors = clip_factors(sq_norms)``.
    """

    name = "fast"

    def __init__(self):
        # Names of variables that used the jacobian fallback in the last traced step (for tests
        # and diagnostics; filled at trace time).
        self.last_fallback: list[str] = []

    @tf.autograph.experimental.do_not_convert
    def clipped_sum(
        self,
        loss: tf.Tensor,
        var_list: Sequence[tf.Variable],
        tape,
        clip_factors: Callable[[tf.Tensor], tf.Tensor],
    ) -> tuple[list[tf.Tensor], tf.Tensor]:
        """Steps 1-3 of the sanitizer (Abadi et al. 2016, Alg. 1): per-example norms, clip, sum.

        Args:
          loss: per-example loss, shape [B], recorded on `tape` (a graph tensor inside the traced
            train step; an eager tensor sends the whole call to the reference path).
          var_list: the trainable variables (V of them).
          tape: the GradientTape that recorded `loss` (used for jacobian fallbacks only).
          clip_factors: maps sq_norms [B, V] to factors [B, V].

        Returns:
          (summed, sq_norms): one dense tensor per variable, shaped like it, holding
          Σ_i factors[i, v] · g_i[v] (rows with factor 0 add exactly 0, even if non-finite), and
          the float32 per-example squared norms [B, V].

        Raises:
          ValueError: empty `var_list`, `loss` not of rank 1, or an op upstream of the loss that
            mixes the examples of the batch (``_graph.analyze``).
        """
        var_list = list(var_list)
        if not var_list:
            raise ValueError("var_list must hold at least one variable, got an empty list")
        if tf.executing_eagerly() or not hasattr(loss, "graph"):
            self.last_fallback = [v.name for v in var_list]
            return _reference_backend().clipped_sum(loss, var_list, tape, clip_factors)
        if loss.shape.rank != 1:
            raise ValueError(f"loss must be a per-example loss of rank 1 (shape [B]), got shape {loss.shape}")
        analysis = _graph.analyze(loss)  # Raises if the loss mixes examples.
        checks = _graph.runtime_checks(loss, analysis)
        # Reordered rows or an op outside the allowlist (ghost norms might mis-group the rows), or
        # a recurrent copy that cannot stand for its layer (``_output_grads``): per-example
        # jacobians are exact (the loss is per example).
        groups = self._groups(loss, var_list, tape, analysis) if analysis.clean(loss) else None
        if groups is None:
            self.last_fallback = [v.name for v in var_list]
            summed, sq_norms = _reference_backend().clipped_sum(loss, var_list, tape, clip_factors, checked=True)
            return _graph.with_checks(summed, checks), _graph.with_checks(sq_norms, checks)
        batch = tf.shape(loss)[0]
        sq_norms = tf.stack([g.sq_norms() if g is not None else tf.zeros([batch]) for g in groups], axis=1)
        factors = tf.cast(clip_factors(sq_norms), tf.float32)
        summed = []
        for v, (group, var) in enumerate(zip(groups, var_list)):
            if group is None:
                summed.append(tf.zeros(var.shape, var.dtype))
            else:
                summed.append(tf.cast(group.clipped_sum(factors[:, v]), var.dtype))
        return _graph.with_checks(summed, checks), _graph.with_checks(sq_norms, checks)

    def _groups(self, loss, var_list, tape, clean) -> list | None:
        ops = _graph.ancestors(loss)
        static_batch = loss.shape[0]
        plans = []
        for var in var_list:
            handles = _graph.internal_handles(loss.graph, var)
            sites = _graph.find_sites(handles, var, ops, clean, static_batch) if handles else None
            plans.append(sites)
        ys, index = [], {}
        for sites in plans:
            for site in sites or ():
                for y in _outputs(site):
                    if y.ref() not in index:
                        index[y.ref()] = len(ys)
                        ys.append(y)
        grads = _output_grads(tf.reduce_sum(loss), ys, plans) if ys else []
        if grads is None:
            return None
        fallback = [var for var, sites in zip(var_list, plans) if sites is None]
        self.last_fallback = [v.name for v in fallback]
        jacobians = iter(per_example_jacobians(loss, fallback, tape))
        batch = tf.shape(loss)[0]
        groups = []
        for var, sites in zip(var_list, plans):
            if sites is None:
                groups.append(_uses.DenseGroup(next(jacobians)))
            elif not sites:
                groups.append(None)  # The loss does not depend on this variable.
            else:
                uses = [site.make(_site_grads(site, grads, index), batch) for site in sites]
                groups.append(_uses.make_group(uses, var.shape))
        return groups

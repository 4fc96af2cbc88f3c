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
   allowlist): if one mixes them (batch statistics, a reduction over the batch axis) or is unknown
   (row i of ∂(Σℓ)/∂y need not be ∂ℓ_i/∂y), ``_graph.analyze`` raises ValueError with either
   backend, since neither could bound the sensitivity then; so does a loss that reads a variable
   written from the batch (``_state``).
4. ``clip_factors(sq_norms)`` (flat or per-layer clipping, decided by the caller).
5. Clipped sums ``Σ_i c_iv g_i[v]`` by book-keeping (Bu et al. 2023).

In eager mode (``run_eagerly=True``) there is no graph to inspect: the step is refused
(``_reference.EAGER_MESSAGE``). Nothing here adds noise or touches the privacy accounting; the sums are exactly
(up to float rounding) those of the reference path.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import tensorflow as tf

from keras_dpsgd.backends.tensorflow import _checks, graph as _graph, report as _report, state as _state, uses as _uses
from keras_dpsgd.backends.tensorflow._reference import ReferenceBackend, per_example_jacobians, refuse_eager
from keras_dpsgd.dp.refusals import refuse


def _reference_backend() -> ReferenceBackend:
    """The optimizer's reference backend (per-example jacobians of every variable)."""
    return ReferenceBackend()


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


def _output_grads(total: tf.Tensor, ys: list, plans: list) -> list:
    """``∂total/∂y`` for each y, backpropagating through the sites' copies (``Site.through``)."""
    throughs = {}
    for sites in plans:
        for site in sites or ():
            if site.through is not None:
                throughs.setdefault(site.through[0][0].ref(), site.through)
    if not throughs:
        return tf.gradients(total, ys, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return _chained_grads(total, ys, list(throughs.values()))


def _chained_grads(total: tf.Tensor, ys: list, throughs: list) -> list:
    """``∂total/∂y`` in the graph whose copied ops are replaced by their copies (``Site.through``:
    the unrolled loops of ``_loops``, the unrolled LSTM/GRU calls of ``_recurrent``).

    With copies ``c`` of op outputs ``o`` (same function of the same inputs), backpropagation
    never differentiates the op (``_not_differentiated``: a ``while`` op, or a function call whose
    function has no gradient in ``Model.fit``'s graph) and continues through its copy instead,
    with the op's output gradient; those are found from the last op to the first (creation order
    is topological), each the gradient of ``total`` and of the later ops' copies. Every path counts
    once: around the ops (a skip connection, an input used twice) through ``total``'s own term,
    through an op only through its copy, through stacked ops (stacked recurrent layers) along the
    chain of copies.
    """
    zero = tf.UnconnectedGradients.ZERO
    order = sorted(throughs, key=lambda th: _op_index(th[0][0].op), reverse=True)
    originals_of = [t for originals, _ in order for t in originals]
    with _not_differentiated({t.op for t in originals_of}):
        ys_of, grad_ys = [total], [None]
        for originals, copies in order:
            grads = tf.gradients(ys_of, list(originals), grad_ys=grad_ys, unconnected_gradients=zero)
            ys_of, grad_ys = ys_of + list(copies), grad_ys + grads
        return tf.gradients(ys_of, ys, grad_ys=grad_ys, unconnected_gradients=zero)


@contextlib.contextmanager
def _not_differentiated(ops: set):
    """While active, ``tf.gradients`` propagates nothing through ``ops`` (their inputs get no
    gradient from them).

    ``stop_gradients`` would not do for a function call: ``tf.gradients`` builds a
    ``SymbolicGradient`` of a call op even when it is a stop op, and tf_keras's
    ``standard_lstm``/``standard_gru`` function has no gradient in ``Model.fit``'s graph (and must
    not be differentiated: its copy stands for it). A gradient function that returns None for
    every input is found before the call's own (``ops.get_gradient_function``).
    """
    saved = {op: op._gradient_function for op in ops}  # pylint: disable=protected-access
    try:
        for op in ops:
            op._gradient_function = _no_gradient  # pylint: disable=protected-access
        yield
    finally:
        for op, fn in saved.items():
            op._gradient_function = fn  # pylint: disable=protected-access


def _no_gradient(op, *grads):
    del grads
    return [None] * len(op.inputs)


def _op_index(op) -> int:
    return op._id  # pylint: disable=protected-access  (creation order within the graph)


def _unclean(loss, analysis, var_list: list) -> list:
    """(variable, op, reason) of every variable when the loss's rows are not proven batch-major."""
    rows = analysis.rows.get(loss.ref())
    order = getattr(rows, "order", None)
    reason = "the loss's rows are not proven to be the examples of the batch in order"
    if order:
        reason = f"op {order!r} reorders the examples of the batch (ghost norms could pair rows with other examples)"
    return [(var, None, reason) for var in var_list]


class FastBackend:
    """Per-example clipped gradient sums from ghost norms (Goodfellow 2015; Li et al. 2022;
    Bu et al. 2023), with per-example jacobians for the variables it cannot analyze.

    ``clipped_sum(loss, var_list, tape, clip_factors)`` returns ``(summed, sq_norms)`` with
    ``sq_norms[i, v] = ‖∂ℓ_i/∂w_v‖²`` and ``summed[v] = Σ_i factors[i, v] · ∂ℓ_i/∂w_v`` where
    ``factors = clip_factors(sq_norms)``.
    """

    name = "fast"

    def __init__(self, jacobian_fallback: str = "warn"):
        """Args: jacobian_fallback: "warn" (a variable no rule reads takes per-example jacobians,
        with one warning per traced step) or "refuse" (ValueError at trace time instead)."""
        self.jacobian_fallback = jacobian_fallback
        # What the last traced step did (filled at trace time): the variables that took per-example
        # jacobians, and why (``_report.PerExampleReport``); ``last_fallback`` lists their names.
        self.last_report: _report.PerExampleReport | None = None
        self._said: _report.PerExampleReport | None = None  # The last report warned about.

    @property
    def last_fallback(self) -> list[str]:
        """Names of the variables that took per-example jacobians in the last traced step."""
        return self.last_report.fallback_variables if self.last_report is not None else []

    def _report(self, var_list: list, fallback: list) -> None:
        """Records the step's :class:`_report.PerExampleReport` (``fallback``: (variable, op, reason)),
        then refuses or warns (``jacobian_fallback``) if any variable took per-example jacobians: one
        warning per traced step, none for a trace (or an eager step) that repeats the last report."""
        slow = {id(var) for var, _, _ in fallback}
        self.last_report = _report.PerExampleReport(
            backend=self.name,
            fast=tuple(v.name for v in var_list if id(v) not in slow),
            fallback=tuple(_report.fallback_of(var, op, reason) for var, op, reason in fallback),
        )
        if self.last_report != self._said:  # a refused report is never said: it raises again
            _report.refuse_or_warn(self.last_report, self.jacobian_fallback)
            self._said = self.last_report

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
            train step; an eager tensor is refused: nothing can be checked).
          var_list: the trainable variables (V of them).
          tape: the GradientTape that recorded `loss` (used for jacobian fallbacks only).
          clip_factors: maps sq_norms [B, V] to factors [B, V].

        Returns:
          (summed, sq_norms): one dense tensor per variable, shaped like it, holding
          Σ_i factors[i, v] · g_i[v] (rows with factor 0 add exactly 0, even if non-finite), and
          the float32 per-example squared norms [B, V].

        Raises:
          ValueError: empty `var_list`, an eager step, `loss` not of rank 1, or an op upstream of
            the loss that mixes the examples of the batch (``_graph.analyze``).
        """
        var_list = list(var_list)
        if not var_list:
            raise ValueError("var_list must hold at least one variable, got an empty list")
        if tf.executing_eagerly() or not hasattr(loss, "graph"):
            refuse_eager()
        if loss.shape.rank != 1:
            raise refuse(
                "loss-entries", f"loss must be a per-example loss of rank 1 (shape [B]), got shape {loss.shape}"
            )
        analysis = _graph.analyze(loss)  # Raises if the loss mixes examples.
        checks = _graph.runtime_checks(loss, analysis)
        # Reordered rows (ghost norms might mis-group them): per-example jacobians are exact (the
        # loss is per example; an unknown op upstream has been refused by `analyze`).
        groups = self._groups(loss, var_list, tape, analysis, checks) if analysis.clean(loss) else None
        if groups is None:
            self._report(var_list, _unclean(loss, analysis, var_list))
            summed, sq_norms = _reference_backend().clipped_sum(loss, var_list, tape, clip_factors, checked=True)
            return _graph.with_checks(summed, checks), _graph.with_checks(sq_norms, checks)
        batch = tf.shape(loss)[0]
        sq_norms = tf.stack([g.sq_norms() if g is not None else tf.zeros([batch]) for g in groups], axis=1)
        sq_norms = _checks.fail_closed(sq_norms)
        factors = tf.cast(clip_factors(sq_norms), tf.float32)
        summed = []
        columns = tf.unstack(factors, num=len(var_list), axis=1)  # one op, not a slice per variable
        for group, var, column in zip(groups, var_list, columns):
            if group is None:
                summed.append(tf.zeros(var.shape, var.dtype))
            else:
                summed.append(tf.cast(group.clipped_sum(column), var.dtype))
        return _graph.with_checks(summed, checks), _graph.with_checks(sq_norms, checks)

    def _groups(self, loss, var_list, tape, clean, checks: list) -> list:
        """One group of per-example uses per variable (None: unused); appends the jacobian
        fallback's run-time checks to ``checks``."""
        ops = _graph.ancestors(loss)
        static_batch = loss.shape[0]
        plans, fallback = [], []
        for var in var_list:
            handles = _state.internal_handles(loss.graph, var)
            stopped = []
            if handles:
                sites = _graph.find_sites(handles, var, ops, clean, static_batch, stopped)
            else:  # no use at all: a zero gradient where that is certain, else the jacobians
                sites = [] if _state.never_read(loss.graph, var, tape) else None
            plans.append(sites)
            if sites is None:
                op, reason = stopped[0] if stopped else (None, "the step's graph does not show the variable")
                fallback.append((var, op, reason))
        self._report(var_list, fallback)  # Raises here with jacobian_fallback="refuse".
        ys, index = [], {}
        for sites in plans:
            for site in sites or ():
                for y in _outputs(site):
                    if y.ref() not in index:
                        index[y.ref()] = len(ys)
                        ys.append(y)
        grads = _output_grads(tf.reduce_sum(loss), ys, plans) if ys else []
        jacobians, _, pfor_checks = per_example_jacobians(loss, [var for var, _, _ in fallback], tape)
        checks += pfor_checks
        jacobians = iter([tf.cast(j, tf.float32) for j in jacobians])
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

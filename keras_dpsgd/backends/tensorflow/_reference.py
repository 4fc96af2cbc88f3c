"""The reference per-example backend: exact per-example jacobians of every variable.

It implements the protocol of ``keras_dpsgd.backends.tensorflow.per_example_backend`` (``clipped_sum(loss, var_list, tape,
clip_factors) -> (summed, sq_norms)``) with ``GradientTape.jacobian``; the fast backend
(``_backend``) uses it for every step, or every variable, that it cannot analyze.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

from keras_dpsgd.backends.tensorflow import _checks, graph as _graph, report as _report, state as _state, uses as _uses
from keras_dpsgd.dp.refusals import refusal_message, refuse

ClipFactorsFn = Callable[[tf.Tensor], tf.Tensor]
# Weights of the examples in the jacobian check (fixed: the check is not a privacy mechanism).
_CHECK_SEED = (18, 2026)
_HALF = (tf.float16, tf.bfloat16)


def per_example_jacobians(loss: tf.Tensor, variables: Sequence[tf.Variable], tape) -> tuple[list, list, list]:
    """Per-example gradients [B, *var.shape] of ``loss`` ([B]) for each variable (pfor), their
    per-example squared norms (float32 [B] each), and the run-time checks that they are right
    (``jacobian_checks``; none in eager mode).

    Raises:
      ValueError: ``tape`` is None, or the loss depends on a grouped convolution (pfor gets its
        per-example gradients wrong).
    """
    if not variables:
        return [], [], []
    if tape is None:
        raise ValueError("tape must be the GradientTape that recorded the loss, got None")
    graph_mode = not tf.executing_eagerly() and hasattr(loss, "graph")
    if graph_mode:
        _graph.refuse_grouped_convolutions(loss)
    jacobians = tape.jacobian(
        loss, list(variables), unconnected_gradients=tf.UnconnectedGradients.ZERO, experimental_use_pfor=True
    )
    # [B, *var.shape]: pfor's shapes for an empty batch (a replica without data) are not the variable's.
    batch = tf.shape(loss)[:1]
    jacobians = [tf.convert_to_tensor(j) for j in jacobians]
    jacobians = [
        tf.reshape(j, tf.concat([batch, v.shape], 0)) if v.shape.is_fully_defined() else j
        for j, v in zip(jacobians, variables)
    ]
    sq_norms = [tf.cast(_sq_norm_per_example(j), tf.float32) for j in jacobians]
    checks = jacobian_checks(loss, list(variables), jacobians, sq_norms) if graph_mode else []
    return jacobians, sq_norms, checks


def jacobian_checks(loss: tf.Tensor, variables: list, jacobians: list, sq_norms: list) -> list:
    """Run-time checks that TensorFlow's vectorized jacobian (pfor) is each example's gradient.

    pfor rewrites every op of the backward pass for a batch of examples; a wrong rewrite (as for
    grouped convolutions) gives wrong per-example gradients without an error. With fixed weights
    ``r_i`` in [0.5, 1.5], one plain backward pass (``tf.gradients``, no pfor) gives
    ``∂(Σ_i r_i ℓ_i)/∂w``, which must equal ``Σ_i r_i J_i`` for the jacobian rows ``J_i`` (a wrong
    row, or rows swapped, changes the sum). Per variable, ``‖Σ_i r_i J_i − ∂(Σ r ℓ)/∂w‖`` must be at
    most ``rtol · (s_w + 0.01 max_v s_v)`` with ``s_w = Σ_i r_i ‖J_i‖ + ‖∂(Σ r ℓ)/∂w‖`` (rtol 1e-3, or
    3e-2 where a 16-bit float is upstream of the loss). A variable with a non-finite gradient is not
    checked (its examples are zeroed anyway).
    """
    batch = tf.shape(loss)[0]
    weights = tf.random.stateless_uniform([batch], seed=_CHECK_SEED, minval=0.5, maxval=1.5)
    plain = tf.gradients(
        loss, variables, grad_ys=tf.cast(weights, loss.dtype), unconnected_gradients=tf.UnconnectedGradients.ZERO
    )
    ancestors = _graph.ancestors(loss)
    rtol = 3e-2 if any(t.dtype in _HALF for op in ancestors for t in op.outputs) else 1e-3
    measured = [_disagreement(j, sq, want, weights, batch) for j, sq, want in zip(jacobians, sq_norms, plain)]
    largest = tf.reduce_max(tf.stack([tf.where(finite, scale, 0.0) for _, scale, finite in measured]))
    checks = []
    for var, (err, scale, finite) in zip(variables, measured):
        message = refusal_message(
            "per-example-check",
            f"keras_dpsgd: TensorFlow's vectorized per-example gradients (pfor jacobian) of variable "
            f"{var.name!r} disagree with its plain gradient, so clipping them would not bound each "
            f"example's contribution; the variable is used by {_users(loss, var, ancestors)}. Replace "
            "that layer, or report this op to keras_dpsgd",
        )
        # A gradient that is 0 in exact arithmetic (an attention key bias) is rounding noise of the
        # size of the other variables' gradients: 1% of the largest scale is allowed too.
        checks += _checks.check(tf.logical_not(finite) | (err <= rtol * (scale + 0.01 * largest)), message)
    return checks


def _disagreement(jac: tf.Tensor, sq_norms: tf.Tensor, want: tf.Tensor, weights: tf.Tensor, batch) -> tuple:
    """(‖Σ_i r_i J_i − want‖, Σ_i r_i ‖J_i‖ + ‖want‖, all finite) for one variable (one pass over
    the jacobian: its rows' norms are given)."""
    size = want.shape.num_elements()  # The variable's: [batch, -1] is ambiguous for an empty batch.
    rows = tf.reshape(tf.cast(jac, tf.float32), [batch, -1 if size is None else size])
    want = tf.reshape(tf.cast(want, tf.float32), [-1])
    got = tf.linalg.matvec(rows, weights, transpose_a=True)
    scale = tf.reduce_sum(weights * tf.sqrt(sq_norms)) + tf.norm(want)
    return tf.norm(got - want), scale, tf.math.is_finite(scale)


def _users(loss: tf.Tensor, var, ancestors: set) -> str:
    """The ops upstream of ``loss`` that read ``var`` (at most three, for messages)."""
    found = []
    for handle in _state.internal_handles(loss.graph, var):
        for read in handle.consumers():
            for t in read.outputs if read.type == "ReadVariableOp" else ():
                found += [f"op {c.name!r} ({c.type})" for c in t.consumers() if c in ancestors]
            if read.type != "ReadVariableOp" and read in ancestors:
                found.append(f"op {read.name!r} ({read.type})")
    return ", ".join(sorted(set(found))[:3]) or "ops the graph does not show"


def _sq_norm_per_example(jac: tf.Tensor) -> tf.Tensor:
    """An upper bound of ||g_i||² for each row i of a [B, ...] Jacobian block (the release sums the same rows:
    a relative rounding margin, ``_uses.certified_sq_norms``)."""
    return _uses.certified_sq_norms(tf.cast(jac, tf.float32))


_CHOSEN = "per_example_backend='reference' computes per-example jacobians of every variable"


class ReferenceBackend:
    """Per-example gradients with ``GradientTape.jacobian`` (pfor).

    Works for every layer that TensorFlow's pfor vectorizes (Dense, Conv,
    Embedding, normalization, recurrent layers, ...) inside the ``tf.function``
    Keras builds, with or without XLA; an eager step is refused (``EAGER_MESSAGE``). It materializes every g_i
    ([B, *variable.shape] per variable), so memory grows with B × parameters.
    """

    name = "reference"
    last_report: _report.PerExampleReport | None = None  # Set by each call: every variable, by choice.

    def clipped_sum(
        self,
        loss: tf.Tensor,
        var_list: Sequence[tf.Variable],
        tape: tf.GradientTape,
        clip_factors: ClipFactorsFn,
        checked: bool = False,
    ) -> tuple[list[tf.Tensor], tf.Tensor]:
        """Steps 1-3: per-example gradients, clip, sum.

        Args:
          loss: per-example loss, shape [B], recorded on `tape`.
          var_list: the trainable variables (V of them).
          tape: the tape that recorded the forward pass.
          clip_factors: maps sq_norms [B, V] to factors [B, V].
          checked: the caller has already run the graph check of the loss
            (``keras_dpsgd.backends.tensorflow.graph.analyze``) and attaches its run-time
            assertions itself.

        Returns:
          (summed, sq_norms): the clipped sums, one dense tensor per
          variable, and the per-example squared norms [B, V].

        Raises:
          ValueError: the step runs eagerly (nothing can be checked), an op
            upstream of the loss mixes the examples of the batch, or the loss
            does not have one entry per example (a jacobian per row cannot make
            that private either).
        """
        if tf.executing_eagerly() or not hasattr(loss, "graph"):
            refuse_eager()
        self.last_report = _report.PerExampleReport(
            self.name, (), tuple(_report.fallback_of(v, None, _CHOSEN) for v in var_list)
        )
        checks = [] if checked else _graph.runtime_checks(loss, _graph.analyze(loss))
        jacobians, sq_norms, pfor_checks = per_example_jacobians(loss, list(var_list), tape)
        checks += pfor_checks
        sq_norms = tf.stack(sq_norms, axis=1)
        sq_norms = _checks.fail_closed(sq_norms)
        factors = clip_factors(sq_norms)
        summed = []
        for v, jac in enumerate(jacobians):
            f_v = tf.cast(factors[:, v], jac.dtype)
            # 0 · NaN would be NaN: zeroed examples contribute exactly 0.
            keep = tf.reshape(f_v > 0, [-1] + [1] * (jac.shape.rank - 1))
            jac = tf.where(keep, jac, tf.zeros_like(jac))
            summed.append(tf.tensordot(f_v, jac, axes=[[0], [0]]))
        if checks:
            with tf.control_dependencies(checks):
                summed = [tf.identity(s) for s in summed]
                sq_norms = tf.identity(sq_norms)
        return summed, sq_norms


EAGER_MESSAGE = (
    "keras_dpsgd refuses to run a DP-SGD step eagerly (compile(..., run_eagerly=True), "
    "tf.config.run_functions_eagerly(True), or the optimizer called outside a tf.function): without the "
    "traced graph it cannot check that each example's loss depends on that example alone (no op mixing the "
    "batch, no statistic of the batch kept in a variable), and an unchecked step may let one example move "
    "the update by more than the clipping bound. Remove run_eagerly=True (fit traces the step, the default), "
    "or wrap a custom step in tf.function. To debug, call the model eagerly outside the DP step "
    "(model(x, training=True)), or print from inside the traced step with tf.print."
)


def refuse_eager() -> None:
    """Raises ValueError: a DP step that runs eagerly cannot be checked (``EAGER_MESSAGE``)."""
    raise refuse("eager-step", EAGER_MESSAGE)

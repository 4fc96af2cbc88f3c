"""The reference per-example backend: exact per-example jacobians of every variable.

It implements the protocol of ``keras_dpsgd._per_example`` (``clipped_sum(loss, var_list, tape,
clip_factors) -> (summed, sq_norms)``) with ``GradientTape.jacobian``; the fast backend
(``_backend``) uses it for every step, or every variable, that it cannot analyze.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import tensorflow as tf

from keras_dpsgd._fast import _graph

ClipFactorsFn = Callable[[tf.Tensor], tf.Tensor]


def _sq_norm_per_example(jac: tf.Tensor) -> tf.Tensor:
    """||g_i||² for each row i of a [B, ...] Jacobian block."""
    flat = tf.reshape(jac, [tf.shape(jac)[0], -1])
    return tf.reduce_sum(tf.square(flat), axis=1)


class ReferenceBackend:
    """Per-example gradients with ``GradientTape.jacobian`` (pfor).

    Works for every layer that TensorFlow's pfor vectorizes (Dense, Conv,
    Embedding, normalization, recurrent layers, ...) inside the ``tf.function``
    Keras builds, under XLA and eagerly. It materializes every g_i
    ([B, *variable.shape] per variable), so memory grows with B × parameters.
    """

    name = "reference"

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
            (``keras_dpsgd._fast._graph.analyze``) and attaches its run-time
            assertions itself.

        Returns:
          (summed, sq_norms): the clipped sums, one dense tensor per
          variable, and the per-example squared norms [B, V].

        Raises:
          ValueError: in a traced step, an op upstream of the loss mixes the
            examples of the batch, or the loss does not have one entry per
            example (a jacobian per row cannot make that private either).
        """
        checks = []
        if not checked and not tf.executing_eagerly() and hasattr(loss, "graph"):
            checks = _graph.runtime_checks(loss, _graph.analyze(loss))
        elif not checked:
            _warn_unchecked_eager()
        if not tf.executing_eagerly() and hasattr(loss, "graph"):
            _graph.refuse_grouped_convolutions(loss)
        jacobians = tape.jacobian(
            loss,
            list(var_list),
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
            experimental_use_pfor=True,
        )
        jacobians = [tf.convert_to_tensor(j) for j in jacobians]
        sq_norms = tf.stack([tf.cast(_sq_norm_per_example(j), tf.float32) for j in jacobians], axis=1)
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


_EAGER_WARNING = (
    "keras_dpsgd: this DP step runs eagerly (run_eagerly=True or an eager custom loop): there is no graph, so "
    "the check that the loss has one entry per example and that no op mixes the examples of the batch "
    "(batch statistics, a batch mean, rows reordered) cannot run, and the privacy guarantee rests on the "
    "model being per example. Train in a tf.function (the default of fit) to have it checked."
)
_eager_warned = []


def _warn_unchecked_eager() -> None:
    """Says once per process, loudly, that an eager step's per-example property is not checked."""
    if not _eager_warned:
        _eager_warned.append(True)
        logging.getLogger("keras_dpsgd").warning(_EAGER_WARNING)

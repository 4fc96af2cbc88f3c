"""The batch of an eager loss callable traced by the optimizer (``keras_dpsgd.step.eager``): TF Privacy's custom
loops call ``minimize(loss_fn, var_list)`` outside any ``tf.function``, with the data captured by ``loss_fn``
instead of passed as the step's arguments. The per-example analysis (``graph.analyze``) takes what
:func:`eager_batch` names as the step's inputs in such a trace, and nothing else changes.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from keras_dpsgd.dp.refusals import refuse

__all__ = ["eager_batch", "mark_eager_loss"]

_EAGER_LOSS = "_keras_dpsgd_eager_loss_trained"


def mark_eager_loss(trained: list) -> None:
    """Marks the graph being traced as the trace of an eager loss callable (``keras_dpsgd.step.eager``)
    whose trained variables are `trained`: its batch is read from captures (:func:`eager_batch`)."""
    setattr(tf.compat.v1.get_default_graph(), _EAGER_LOSS, list(trained))


def eager_batch(graph: Any, loss: tf.Tensor, ops: list) -> frozenset:
    """The batch of a traced eager loss callable (:func:`mark_eager_loss`; elsewhere none): refs of the tensors
    the callable captured (eager tensors and arrays; TensorFlow inlines the small ones as constants, still
    listed as captures), of the constants with B rows (numpy arrays it reads become constants) and of its reads
    of variables other than the trained ones, with B rows, B the loss's static batch size. They are the step's
    inputs (each row one example). A captured tensor of another shape may be data the analysis cannot place
    (a statistic of the batch, the batch transposed): refused. Other variables are weights, and other
    constants (a layer's, an array of another shape) public constants, as in a train step: a statistic of the
    data computed outside the callable is the caller's own release.

    Raises:
      ValueError: the loss's batch size is not static, or a captured tensor is not of B rows.
    """
    trained = getattr(graph, _EAGER_LOSS, None)
    if trained is None:
        return frozenset()
    if loss.shape.rank in (None, 0) or loss.shape[0] is None:
        raise refuse(
            "no-input", _EAGER_BATCH_MESSAGE.format(what=f"the loss has no static batch size (shape {loss.shape})")
        )
    b = loss.shape[0]
    handles = {id(v.handle) for v in trained}
    pairs = list(getattr(graph, "captures", ()))
    captured = {inner.ref() for outer, inner in pairs if inner.dtype != tf.resource}
    trained_handles = {inner.ref() for outer, inner in pairs if id(outer) in handles}
    inputs = set()
    for op in ops:
        out = op.outputs[0] if op.outputs else None
        if out is None:
            continue
        if op.type == "ReadVariableOp":
            if op.inputs[0].ref() not in trained_handles and out.shape.rank not in (None, 0) and out.shape[0] == b:
                inputs.add(out.ref())
        elif out.ref() in captured:
            if out.shape.rank in (None, 0) or out.shape[0] != b:
                raise refuse(
                    "no-input",
                    _EAGER_BATCH_MESSAGE.format(
                        what=f"it reads a captured tensor of shape {out.shape}, whose first dimension is not the "
                        f"loss's {b}"
                    ),
                )
            inputs.add(out.ref())
        elif op.type == "Const" and out.shape.rank not in (None, 0) and out.shape[0] == b:
            inputs.add(out.ref())  # an array of B rows the callable reads (numpy arrays become constants)
    return frozenset(inputs)


_EAGER_BATCH_MESSAGE = (
    "keras_dpsgd cannot find the batch of the loss callable given to an eager minimize/compute_gradients: {what}. "
    "In a traced eager loss callable the batch is every captured tensor (array, tf.constant) or variable (other "
    "than the trained ones) whose first dimension is the loss's batch size, one row per example; a captured "
    "tensor of another shape may be data that the per-example analysis cannot place, so it is refused. Compute "
    "such values inside the callable from the batch's rows, or run the step in a tf.function that takes the "
    "batch as its arguments."
)

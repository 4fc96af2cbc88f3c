"""Eager custom loops in TF Privacy's style: ``opt.minimize(loss_fn, var_list)`` and ``opt.compute_gradients``
called outside any ``tf.function``.

A DP step is checked on its graph (the per-example analysis of the loss, the refusal of layers that mix
examples and of writes of the batch into variables): an eager step has no graph, so it proves nothing and is
refused (``keras_dpsgd.backends.tensorflow``'s eager refusal). A loss *callable* can be traced, though: the
optimizer calls its own method again inside a ``tf.function`` of its own, where the callable runs under the
tape as in a traced train step, so exactly the same checks run on it and the step is refused only where they
refuse it. The batch of such a step is what the callable reads whose first dimension is the loss's (static)
batch size B, other than the trained variables: captured tensors (arrays, ``tf.constant``) or variables
(TF Privacy's tests keep their data in a ``tf.Variable``); each of their rows is one example, and the analysis
proves that example i's loss depends on row i alone. Anything else the callable reads is a constant, as the
model's weights are (a statistic of the data computed outside the callable is the caller's release). The trace is made afresh at every eager call (the callable may close over new Python values), which
costs a trace per step: announced once per optimizer; a loop whose step is a ``tf.function`` traces once.

What stays refused: an eager loss *tensor* recorded on the caller's tape (it was computed already; there is
nothing to trace) and ``tf.config.run_functions_eagerly(True)`` (the function would run eagerly).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import tensorflow as tf

from keras_dpsgd.backends.tensorflow.eager_loss import mark_eager_loss

__all__ = ["recorded", "traced_eagerly", "traced_step"]

_LOG = logging.getLogger("keras_dpsgd")


def traced_eagerly(loss: Any, tape: Any) -> bool:
    """True where the optimizer must trace the step itself: a loss callable, no tape, outside any trace."""
    return callable(loss) and tape is None and tf.executing_eagerly()


def traced_step(optimizer: Any, method: str, var_list: list, step: Callable[[], Any]) -> list:
    """Runs `step` (the optimizer's `method` called again on `var_list`, now inside the trace) in a
    ``tf.function`` of the optimizer's; returns its gradients (a list of tensors; none for ``minimize``).

    In that trace the batch is what the loss callable reads with the loss's first dimension B, other than
    `var_list` (``keras_dpsgd.backends.tensorflow.eager_loss.eager_batch``): captured tensors, or variables."""
    if not getattr(optimizer, "_keras_dpsgd_eager_announced", False):
        _LOG.warning(
            "keras_dpsgd: %s.%s called eagerly with a loss callable: the step is traced in a tf.function at "
            "every call (the DP graph checks run on it). Wrap the loop's step in tf.function to trace it once.",
            type(optimizer).__name__,
            method,
        )
        optimizer._keras_dpsgd_eager_announced = True

    def traced():
        mark_eager_loss(var_list)
        out = step()
        if out is None:
            return []
        return [g if not isinstance(g, tuple) else g[0] for g in out]

    return tf.function(traced, autograph=False)()  # the loss callable as written (no AutoGraph rewrite)


def recorded(loss: Callable[[], Any], watched: list) -> tuple:
    """``loss()`` recorded on a new tape watching `watched` (inside the trace): (per-example loss, tape)."""
    with tf.GradientTape() as tape:
        tape.watch(watched)
        values = loss()
    return values, tape

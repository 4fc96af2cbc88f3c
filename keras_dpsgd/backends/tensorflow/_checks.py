"""Run-time checks of the per-example backends, also where XLA compiles the step.

The backends assert at run time what a trace cannot prove (sizes known only at run time, that an
unrolled copy equals its loop, that TensorFlow's vectorized jacobian equals the plain gradient).
XLA ignores ``Assert`` ops (``jit_compile=True``: ``tf.debugging.assert_*`` and ``check_numerics``
pass whatever their input), so inside an XLA-compiled step each check is recorded as a verdict
instead, and :func:`fail_closed` makes every example's squared norm NaN in a step where one
verdict is false: the sanitizer then zeroes every example of that batch (a factor of 0, counted
as non-finite), so the step releases noise only. Never a silent pass.
"""

from __future__ import annotations

import logging
import weakref

import tensorflow as tf
from tensorflow.python.ops import control_flow_util

_VERDICTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_XLA_WARNING = (
    "keras_dpsgd: this DP step is compiled with XLA (jit_compile=True), which ignores run-time "
    "assertions; its run-time checks (one loss entry per example, unrolled recurrent copies, the "
    "per-example jacobian) instead drop every example of a batch that fails one: that batch adds "
    "noise only and its examples are counted as non-finite. Compile with jit_compile=False to get "
    "the error instead."
)
_warned = []


def under_xla(graph) -> bool:
    """Whether ops built in ``graph`` run XLA-compiled (a ``jit_compile=True`` function)."""
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def check(ok: tf.Tensor, message: str) -> list:
    """A run-time check that ``ok`` (a scalar bool) holds: an ``Assert`` op (a list for
    ``tf.control_dependencies``), or under XLA a verdict for :func:`fail_closed` (an empty list)."""
    graph = ok.graph
    if under_xla(graph):
        if not _warned:
            _warned.append(True)
            logging.getLogger("keras_dpsgd").warning(_XLA_WARNING)
        _VERDICTS.setdefault(graph, []).append(ok)
        return []
    return [tf.debugging.Assert(ok, [message])]


def fail_closed(sq_norms: tf.Tensor) -> tf.Tensor:
    """``sq_norms`` [B, V], or NaN everywhere where an XLA verdict of its graph is false."""
    if tf.executing_eagerly():
        return sq_norms  # No graph: no verdicts (an eager step is refused, see ``_reference``).
    verdicts = _VERDICTS.get(sq_norms.graph)
    if not verdicts:
        return sq_norms
    ok = tf.reduce_all(tf.stack(verdicts))
    return tf.where(ok, sq_norms, tf.fill(tf.shape(sq_norms), tf.constant(float("nan"), sq_norms.dtype)))

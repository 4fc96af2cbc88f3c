"""Per-example gradient backends for the DP-SGD sanitizer.

A backend computes steps 1-3 of the sanitizer (Abadi et al. 2016, Algorithm 1:
per-example gradients g_i, clipping, sum) in one call, so that a fast
implementation may fuse them and never materialize every g_i:

    summed[v] = Σ_i factors[i, v] · g_i[v]

where ``factors = clip_factors(sq_norms)`` and ``sq_norms[i, v] = ||g_i[v]||²``
(one column per trainable variable v). The result is *unnoised*; the sanitizer
adds the noise and normalizes.

Protocol (``PerExampleBackend``):

* ``clipped_sum(loss, var_list, tape, clip_factors) -> (summed, sq_norms)``
  with ``loss`` the per-example loss of shape [B] recorded on ``tape``,
  ``summed`` a list of dense tensors shaped like ``var_list`` and ``sq_norms``
  a float32 tensor [B, V].
* An example whose factor is 0 contributes exactly 0 to ``summed``, even when
  its gradient holds NaN or Inf (the sanitizer zeroes non-finite examples this
  way; ``0 · NaN`` must not poison the lot).
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any, Callable, Protocol, Sequence

import tensorflow as tf
import tf_keras as keras

ClipFactorsFn = Callable[[tf.Tensor], tf.Tensor]

BACKEND_NAMES = ("auto", "reference", "fast")
_FAST_MODULE = "keras_dpsgd._fast"

_SCALAR_LOSS_MESSAGE = (
    "{cls} needs the per-example loss (shape [batch_size]) but got a loss of shape {shape}: "
    "it was reduced over the batch. Compile with an unreduced loss, e.g. "
    "model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy("
    "from_logits=True, reduction=\"none\")) or reduction=keras.losses.Reduction.NONE "
    "(string losses such as loss=\"mse\" are reduced)."
)


class PerExampleBackend(Protocol):
    """What the sanitizer needs from a per-example gradient backend."""

    def clipped_sum(
        self,
        loss: tf.Tensor,
        var_list: Sequence[tf.Variable],
        tape: tf.GradientTape,
        clip_factors: ClipFactorsFn,
    ) -> tuple[list[tf.Tensor], tf.Tensor]:
        """Returns (Σ_i factors[i, v] g_i[v] for each v, sq_norms [B, V])."""


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
            from keras_dpsgd._fast import _graph

            checks = _graph.runtime_checks(loss, _graph.analyze(loss))
        elif not checked:
            _warn_unchecked_eager()
        jacobians = tape.jacobian(
            loss,
            list(var_list),
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
            experimental_use_pfor=True,
        )
        jacobians = [tf.convert_to_tensor(j) for j in jacobians]
        sq_norms = tf.stack(
            [tf.cast(_sq_norm_per_example(j), tf.float32) for j in jacobians], axis=1
        )
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


def resolve_backend(name: str = "auto") -> PerExampleBackend:
    """Returns the per-example gradient backend called `name`.

    Args:
      name: "auto" (the fast backend of ``keras_dpsgd._fast`` when that module
        exists, else the reference one), "reference" or "fast".

    Returns:
      A backend instance.

    Raises:
      ValueError: if `name` is not one of the allowed names.
      ModuleNotFoundError: for "fast" when ``keras_dpsgd._fast`` is missing.
      Any error raised while importing an existing ``keras_dpsgd._fast``
      propagates (a broken fast backend is never silently replaced).
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"per_example_backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "reference":
        return ReferenceBackend()
    try:
        module = importlib.import_module(_FAST_MODULE)
    except ModuleNotFoundError as err:
        if name == "auto" and err.name == _FAST_MODULE:
            return ReferenceBackend()
        raise
    return module.FastBackend()


# ------------------------------------------- preconditions of per-example gradients
def find_calling_model(optimizer: Any, max_depth: int = 16) -> keras.Model | None:
    """The tf_keras Model whose train step is calling `optimizer`, if any.

    The optimizer API never receives the model, so the call stack is searched
    for a ``self`` that is a Model compiled with this optimizer (Keras's
    ``train_step`` calls ``self.optimizer.minimize``). Returns None in a custom
    training loop outside a Model method.
    """
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, keras.Model) and getattr(obj, "optimizer", None) is optimizer:
            return obj
        frame = frame.f_back
    return None


def _mixes_examples(layer: Any) -> bool:
    from tf_keras.src.layers.normalization import batch_normalization

    return (
        isinstance(layer, batch_normalization.BatchNormalizationBase)
        or "BatchNorm" in type(layer).__name__
        or bool(getattr(layer, "mixes_examples", False))
    )


def refuse_example_mixing(model: keras.Model | None, var_list: Sequence[tf.Variable]) -> None:
    """Raises ValueError if a layer mixes the examples of a batch in training.

    With BatchNormalization one example changes every other example's output
    (batch statistics), so per-example clipping no longer bounds its
    influence. The model's layers are inspected (BatchNormalization and its
    subclasses, any class named *BatchNorm*, any layer with a true
    ``mixes_examples`` attribute); without a model (custom loop), the
    variable names are checked for Keras's batch-normalization naming.
    """
    hint = (
        "DP-SGD clips each example's gradient, which is meaningless when a layer mixes the "
        "examples of a batch (batch statistics). Replace {what} with "
        "keras.layers.GroupNormalization or keras.layers.LayerNormalization."
    )
    if model is not None:
        for layer in model.submodules:
            if isinstance(layer, keras.layers.Layer) and _mixes_examples(layer):
                raise ValueError(hint.format(what=f"layer {layer.name!r} ({type(layer).__name__})"))
        return
    for var in var_list:
        if "batch_normalization" in var.name or "batchnorm" in var.name.lower():
            raise ValueError(hint.format(what=f"the layer owning variable {var.name!r}"))


def per_example_loss(loss: tf.Tensor, tape: tf.GradientTape, cls_name: str) -> tf.Tensor:
    """Checks the loss is per example and averages any non-batch axes to [B]."""
    loss = tf.convert_to_tensor(loss)
    if loss.shape.rank == 0:
        raise ValueError(_SCALAR_LOSS_MESSAGE.format(cls=cls_name, shape=loss.shape))
    if loss.shape.rank is None:
        raise ValueError(f"{cls_name} needs a per-example loss of known rank, got shape {loss.shape}")
    if loss.shape.rank > 1:
        # Same weighting as SUM_OVER_BATCH_SIZE: mean over the B × T values.
        with tape:
            loss = tf.reduce_mean(loss, axis=list(range(1, loss.shape.rank)))
    return loss

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

from typing import TYPE_CHECKING, Any, Protocol, Sequence

import tensorflow as tf

from keras_dpsgd.backends.tensorflow import mixing as _mixing
from keras_dpsgd.backends.tensorflow._backend import FastBackend
from keras_dpsgd.backends.tensorflow._reference import ClipFactorsFn, ReferenceBackend
from keras_dpsgd.dp.refusals import refuse

# "auto" and "fast": FastBackend; "reference": ReferenceBackend.
PER_EXAMPLE_CHOICES = ("auto", "reference", "fast")

if TYPE_CHECKING:
    import tf_keras as keras  # imported where used: the Keras 3 front end must not load tf_keras


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


def resolve_backend(name: str = "auto", jacobian_fallback: str = "warn") -> PerExampleBackend:
    """Returns the per-example gradient backend called `name`.

    Args:
      name: "auto" or "fast" (``keras_dpsgd.backends.tensorflow.FastBackend``: ghost norms where the graph
        is understood, per-example jacobians elsewhere) or "reference" (per-example jacobians
        of every variable, ``keras_dpsgd.backends.tensorflow.ReferenceBackend``).
      jacobian_fallback: the fast backend's answer to a variable no rule reads: "warn" (it takes
        per-example jacobians, one warning per traced step) or "refuse" (ValueError).

    Returns:
      A backend instance.

    Raises:
      ValueError: if `name` is not one of the allowed names.
    """
    if name not in PER_EXAMPLE_CHOICES:
        raise ValueError(f"per_example_backend must be one of {PER_EXAMPLE_CHOICES}, got {name!r}")
    if name == "reference":
        return ReferenceBackend()
    return FastBackend(jacobian_fallback)


# ------------------------------------------- preconditions of per-example gradients
def _is_batch_norm(layer: Any) -> bool:
    from tf_keras.src.layers.normalization import batch_normalization

    return isinstance(layer, batch_normalization.BatchNormalizationBase) or "BatchNorm" in type(layer).__name__


def refuse_example_mixing(model: keras.Model | None, var_list: Sequence[tf.Variable], loss: tf.Tensor | None) -> None:
    """Raises ValueError if a layer mixes the examples of a batch in this step (``keras_dpsgd.backends.tensorflow.mixing``).

    With BatchNormalization in training mode one example changes every other example's output
    (batch statistics), so per-example clipping no longer bounds its influence. A frozen
    BatchNormalization (``trainable = False``: inference mode) is accepted when the traced step
    proves it: no write to its moving statistics, no batch statistics upstream of `loss`. Layers of
    `model` (BatchNormalization and its subclasses, any class named *BatchNorm*, any layer with a
    true ``mixes_examples`` attribute) are checked; without a model (custom loop), a variable of
    `var_list` named like Keras's batch normalization is refused.
    """
    if model is not None:
        import tf_keras as keras

        layers = [layer for layer in model.submodules if isinstance(layer, keras.layers.Layer)]
        _mixing.refuse_example_mixing(layers, loss, _is_batch_norm)
        return
    for var in var_list:
        if "batch_normalization" in var.name or "batchnorm" in var.name.lower():
            raise refuse(
                "batch-statistics",
                f"Variable {var.name!r} is trained and belongs to a batch normalization layer, which mixes the "
                "examples of a batch in training (batch statistics): DP-SGD clips each example's gradient, "
                "which bounds nothing then. " + _mixing.FREEZE_HINT,
            )

"""Augmentation multiplicity (De et al. 2022, Sec 3.3): K augmented views of each example, averaged
into ONE per-example loss before clipping. The same on both Kerases; each front end's
``make_private`` supplies how a layer is called in training mode.

For a batch of B examples the step

1. draws K views of the batch, each with a call of its own to the augmentation (fresh randomness
   per view, also for a layer or callable that draws one transform per call):
   ``v_k = augmentation(x)``, k = 1..K (:func:`views`);
2. lays them out example-major, ``[B, K, ...] -> [B·K, ...]``: rows ``i·K .. i·K+K-1`` are the views
   of example i, and repeats the targets and sample weights the same way (:func:`repeat`);
3. runs the model on the B·K rows and takes the compiled loss of each view, ``ℓ_ik``;
4. averages the views of each example, ``ℓ_i = (1/K) Σ_k ℓ_ik`` (:func:`mean_over_views`: a reshape
   ``[B·K] -> [B, K]`` and a mean over the second axis).

The per-example machinery then sees B examples and their loss [B], as without augmentation: its
gradient is ``g_i = (1/K) Σ_k ∇ℓ_ik``, the mean of the views' gradients, and g_i is what is clipped.
One example still contributes one clipped vector of norm <= C, so the sensitivity, the noise and the
ledger are those of the step without augmentation: nothing is charged for K.

No mixing across examples: the graph analysis of the per-example backends
(``keras_dpsgd.backends.tensorflow._rows``) reads the whole traced step from the inputs, the views
included; the stack and reshape keep example i in its own block of K rows (a ``Rows`` with k = K),
the reshape of step 4 takes each block back to one row, and an augmentation that pairs rows of two
examples (MixUp, CutMix, a batch statistic) is refused there as mixing, naming its op, before any
update. The logged loss and metrics are the means over the views (over the real rows of a Poisson
lot, as without augmentation: a padding row's K views keep its sample weight 0).
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from keras_dpsgd import _validate as V
from keras_dpsgd.dp.refusals import refuse

__all__ = ["Augmentation", "check_augmentation", "mean_over_views", "repeat", "views"]

# A guard against a typo (K = 1000 multiplies the step's memory and time by 1000); De et al. use K <= 32.
MAX_MULTIPLICITY = 256


class Augmentation:
    """The checked augmentation settings of a private train step: the views' maker and K.

    Args:
      augmentation: a Keras layer (called with ``training=True``) or a callable ``x -> x'`` applied
        to the batch once per view; None: the views are copies of the batch, which the model's own
        random layers (``keras.layers.RandomTranslation`` ... inside the model) make differ.
      multiplicity: K, views per example (1: no augmentation multiplicity; with `augmentation`,
        one augmented view per example).
      call: the front end's call of a layer in training mode, ``call(augmentation, x)``.
    """

    def __init__(self, augmentation: Any, multiplicity: int, call: Callable[[Any, Any], Any]):
        self.augmentation = augmentation
        self.multiplicity = multiplicity
        self._call = call

    @property
    def active(self) -> bool:
        """False when the step is the plain private step (no augmentation, K = 1)."""
        return self.augmentation is not None or self.multiplicity > 1

    def views(self, x: Any) -> Any:
        """The K views of `x`, example-major ([B·K, ...] per leaf): :func:`views`."""
        return views(x, self.multiplicity, None if self.augmentation is None else self._draw)

    def repeat(self, value: Any) -> Any:
        """`value` (targets, sample weights) with each row repeated K times: :func:`repeat`."""
        return repeat(value, self.multiplicity)

    def mean_over_views(self, loss: Any) -> Any:
        """The per-example loss [B, ...] from the views' loss [B·K, ...]: :func:`mean_over_views`."""
        return mean_over_views(loss, self.multiplicity)

    def _draw(self, x: Any) -> Any:
        return self._call(self.augmentation, x)


def check_augmentation(augmentation: Any, augmentation_multiplicity: Any) -> tuple[Any, int]:
    """The checked (augmentation, K) of ``make_private``.

    Raises:
      ValueError: K not an integer in [1, MAX_MULTIPLICITY] (naming ``augmentation_multiplicity``).
      TypeError: `augmentation` is neither None nor callable; K of the wrong type.
    """
    k = V.integer_in_range(1, MAX_MULTIPLICITY, augmentation_multiplicity=augmentation_multiplicity)
    if augmentation is not None and not callable(augmentation):
        raise TypeError(
            "augmentation must be None, a Keras layer or a callable x -> augmented x (e.g. "
            f"keras.layers.RandomTranslation(0.1, 0.1)), got {augmentation!r} ({type(augmentation).__name__})"
        )
    return augmentation, k


def views(x: Any, multiplicity: int, draw: Callable[[Any], Any] | None) -> Any:
    """K views of the batch `x` (a tensor or a nest of them), example-major.

    Each view is ``draw(x)`` (one call per view: fresh randomness), or `x` itself without `draw`;
    each leaf ``[B, ...]`` becomes ``[B·K, ...]`` with the K views of example i in rows
    ``i·K .. i·K+K-1`` (a stack on axis 1, then a reshape that merges it with the batch axis).
    """
    drawn = [x if draw is None else draw(x) for _ in range(multiplicity)]
    if multiplicity == 1:
        return drawn[0]
    return tf.nest.map_structure(lambda *leaves: _merge(tf.stack(leaves, axis=1)), *drawn)


def repeat(value: Any, multiplicity: int) -> Any:
    """`value` (a tensor, nest or None) with each row repeated K times in place: [B, ...] -> [B·K, ...].

    Row ``i·K + k`` is row i, as in :func:`views`, so the targets and sample weights of a view are
    its example's.
    """
    if multiplicity == 1:
        return value

    def one(leaf):
        if leaf is None:
            return None
        leaf = tf.convert_to_tensor(leaf)
        shape = tf.concat([tf.shape(leaf)[:1], [multiplicity], tf.shape(leaf)[1:]], axis=0)
        return _merge(tf.broadcast_to(tf.expand_dims(leaf, 1), shape))

    return tf.nest.map_structure(one, value)


def mean_over_views(loss: Any, multiplicity: int) -> tf.Tensor:
    """ℓ_i = (1/K) Σ_k ℓ_ik: the loss of the views [B·K, ...] averaged per example to [B, ...].

    Raises:
      ValueError: a scalar loss (reduced over the batch: there is no view to average).
    """
    if multiplicity == 1:
        return loss
    loss = tf.convert_to_tensor(loss)
    if loss.shape.rank == 0:
        raise refuse(
            "loss-entries",
            f"augmentation_multiplicity={multiplicity} needs the loss of each view (shape [batch_size·K]) but got "
            "a scalar: it was reduced over the batch. Compile with an unreduced loss (reduction=None / 'none').",
        )
    shape = tf.concat([[-1, multiplicity], tf.shape(loss)[1:]], axis=0)
    return tf.reduce_mean(tf.reshape(loss, shape), axis=1)


def _merge(stacked: tf.Tensor) -> tf.Tensor:
    """[B, K, ...] -> [B·K, ...], keeping the static shape where it is known."""
    inner = stacked.shape[2:]
    if inner.is_fully_defined():
        return tf.reshape(stacked, [-1, *inner.as_list()])
    dims = tf.shape(stacked)
    return tf.reshape(stacked, tf.concat([[-1], dims[2:]], axis=0))

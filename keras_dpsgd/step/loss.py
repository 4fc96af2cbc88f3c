"""What the DP step takes from the model, the same on both Kerases: the per-example loss and the
gradient of the weight regularization.

- :func:`per_example_values`: the loss must be per example (shape [B]); a loss reduced over the
  batch is refused, other axes (time steps ...) are averaged on the tape.
- :func:`regularization_gradients`: a data-independent term (weight regularizers) is added to the
  sanitized gradient un-clipped and un-noised (post-processing); its gradient is taken on its own
  tape (a function of the weights) or on the step's persistent tape (a tensor).
- :func:`refuse_data_losses`: ``add_loss`` terms beyond the weight regularizers (activity
  regularizers, losses of the data) may depend on the data and are refused.

Each front end finds these in its own Keras (``keras_dpsgd.tf_keras._sanitizer``, ``keras_dpsgd.tf_keras._train_step``,
``keras_dpsgd.keras3._train_step``) and passes its own wording of the refusal.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf
from keras_dpsgd.dp.refusals import refuse

SCALAR_LOSS_MESSAGE = (
    "{cls} needs the per-example loss (shape [batch_size]) but got a loss of shape {shape}: "
    "it was reduced over the batch. Compile with an unreduced loss, e.g. "
    "model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy("
    'from_logits=True, reduction="none")) or reduction=keras.losses.Reduction.NONE '
    '(string losses such as loss="mse" are reduced).'
)

_DATA_LOSSES_MESSAGE = (
    "the model added {extra} loss term(s) with add_loss (e.g. an activity_regularizer): they may "
    "depend on the data, so their gradient cannot be added without clipping and noise. Fold them "
    "into the per-example loss in your own {own_step}, or use weight regularizers (kernel_regularizer), "
    "which the private step adds un-noised."
)


def per_example_values(
    loss: Any, tape: tf.GradientTape, reduced: Callable[[Any], str], unknown_rank: Callable[[Any], str] | None = None
) -> tf.Tensor:
    """The per-example loss [B]: its non-batch axes averaged on `tape` (the weighting of
    SUM_OVER_BATCH_SIZE: a mean over the B × T values).

    Args:
      loss: the loss, shape [B, ...].
      tape: the tape that recorded it (the mean is recorded on it too).
      reduced: the refusal of a loss reduced over the batch, given its shape.
      unknown_rank: the refusal of a loss of unknown rank, given its shape; None: `reduced`'s.

    Raises:
      ValueError: a scalar loss, or one of unknown rank.
    """
    loss = tf.convert_to_tensor(loss)
    rank = loss.shape.rank
    if rank == 0 or (rank is None and unknown_rank is None):
        raise refuse("loss-entries", reduced(loss.shape))
    if rank is None:
        raise refuse("loss-entries", unknown_rank(loss.shape))
    if rank > 1:
        with tape:
            loss = tf.reduce_mean(loss, axis=list(range(1, rank)))
    return loss


def regularization_gradients(
    regularization: Any, variables: Sequence[Any], tape: tf.GradientTape, what: str
) -> list[tf.Tensor] | None:
    """The gradient of a data-independent regularization term, one tensor per variable (or None).

    Args:
      regularization: None; a function of the weights only (differentiated on a tape of its own);
        or a scalar recorded on `tape`, which must then be persistent.
      variables: the trainable variables (TensorFlow variables), in the step's order.
      tape: the step's tape.
      what: how the caller's refusal names a tensor `regularization`.

    Raises:
      ValueError: a tensor `regularization` on a tape that is not persistent.
    """
    if regularization is None:
        return None
    if callable(regularization):
        with tf.GradientTape() as own_tape:
            own_tape.watch(variables)
            value = regularization()
        grads = own_tape.gradient(value, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    elif not getattr(tape, "_persistent", False):
        raise ValueError(
            f"{what} needs tf.GradientTape(persistent=True): the regularization gradient "
            "and the per-example gradients are two tape queries"
        )
    else:
        grads = tape.gradient(regularization, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [tf.convert_to_tensor(g) for g in grads]


def regularization_sum(values: Sequence[Any]) -> tf.Tensor:
    """Σ of the regularization terms' values (each summed to a scalar), in float32."""
    return tf.add_n([tf.cast(tf.reduce_sum(v), tf.float32) for v in values])


def refuse_data_losses(num_losses: int, num_weight_terms: int, own_step: str) -> None:
    """Refuses ``add_loss`` terms beyond the `num_weight_terms` weight regularizers: they may depend
    on the data. `own_step` names the way out (the front end's own train step)."""
    extra = num_losses - num_weight_terms
    if extra > 0:
        raise refuse("data-losses", _DATA_LOSSES_MESSAGE.format(extra=extra, own_step=own_step))

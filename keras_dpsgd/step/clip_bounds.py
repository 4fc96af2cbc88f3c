"""The clip bounds outside the step, both Kerases: initial bounds from random noise, and the bounds' logger.

Three Tools Sec. 3: "C_l2 starts from the mean norm of one iteration on random noise" (public data, no privacy
cost; the mean is :func:`keras_dpsgd.dp.adaptive.initial_bounds`); Fig. 4: the per-layer bounds over training
(:class:`ClipBoundsLoggerCore`, which each front end's ``ClipBoundsLogger`` combines with its ``Callback``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import tensorflow as tf

from keras_dpsgd import _validate
from keras_dpsgd import backends
from keras_dpsgd.dp import adaptive

__all__ = ["initial_clip_bounds", "initial_flat_clip_bound", "ClipBoundsLoggerCore"]


def _is_keras3(model: Any) -> bool:
    import keras

    return isinstance(model, keras.Model)


def _losses_module(model: Any):
    if _is_keras3(model):
        import keras
    else:
        import tf_keras as keras
    return keras.losses


def _noise_sq_norms(model, num_classes, loss, batch_size, seed, per_example_backend) -> np.ndarray:
    """[batch_size, V] squared per-example gradient norms of one batch of random noise (public data)."""
    if not model.built:
        raise ValueError("model must be built (call it once or give it an input shape) before initial_clip_bounds")
    batch_size = _validate.integer_at_least(1, batch_size=batch_size)
    classes = int(num_classes if num_classes is not None else model.output_shape[-1])
    if classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {classes}")
    rng = np.random.default_rng(seed)
    shape = (int(batch_size),) + tuple(int(d) for d in model.input_shape[1:])
    x = tf.constant(rng.random(shape, dtype=np.float32))
    y = tf.constant(rng.integers(0, classes, size=int(batch_size)))
    loss = loss or _losses_module(model).SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    variables = [getattr(v, "value", v) if _is_keras3(model) else v for v in model.trainable_variables]
    backend = backends.per_example(per_example_backend, "warn", "tensorflow")  # the traced probe below is TF code

    # Traced, as in training, with the batch as the step's arguments: the per-example backend's
    # graph checks run (they find the batch among the step's inputs).
    @tf.function(autograph=False)
    def sq_norms(x, y):
        with tf.GradientTape(persistent=True) as tape:
            per_example = loss(y, model(x, training=True))
        return backend.clipped_sum(per_example, variables, tape, tf.zeros_like)[1]

    return np.maximum(sq_norms(x, y).numpy(), 0.0)


def initial_clip_bounds(
    model: Any,
    *,
    num_classes: int | None = None,
    loss: Callable[[Any, Any], Any] | None = None,
    batch_size: int = 128,
    seed: int | None = None,
    per_example_backend: str = "auto",
) -> list[float]:
    """Initial per-variable bounds C_0: mean per-example gradient norms on random noise (public data).

    Three Tools Sec. 3: "C_l2 starts from the mean norm of one iteration on
    random noise". One batch of uniform [0, 1) inputs of the model's input
    shape with uniform random labels; no real data is touched, so this costs
    no privacy.

    Args:
      model: a built tf_keras or Keras 3 model (logits output for the default loss).
      num_classes: classes of the random labels (default: the model's last
        output dimension).
      loss: per-example loss (y_true, y_pred) -> [B] (default sparse
        categorical cross-entropy on logits, unreduced).
      batch_size: number of noise examples.
      seed: optional seed (None: OS entropy).
      per_example_backend: backend computing the per-example norms.

    Returns:
      One bound per trainable variable, in `model.trainable_variables` order
      (pass it as `l2_norm_clip`). A variable whose noise gradients are all 0
      gets 1e-6 (the floor of the optimizer's bounds).
    """
    return adaptive.initial_bounds(_noise_sq_norms(model, num_classes, loss, batch_size, seed, per_example_backend))


def initial_flat_clip_bound(
    model: Any,
    *,
    num_classes: int | None = None,
    loss: Callable[[Any, Any], Any] | None = None,
    batch_size: int = 128,
    seed: int | None = None,
    per_example_backend: str = "auto",
) -> float:
    """Initial flat bound C_0: the mean per-example norm of the whole gradient on random noise.

    As :func:`initial_clip_bounds` (one batch of uniform noise with random labels, no privacy
    cost), for one bound on the whole gradient (``AdaptiveDPSGDOptimizer(C_0, ...)`` with a
    number: flat adaptive clipping). Arguments as :func:`initial_clip_bounds`; returns at least 1e-6.
    """
    return adaptive.initial_flat_bound(_noise_sq_norms(model, num_classes, loss, batch_size, seed, per_example_backend))


class ClipBoundsLoggerCore:
    """Writes the optimizer's per-variable clip bounds to the logs and to TensorBoard (Three Tools Fig. 4).

    Adds ``clip_bound/<variable name>`` entries to each epoch's logs (so they
    land in History and CSVLogger) and, with `log_dir`, writes them as
    TensorBoard scalars every `update_freq` batches and at each epoch end.
    Each front end combines it with its own ``Callback`` class.

    Args:
      log_dir: optional TensorBoard log directory.
      update_freq: write scalars every this many batches (0: epochs only).
    """

    def __init__(self, log_dir: str | None = None, update_freq: int = 0):
        super().__init__()
        update_freq = _validate.integer_at_least(0, update_freq=update_freq)
        self.log_dir = log_dir
        self.update_freq = int(update_freq)
        self._writer = None
        self._batches = 0
        self.history: list[dict[str, float]] = []

    def _variable_names(self) -> list[str]:
        names = [getattr(v, "path", None) or v.name for v in self.model.trainable_variables]
        return [n[:-2] if n.endswith(":0") else n for n in names]

    def _bounds(self) -> dict[str, float] | None:
        bounds = getattr(self.model.optimizer, "clip_bounds", None)
        if bounds is None:
            return None
        values = np.asarray(tf.convert_to_tensor(bounds))
        return {f"clip_bound/{n}": float(b) for n, b in zip(self._variable_names(), values)}

    def _write(self, values: dict[str, float], step: int) -> None:
        if self.log_dir is None:
            return
        from tensorflow.core.framework import summary_pb2

        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
        ).SerializeToString()
        with self._writer.as_default():
            for k, v in values.items():
                # What tf.summary.scalar writes, without needing the tensorboard package.
                tf.summary.write(k, tf.constant(v, tf.float32), step=step, metadata=metadata)
        self._writer.flush()

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self.update_freq and self._batches % self.update_freq == 0:
            values = self._bounds()
            if values:
                self._write(values, self._batches)

    def on_epoch_end(self, epoch, logs=None):
        values = self._bounds()
        if not values:
            return
        self.history.append(values)
        if logs is not None:
            logs.update(values)
        self._write(values, self._batches)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

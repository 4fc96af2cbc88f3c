"""The clip bounds logger (Three Tools Fig. 4), shared by both front ends' ``ClipBoundsLogger``."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_dpsgd import _validate

__all__ = ["ClipBoundsLoggerCore"]


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

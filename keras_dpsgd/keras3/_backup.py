"""Keras 3 ``BackupAndRestore`` for several workers (``tf.distribute.MultiWorkerMirroredStrategy``).

Keras 3's ``keras.callbacks.BackupAndRestore`` has no chief logic: every worker writes the same
``latest.weights.h5`` of the backup directory. Two workers sharing one directory (the usual set-up:
the backup must be readable by every worker at restart) fail at the first save (HDF5 file lock,
``BlockingIOError``), and one left hanging in the next collective. :class:`BackupAndRestore` writes
as tf_keras does: the chief (worker 0) writes the backup directory, every other worker a temporary
directory of its own (deleted at the end of ``fit``); every worker restores from the backup
directory. One worker (no strategy, MirroredStrategy, OneDeviceStrategy, the JAX backend): exactly Keras's
callback, which saves the optimizer (its ledger and DP state) with the weights.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile

import keras
import tensorflow as tf

from keras_dpsgd import backends
from keras_dpsgd.keras3._optimizer import DPKeras3Mixin
from keras_dpsgd.dp.refusals import refuse

__all__ = ["BackupAndRestore"]

_PATH_ATTRIBUTES = ("_weights_path", "_training_metadata_path", "_prev_weights_path", "_prev_training_metadata_path")


def _multi_worker(strategy: tf.distribute.Strategy | None) -> bool:
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and strategy.extended._in_multi_worker_mode()


def _same_on_every_replica(strategy: tf.distribute.Strategy, values: list[float]) -> bool:
    """Whether `values` are the same on every replica: Σv² · R == (Σv)² for each (SUM all-reduces)."""
    local = tf.constant(values, tf.float64)

    def sums():
        context = tf.distribute.get_replica_context()
        return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.stack([local, local * local]))

    total, squares = strategy.experimental_local_results(strategy.run(sums))[0].numpy()
    replicas = strategy.num_replicas_in_sync
    return bool(all(abs(s * replicas - t * t) <= 1e-9 * max(1.0, t * t) for t, s in zip(total, squares)))


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """``keras.callbacks.BackupAndRestore`` whose backup the chief writes under several workers.

    Under ``tf.distribute.MultiWorkerMirroredStrategy`` with several workers: the chief (worker 0)
    writes `backup_dir`; every other worker saves to a temporary directory of its own, removed at
    the end of ``fit`` (the workers hold the same mirrored weights and ledger, so the chief's copy
    is the backup). At the start of ``fit`` every worker restores from `backup_dir`, which must be
    readable by every worker (a shared file system, or the chief's directory copied to each
    machine), and the workers check that they restored the same epoch and step counts: a worker
    that restored nothing (or another backup) while the others resumed would train other weights
    and count other steps, so ``fit`` raises ``ValueError`` on every worker instead. With one worker
    it is ``keras.callbacks.BackupAndRestore`` itself.

    Args:
      backup_dir: the backup directory (every worker's view of the chief's).
      save_freq: "epoch" or every this many batches (as Keras's callback).
      double_checkpoint: keep the previous backup too (as Keras's callback).
      delete_checkpoint: remove the backup at the end of ``fit`` (as Keras's callback; the chief
        removes `backup_dir`, the other workers their temporary directories).
    """

    def __init__(self, backup_dir, save_freq="epoch", double_checkpoint=False, delete_checkpoint=True):
        super().__init__(
            backup_dir, save_freq=save_freq, double_checkpoint=double_checkpoint, delete_checkpoint=delete_checkpoint
        )
        self._write_dir: str | None = None

    def _strategy(self) -> tf.distribute.Strategy | None:
        """The model's tf.distribute strategy; None on JAX and torch (one process: Keras's callback as it is)."""
        if backends.is_jax() or backends.is_torch():
            return None
        return self.model.distribute_strategy

    def _writes_backup_dir(self) -> bool:
        strategy = self._strategy()
        return not _multi_worker(strategy) or bool(strategy.extended.should_checkpoint)

    @contextlib.contextmanager
    def _paths_in(self, directory: str):
        """The callback's paths moved into `directory` for the duration (this worker's own copy)."""
        saved = {name: getattr(self, name) for name in ("backup_dir", *_PATH_ATTRIBUTES)}
        try:
            for name in _PATH_ATTRIBUTES:
                setattr(self, name, saved[name].replace(saved["backup_dir"], directory, 1))
            self.backup_dir = directory
            yield
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    def on_train_begin(self, logs=None):
        strategy = self._strategy()
        if not _multi_worker(strategy):
            return super().on_train_begin(logs)
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            # On every worker: Keras builds it only where a backup is found, and building creates
            # variables (a collective broadcast from the chief), which every worker must run alike.
            optimizer.build(self.model.trainable_variables)
        super().on_train_begin(logs)
        counts = {"epoch": float(getattr(self.model, "_initial_epoch", None) or 0)}
        if optimizer is not None:
            counts["iterations"] = float(optimizer.iterations.numpy())
        if isinstance(optimizer, DPKeras3Mixin):
            counts["noised_steps"] = float(optimizer.noised_steps.numpy())
        if not _same_on_every_replica(strategy, list(counts.values())):
            raise refuse(
                "backup-workers-differ",
                f"BackupAndRestore: the workers restored different training states from {self.backup_dir!r} "
                "(epoch, steps): every worker must read the chief's backup directory (a shared file system, "
                "or a copy of the chief's directory on each machine). This worker restored "
                f"({', '.join(counts)}) = {tuple(int(c) for c in counts.values())}.",
            )

    def _save_model(self):
        if self._writes_backup_dir():
            return super()._save_model()
        if self._write_dir is None:
            task = self._strategy().cluster_resolver.task_id
            self._write_dir = tempfile.mkdtemp(prefix=f"keras_dpsgd_backup_worker{task}_")
        with self._paths_in(self._write_dir):
            return super()._save_model()

    def on_train_end(self, logs=None):
        if self._writes_backup_dir():
            return super().on_train_end(logs)
        if self._write_dir is not None:
            shutil.rmtree(self._write_dir, ignore_errors=True)
            self._write_dir = None

"""Keras 3 BackupAndRestore with several workers (tests/keras3/test_keras3_distribute.py): a kill and a relaunch.

Phase "main" (the first launch of the cluster): a fit of 3 epochs of 3 Poisson lots with
``keras_dpsgd.keras3.BackupAndRestore`` on one directory shared by the workers, interrupted at the
start of its third epoch on every worker (a preemption); the processes then exit. Phase "resume"
(a relaunch of the cluster on the same directory): first a worker that sees no backup (another
directory) while the chief resumes: refused on every worker; then the fit resumed by fresh models
and optimizers on every worker: the third epoch only, 9 global steps counted once, ε the
accountant's for 9 steps.
"""

import os

import keras
import numpy as np
import tensorflow as tf

import keras_dpsgd.keras3 as k3
from _dist_helpers import barrier
from keras3_distributed import _model
from keras_dpsgd import PoissonLots, model_epsilon
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon

SIGMA, DELTA, EPOCHS, STEPS = 1.2, 1e-5, 3, 3


def _lots(strategy: tf.distribute.Strategy) -> PoissonLots:
    resolver = strategy.cluster_resolver
    workers = resolver.cluster_spec().num_tasks("worker")
    x = np.random.default_rng(6).normal(size=(256, 5)).astype("float32")
    return PoissonLots(
        x,
        x[:, :2],
        expected_lot_size=16,
        num_workers=workers,
        worker_index=resolver.task_id,
        replicas_per_worker=strategy.num_replicas_in_sync // workers,
        seed=2,
    )


def _fit(strategy: tf.distribute.Strategy, backup: str, callbacks=()) -> keras.Model:
    lots = _lots(strategy)
    with strategy.scope():
        model = k3.make_private(_model())
        optimizer = lots.configure(k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1))
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(
        lots.distribute(strategy),
        epochs=EPOCHS,
        steps_per_epoch=STEPS,
        verbose=0,
        callbacks=[k3.BackupAndRestore(backup), *callbacks],
    )
    return model


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            self.steps = int(self.model.optimizer.noised_steps.numpy())
            raise RuntimeError("interrupted")


def run(strategy: tf.distribute.Strategy, directory: str, phase: str) -> dict:
    worker = strategy.cluster_resolver.task_id
    backup = os.path.join(directory, "keras3_backup")
    if phase == "main":
        interrupt = _Interrupt()
        try:
            _fit(strategy, backup, [interrupt])
        except RuntimeError:
            pass
        barrier(strategy)  # every worker past the interruption: the chief's last save is complete
        return {"interrupted_steps": interrupt.steps, "backup_files": sorted(os.listdir(backup))}
    out = {}
    try:  # worker 1 does not see the chief's backup: every worker refuses to start
        _fit(strategy, backup if worker == 0 else os.path.join(directory, f"elsewhere{worker}"))
        out["mismatch"] = "trained"
    except ValueError as err:
        out["mismatch"] = str(err)
    model = _fit(strategy, backup)
    barrier(strategy)  # every worker past the end of its fit: the chief has removed the backup
    q = _lots(strategy).sampling_rate
    out.update(
        resumed_steps=int(model.optimizer.noised_steps.numpy()),
        iterations=int(model.optimizer.iterations.numpy()),
        resumed_epsilon=model_epsilon(model, target_delta=DELTA)[0],
        expected_epsilon=compute_epsilon([PoissonSampledGaussianEvent(q, SIGMA, EPOCHS * STEPS)], DELTA),
        backup_removed=not os.path.exists(backup),
    )
    return out

"""The tf_keras DP step under tf.distribute: the checks, shared by the MirroredStrategy child and the
MultiWorkerMirroredStrategy workers (``tests/tf_keras/test_tf_keras_distribute.py``).

Each check returns JSON-able numbers; the test asserts on them. The oracle of the σ = 0 step is a
loop over the examples one at a time (numpy clip, sum, divide by L, SGD); the one-device step runs
in the same process under the default strategy.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
import tf_keras as keras

import keras_dpsgd.tf_keras as kt
from _dist_helpers import barrier
from keras_dpsgd import ledger
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon

GLOBAL_BATCH = 8
CLIP = 0.5
LR = 0.5
WEIGHT_DECAY_L2 = 0.05


def data(num: int = GLOBAL_BATCH, dim: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num, dim)).astype(np.float32)
    y = rng.normal(size=(num, 1)).astype(np.float32)
    return x, y


def _model(regularized: bool = False) -> keras.Model:
    keras.utils.set_random_seed(1)
    reg = keras.regularizers.L2(WEIGHT_DECAY_L2) if regularized else None
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh", kernel_regularizer=reg),
            keras.layers.Dense(1),
        ]
    )


def _loss() -> keras.losses.Loss:
    return keras.losses.MeanSquaredError(reduction="none")


LAST_COUNTS: dict = {}  # of the last accumulation step of one_step


def one_step(strategy: tf.distribute.Strategy, variant: str, x, y, batch: int = GLOBAL_BATCH) -> list[np.ndarray]:
    """Weights after one σ = 0 step of fit on the global batch (x, y) under `strategy`.

    "accumulation": x holds 3 batches; the first two form one lot (k = 2), the third is an
    incomplete lot that fit discards (momentum 0.9: an update applied on it would move the weights).
    """
    accumulation = variant == "accumulation"
    with strategy.scope():
        model = _model(regularized=variant == "make_private")
        clip = [CLIP] * 4 if variant == "per_layer" else CLIP
        lot = None if variant == "realized" else float(2 * batch if accumulation else len(x))
        extra = dict(gradient_accumulation_steps=2, momentum=0.9) if accumulation else {}
        opt = kt.DPSGDOptimizer(
            l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=LR, expected_lot_size=lot, **extra
        )
        if variant == "make_private":
            model = kt.make_private(model)
        model.compile(optimizer=opt, loss=_loss())
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    if accumulation:
        assert int(opt.noised_steps.numpy()) == int(opt.iterations.numpy()) == 1, "one lot, one update"
        assert opt.discarded_lots == 1 and opt.discarded_batches == 1, "the third batch is discarded"
        # Its NaN examples are counted (the test asserts on it): the count sums the replicas' counts.
        LAST_COUNTS["nonfinite_examples"] = int(opt.nonfinite_examples.numpy())
    return [w.numpy() for w in model.trainable_variables]


def oracle_step(variant: str, x, y) -> list[np.ndarray]:
    """One example at a time: g_i, clipped (flat or per variable), summed, / L, plus the L2 gradient
    ("accumulation": the lot is the first two batches)."""
    if variant == "accumulation":
        x, y = x[: 2 * GLOBAL_BATCH], y[: 2 * GLOBAL_BATCH]
    model = _model(regularized=variant == "make_private")
    variables = model.trainable_variables
    total = [np.zeros(v.shape, np.float32) for v in variables]
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(_loss()(y[i : i + 1], model(x[i : i + 1])))
        grads = [g.numpy() for g in tape.gradient(loss, variables)]
        if variant == "per_layer":
            grads = [g * min(1.0, CLIP / np.linalg.norm(g)) for g in grads]
        else:
            norm = np.sqrt(sum(np.sum(g**2) for g in grads))
            grads = [g * min(1.0, CLIP / norm) for g in grads]
        total = [t + g for t, g in zip(total, grads)]
    new = []
    for i, (v, t) in enumerate(zip(variables, total)):
        g = t / len(x)
        if variant == "make_private" and i == 0:
            g = g + 2 * WEIGHT_DECAY_L2 * v.numpy()
        new.append(v.numpy() - LR * g)
    return new


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(max(np.max(np.abs(u - v)) for u, v in zip(a, b)))


def noise_std(
    strategy: tf.distribute.Strategy,
    seed: int | None,
    sigma: float = 1.0,
    clip: float = 1.0,
    lot: float = 8.0,
    dim: int = 100,
    accumulation: int = 1,
) -> list[float]:
    """One lot on a zero gradient (x = 0, no bias): the update is -lr·noise/L; returns it flat."""
    keras.utils.set_random_seed(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((dim,)), keras.layers.Dense(dim, use_bias=False)])
        w0 = model.trainable_variables[0].numpy()
        opt = kt.DPSGDOptimizer(
            l2_norm_clip=clip,
            noise_multiplier=sigma,
            learning_rate=1.0,
            expected_lot_size=lot,
            seed=seed,
            gradient_accumulation_steps=accumulation,
        )
        model.compile(optimizer=opt, loss=_loss())
    x = np.zeros((GLOBAL_BATCH * accumulation, dim), np.float32)
    model.fit(x, x, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return (w0 - model.trainable_variables[0].numpy()).ravel()


def refusal(strategy: tf.distribute.Strategy, kind: str) -> str:
    """The message of the ValueError a refused configuration raises at its first step ('' if none)."""
    x, y = data()
    with strategy.scope():
        model = _model()
        if kind == "accumulation_weight_decay":
            opt = kt.DPSGDOptimizer(
                l2_norm_clip=1.0,
                noise_multiplier=1.0,
                gradient_accumulation_steps=2,
                expected_lot_size=16.0,
                weight_decay=0.01,
            )
        else:
            opt = kt.AdaptiveDPSGDOptimizer([1.0] * 4, 1.0, 1.0, expected_lot_size=8.0)
        model.compile(optimizer=opt, loss=_loss())
    try:
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    except ValueError as e:
        return str(e)
    return ""


BACKUP_STEPS, BACKUP_N, BACKUP_SIGMA = 2, 64, 1.1


def _backup_fit(strategy: tf.distribute.Strategy, directory: str, callbacks: list) -> tuple:
    """A fresh model and optimizer fit for 2 epochs of BACKUP_STEPS Poisson-charged steps with a
    BackupAndRestore in `directory` and `callbacks`; returns (model, optimizer, history)."""
    with strategy.scope():
        model = _model()
        opt = kt.DPSGDOptimizer(
            l2_norm_clip=1.0,
            noise_multiplier=BACKUP_SIGMA,
            learning_rate=0.1,
            expected_lot_size=float(GLOBAL_BATCH),
            sampling_rate=GLOBAL_BATCH / BACKUP_N,
        )
        ledger.assume_poisson(opt)  # the fixed batches stand for Poisson lots at q
        model.compile(optimizer=opt, loss=_loss())
    x, y = data(BACKUP_STEPS * GLOBAL_BATCH)
    callbacks = [keras.callbacks.BackupAndRestore(directory), *callbacks]
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return model, opt, history


def _truth(steps: int) -> float:
    return float(compute_epsilon([PoissonSampledGaussianEvent(GLOBAL_BATCH / BACKUP_N, BACKUP_SIGMA, steps)], 1e-5))


def backup_interrupt(strategy: tf.distribute.Strategy, directory: str) -> dict:
    """The first fit, interrupted at the start of its second epoch (its backup: the first epoch)."""

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                self.seen = {
                    "noised_steps": int(self.model.optimizer.noised_steps.numpy()),
                    "epsilon": float(ledger.model_epsilon(self.model, target_delta=1e-5, num_examples=BACKUP_N)[0]),
                }
                raise RuntimeError("interrupted")

    interrupt = Interrupt()
    try:
        _backup_fit(strategy, directory, [interrupt])
    except RuntimeError:
        pass
    return dict(interrupt.seen, truth=_truth(BACKUP_STEPS))


def backup_resume(strategy: tf.distribute.Strategy, directory: str) -> dict:
    """A fresh model and optimizer resume the interrupted fit from `directory`: noised_steps,
    iterations, the ledger's and PrivacyLogger's ε against the accountant's for 2k steps at (q, σ);
    and the `.keras` file of its ModelCheckpoint (the chief's, under several workers), loaded under
    the strategy."""
    from keras_dpsgd import PrivacyLogger

    logger = PrivacyLogger(target_delta=1e-5, num_examples=BACKUP_N)
    saved = directory + "_model.keras"
    model, opt, history = _backup_fit(strategy, directory, [keras.callbacks.ModelCheckpoint(saved), logger])
    out = {
        "epochs_run": len(history.history["epsilon"]),
        "noised_steps": int(opt.noised_steps.numpy()),
        "iterations": int(opt.iterations.numpy()),
        "epsilon": float(ledger.model_epsilon(model, target_delta=1e-5, num_examples=BACKUP_N)[0]),
        "logged_epsilon": float(history.history["epsilon"][-1]),
        "truth": _truth(2 * BACKUP_STEPS),
    }
    barrier(strategy)  # every worker past the chief's save: then each loads the chief's file
    with strategy.scope():
        loaded = keras.models.load_model(saved)
    out["loaded_steps"] = int(loaded.optimizer.noised_steps.numpy())
    out["loaded_epsilon"] = float(ledger.model_epsilon(loaded, target_delta=1e-5, num_examples=BACKUP_N)[0])
    return out


def backup_check(strategy: tf.distribute.Strategy, directory: str) -> dict:
    """BackupAndRestore under the strategy, in one process: a fit of 2 epochs of k steps interrupted
    after the first, then a fresh model and optimizer that resume it (:func:`backup_resume`)."""
    first = backup_interrupt(strategy, directory)
    return dict(backup_resume(strategy, directory), first=first, first_truth=first.pop("truth"))


def poisson_fit(
    strategy: tf.distribute.Strategy, worker: int, workers: int, steps: int = 3, sigma: float = 1.1
) -> dict:
    """Poisson lots sharded over the workers (one lot per step, ``distribute_datasets_from_function``):
    noised_steps, the ledger's ε and the accountant's for k steps at the sampler's q."""
    from keras_dpsgd import PoissonLots

    x, y = data(64)
    lots = PoissonLots(
        x,
        y,
        expected_lot_size=8.0,
        num_workers=workers,
        worker_index=worker,
        seed=5,
        replicas_per_worker=strategy.num_replicas_in_sync // workers,
    )

    def build():
        with strategy.scope():
            model = _model()
            opt = kt.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=sigma, learning_rate=0.1)
            lots.configure(opt)
            model.compile(optimizer=opt, loss=_loss())
        return model, opt

    per_worker = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)  # this worker's own batches
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    try:  # a per-worker dataset as is: refused (each of its batches would be split over the W steps)
        build()[0].fit(per_worker.with_options(options), steps_per_epoch=steps, epochs=1, verbose=0)
        refused = ""
    except ValueError as e:
        refused = str(e)
    model, opt = build()
    model.fit(lots.distribute(strategy), steps_per_epoch=steps, epochs=1, verbose=0)
    eps, _ = ledger.model_epsilon(model, target_delta=1e-5, num_examples=64)
    truth = compute_epsilon([PoissonSampledGaussianEvent(lots.sampling_rate, sigma, steps)], 1e-5)
    return {
        "noised_steps": int(opt.noised_steps.numpy()),
        "epsilon": float(eps),
        "truth": float(truth),
        "refused": refused,
        "expected_lot_size": float(opt.expected_lot_size),
        "weights": float(sum(np.sum(w) for w in model.get_weights())),
    }


def lot_sizes(worker: int, workers: int, n: int = 200, q: float = 0.1, num_lots: int = 200) -> list[int]:
    """The real (weight-1) rows of each of this worker's `num_lots` sharded Poisson lots."""
    from keras_dpsgd import PoissonLots

    x = np.zeros((n, 1), np.float32)
    lots = PoissonLots(x, x, sampling_rate=q, num_workers=workers, worker_index=worker, seed=9)
    return [int(len(lots.sample_indices())) for _ in range(num_lots)]


def _steps(strategy: tf.distribute.Strategy, variants, one_device=("flat",)) -> dict:
    """The σ = 0 step of each variant under `strategy` against the oracle (and, for `one_device`,
    against the same step on one device)."""
    single = tf.distribute.get_strategy()
    x, y = data()
    x3, y3 = data(3 * GLOBAL_BATCH)
    x3[-1] = np.nan  # one example of the discarded third batch, on the last replica: counted in nonfinite_examples
    steps = {}
    for variant in variants:
        xv, yv = (x3, y3) if variant == "accumulation" else (x, y)
        distributed = one_step(strategy, variant, xv, yv)
        steps[variant] = {
            "weights": float(sum(np.sum(w, dtype=np.float64) for w in distributed)),
            "vs_oracle": max_diff(distributed, oracle_step(variant, xv, yv)),
            "moved": max_diff(distributed, [w.numpy() for w in _model().trainable_variables]),
            **LAST_COUNTS,
        }
        LAST_COUNTS.clear()
        if variant in one_device:
            steps[variant]["vs_one_device"] = max_diff(distributed, one_step(single, variant, xv, yv))
    return steps


def mirrored_checks(strategy: tf.distribute.Strategy, directory: str) -> dict:
    """The MirroredStrategy process (2 logical CPU devices): the σ = 0 steps, the noise std σC/L
    (seeded: 2 batches accumulated into one lot of L = 8, one draw per lot, with the keys of the
    workers' one-batch seeded step: same seed, same R, noised step 0), the refusals, and
    BackupAndRestore / ModelCheckpoint keeping the ledger."""
    result = {"replicas": strategy.num_replicas_in_sync}
    variants = ("flat", "per_layer", "make_private", "accumulation")
    result["steps"] = _steps(strategy, variants, one_device=("flat", "make_private"))
    for step in result["steps"].values():
        step.pop("weights")
    seeded = noise_std(strategy, seed=7, accumulation=2)
    result["noise"] = {
        "expected_std": 1.0 * 1.0 / 8.0,
        "seeded_std": float(np.std(seeded)),
        "seeded_mean": float(np.mean(seeded)),
        "unseeded_std": float(np.std(noise_std(strategy, seed=None))),
        "head": seeded[:50].tolist(),
        "count": int(seeded.size),
    }
    result["refusals"] = {kind: refusal(strategy, kind) for kind in ("accumulation_weight_decay", "adaptive")}
    result["epsilon"] = backup_check(strategy, os.path.join(directory, "tf_keras_backup"))
    return result


def worker_checks(strategy: tf.distribute.MultiWorkerMirroredStrategy, directory: str, phase: str) -> dict:
    """One worker of the MultiWorkerMirroredStrategy cluster (one CPU device each).

    phase "main": the σ = 0 steps (gradient accumulation included) against the oracle and the
    one-device step, the noise std σC/L, the accountant's ε with sharded Poisson lots, this
    worker's lot sizes, and a BackupAndRestore fit interrupted after its first epoch (the chief
    writes `directory`). phase "resume" (a relaunch of the cluster): that fit resumed.
    """
    resolver = strategy.cluster_resolver
    worker, workers = resolver.task_id, resolver.cluster_spec().num_tasks("worker")
    result = {"replicas": strategy.num_replicas_in_sync, "worker": worker}
    backup = os.path.join(directory, "tf_keras_backup")
    if phase == "resume":
        result["resumed"] = backup_resume(strategy, backup)
        return result
    # The one-device steps on the chief only (the same computation on every worker; the weights after the
    # distributed step are compared across the workers by the test).
    one_device = ("flat", "accumulation") if worker == 0 else ()
    result["steps"] = _steps(strategy, ("flat", "realized", "accumulation"), one_device=one_device)
    result["weights"] = {v: s.pop("weights") for v, s in result["steps"].items()}
    noise = noise_std(strategy, seed=7)
    result["noise"] = {
        "expected_std": 1.0 / 8.0,
        "seeded_std": float(np.std(noise)),
        "unseeded_std": float(np.std(noise_std(strategy, seed=None))),
        "head": noise[:50].tolist(),  # the same on every worker: one update, applied everywhere
    }
    result["poisson"] = poisson_fit(strategy, worker, workers)
    result["lot_sizes"] = lot_sizes(worker, workers)
    result["interrupted"] = backup_interrupt(strategy, backup)
    return result

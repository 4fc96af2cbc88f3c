"""The tf_keras DP step under tf.distribute: the checks, shared by the MirroredStrategy child and the
MultiWorkerMirroredStrategy workers (``tests/test_tf_keras_distribute.py``).

Each check returns JSON-able numbers; the test asserts on them. The oracle of the σ = 0 step is a
loop over the examples one at a time (numpy clip, sum, divide by L, SGD); the one-device step runs
in the same process under the default strategy.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tf_keras as keras

import keras_dpsgd.tf_keras as kt
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
        # Its one NaN example, on replica 1, is counted: the count sums the replicas' counts.
        assert int(opt.nonfinite_examples.numpy()) == 1, int(opt.nonfinite_examples.numpy())
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


def backup_check(
    strategy: tf.distribute.Strategy, directory: str, steps: int = 2, n: int = 64, sigma: float = 1.1
) -> dict:
    """BackupAndRestore under the strategy: a fit of 2 epochs of k steps interrupted after the first,
    then a fresh model and optimizer that resume it: noised_steps, iterations, the ledger's and
    PrivacyLogger's ε, and the accountant's for k and 2k steps at (q, σ); and the `.keras` file of
    its ModelCheckpoint, loaded under the strategy."""
    from keras_dpsgd import PrivacyLogger

    q = GLOBAL_BATCH / n
    x, y = data(steps * GLOBAL_BATCH)

    def build():
        with strategy.scope():
            model = _model()
            opt = kt.DPSGDOptimizer(
                l2_norm_clip=1.0,
                noise_multiplier=sigma,
                learning_rate=0.1,
                expected_lot_size=float(GLOBAL_BATCH),
                sampling_rate=q,
            )
            model.compile(optimizer=opt, loss=_loss())
        return model, opt

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    fit = dict(batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    model, opt = build()
    try:
        model.fit(x, y, callbacks=[keras.callbacks.BackupAndRestore(directory), Interrupt()], **fit)
    except RuntimeError:
        pass
    first = {
        "noised_steps": int(opt.noised_steps.numpy()),
        "epsilon": float(ledger.model_epsilon(model, target_delta=1e-5, num_examples=n)[0]),
    }
    model2, opt2 = build()
    logger = PrivacyLogger(target_delta=1e-5, num_examples=n)
    saved = directory + "_model.keras"
    callbacks = [keras.callbacks.BackupAndRestore(directory), keras.callbacks.ModelCheckpoint(saved), logger]
    history = model2.fit(x, y, callbacks=callbacks, **fit)
    with strategy.scope():
        loaded = keras.models.load_model(saved)
    return {
        "loaded_steps": int(loaded.optimizer.noised_steps.numpy()),
        "loaded_epsilon": float(ledger.model_epsilon(loaded, target_delta=1e-5, num_examples=n)[0]),
        "first": first,
        "first_truth": float(compute_epsilon([PoissonSampledGaussianEvent(q, sigma, steps)], 1e-5)),
        "epochs_run": len(history.history["epsilon"]),
        "noised_steps": int(opt2.noised_steps.numpy()),
        "iterations": int(opt2.iterations.numpy()),
        "epsilon": float(ledger.model_epsilon(model2, target_delta=1e-5, num_examples=n)[0]),
        "logged_epsilon": float(history.history["epsilon"][-1]),
        "truth": float(compute_epsilon([PoissonSampledGaussianEvent(q, sigma, 2 * steps)], 1e-5)),
    }


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

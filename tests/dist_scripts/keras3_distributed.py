"""The Keras 3 DP step under a tf.distribute strategy: the checks of tests/keras3/test_keras3_distribute.py.

Run by ``tests/dist_scripts/strategy_child.py`` (one process with 2 logical CPU devices under a
MirroredStrategy, or one of the workers of ``tests/_dist_helpers.run_workers`` under a
MultiWorkerMirroredStrategy): :func:`run` runs every check once on the process's strategy and
returns the numbers; the test asserts on them.
"""

import os
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

import _dist_helpers
import keras_dpsgd.keras3 as k3
from _keras3_helpers import loop_clipped_mean
from keras_dpsgd import PoissonLots, PrivacyLogger, WithinLimit, model_epsilon
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.ledger import assume_poisson

LR, CLIP, B = 0.5, 0.3, 8
rng = np.random.default_rng(0)
X = rng.normal(size=(B, 5)).astype("float32")
Y = rng.normal(size=(B, 2)).astype("float32")
# Set by run(): the process's strategy, its mode and this worker's place in the cluster.
strategy = MODE = None
R = LOCAL = WORKERS = WORKER = 0
result: dict = {}


def _model(reg=None):
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh", kernel_regularizer=reg),
            keras.layers.Dense(2),
        ]
    )


def _global_batches(x, y, batch):
    return _dist_helpers.global_batches(strategy, x, y, batch, WORKER, LOCAL)


def step_equals_oracle(name, clip, reg=None, accumulation=1, with_noise_free_one_device=False, lot=B):
    """σ = 0: one lot of B examples under the strategy equals the one-example-at-a-time oracle."""
    per_layer = isinstance(clip, list)
    batch = B // accumulation
    with strategy.scope():
        model = k3.make_private(_model(reg))
        opt = k3.DPSGDOptimizer(
            l2_norm_clip=clip,
            noise_multiplier=0.0,
            learning_rate=LR,
            expected_lot_size=lot,
            gradient_accumulation_steps=accumulation,
        )
        model.compile(optimizer=opt, loss="mse")
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    model.fit(_global_batches(X, Y, batch), epochs=1, steps_per_epoch=accumulation, verbose=0)
    after = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    oracle_model = _model(reg)
    loss = keras.losses.MeanSquaredError(reduction=None)
    expected = loop_clipped_mean(oracle_model, X, Y, loss, clip, per_layer)
    if reg is not None:
        with tf.GradientTape() as tape:
            penalty = tf.add_n(oracle_model.losses)
        reg_grads = tape.gradient(penalty, oracle_model.trainable_variables)
        expected = [e + (0 if g is None else g.numpy()) for e, g in zip(expected, reg_grads)]
    errors = [float(np.max(np.abs((b - a) / LR - e))) for b, a, e in zip(before, after, expected)]
    out = {
        "max_error": max(errors),
        "scale": max(float(np.max(np.abs(e))) for e in expected),
        "noised_steps": int(opt.noised_steps.numpy()),
        "iterations": int(opt.iterations.numpy()),
    }
    if with_noise_free_one_device:  # the same step on one device (no strategy)
        single = k3.make_private(_model(reg))
        single.compile(
            optimizer=k3.DPSGDOptimizer(l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=LR, expected_lot_size=B),
            loss="mse",
        )
        single.fit(X, Y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        out["one_device_error"] = max(
            float(np.max(np.abs(a - s.numpy()))) for a, s in zip(after, single.trainable_variables)
        )
    result[name] = out


def noise_std(name, seed, accumulation=1, per_layer=False):
    """Zero gradients (x = 0, no bias): one step moves the weights by -LR·noise/L only."""
    lot, sigma, clip, width = 16, 1.0, 2.0, 100
    model, opt = _dist_helpers.zero_gradient_keras3(
        strategy,
        width,
        l2_norm_clip=[clip, clip] if per_layer else clip,
        noise_multiplier=sigma,
        expected_lot_size=lot,
        seed=seed,
        gradient_accumulation_steps=accumulation,
    )
    before = model.trainable_variables[0].numpy()
    x, y = np.zeros((lot, width), "float32"), np.zeros((lot, 1), "float32")
    model.fit(_global_batches(x, y, lot // accumulation), epochs=1, steps_per_epoch=accumulation, verbose=0)
    delta = (model.trainable_variables[0].numpy() - before).ravel()
    result[name] = {
        "std": float(delta.std()),
        "mean": float(delta.mean()),
        "n": int(delta.size),
        "expected": sigma * clip / lot,
        "first": delta[:8].tolist(),
        "noised_steps": int(opt.noised_steps.numpy()),
    }


def ledger_and_callbacks():
    """Poisson lots over the workers; noised_steps, ε, PrivacyLogger, WithinLimit count global steps once."""
    n, lot, sigma, delta = 256, 16, 1.2, 1e-5
    data_rng = np.random.default_rng(5)
    x = data_rng.normal(size=(n, 5)).astype("float32")
    y = data_rng.normal(size=(n, 2)).astype("float32")
    lots = PoissonLots(
        x, y, expected_lot_size=lot, num_workers=WORKERS, worker_index=WORKER, replicas_per_worker=LOCAL, seed=17
    )
    sizes = [int(len(lots.sample_indices())) for _ in range(300)]  # this worker's shard lots (then summed)
    with strategy.scope():
        model = k3.make_private(_model())
        opt = lots.configure(k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=sigma, learning_rate=0.1))
        model.compile(optimizer=opt, loss="mse")
    q = lots.sampling_rate

    def eps(steps):
        return compute_epsilon([PoissonSampledGaussianEvent(q, sigma, steps)], delta)

    steps_per_epoch = 4
    logger = PrivacyLogger(delta)
    target = 0.5 * (eps(10) + eps(11))
    limit = WithinLimit(target, delta, verbose=0)
    history = model.fit(
        lots.distribute(strategy), epochs=5, steps_per_epoch=steps_per_epoch, callbacks=[logger, limit], verbose=0
    )
    out = {
        "noised_steps": int(opt.noised_steps.numpy()),
        "iterations": int(opt.iterations.numpy()),
        "logged": history.history["epsilon"],
        "expected_logged": [eps(4), eps(8), eps(10)],
        "stopped": bool(limit.stopped),
        "epsilon": model_epsilon(model, target_delta=delta)[0],
        "expected_epsilon": eps(10),
        "lot_sizes": sizes,
        "q": q,
        "n": n,
        "physical": lots.physical_batch_size,
    }
    try:
        PoissonLots(x, y, expected_lot_size=lot).configure(opt)
        out["unsharded_refused"] = WORKERS == 1
    except ValueError as err:
        out["unsharded_refused"] = "num_workers" in str(err)
    # A .keras file per worker (the chief's is the one to keep), loaded back in the strategy's scope.
    path = os.path.join(tempfile.mkdtemp(), f"worker{WORKER}.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    out["loaded_epsilon"] = model_epsilon(loaded, target_delta=delta)[0]
    out["loaded_steps"] = int(loaded.optimizer.noised_steps.numpy())
    result["ledger"] = out


def checkpoints():
    """BackupAndRestore and a .keras file under the strategy keep the ledger."""
    if MODE != "mirrored":
        return  # Multi-worker checkpoints: see docs/distributed.md (the chief writes); not run here.
    delta, n = 1e-5, 256
    x = np.random.default_rng(6).normal(size=(n, 5)).astype("float32")
    lots = PoissonLots(x, x[:, :2], expected_lot_size=16, replicas_per_worker=LOCAL, seed=2)
    directory = tempfile.mkdtemp()

    def build():
        with strategy.scope():
            model = k3.make_private(_model())
            model.compile(
                optimizer=lots.configure(k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.2, learning_rate=0.1)),
                loss="mse",
            )
        return model

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    backup = os.path.join(directory, "backup")
    model = build()
    try:
        model.fit(
            lots.distribute(strategy),
            epochs=3,
            steps_per_epoch=3,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()],
        )
    except RuntimeError:
        pass
    resumed = build()
    resumed.fit(
        lots.distribute(strategy),
        epochs=3,
        steps_per_epoch=3,
        verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup)],
    )
    path = os.path.join(directory, f"model{WORKER}.keras")
    resumed.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    q, sigma = lots.sampling_rate, 1.2
    result["checkpoints"] = {
        "resumed_steps": int(resumed.optimizer.noised_steps.numpy()),
        "resumed_epsilon": model_epsilon(resumed, target_delta=delta)[0],
        "loaded_epsilon": model_epsilon(loaded, target_delta=delta)[0],
        "expected_epsilon": compute_epsilon([PoissonSampledGaussianEvent(q, sigma, 9)], delta),
    }


def adaptive():
    """Adaptive clipping under R replicas (the norm queries split like the gradient's noise).

    σ = σ_l2 = 0, one lot: the next bounds and the weights equal the one-device step's. Noised
    (σ = 1, σ_l2 = 2), 2 lots: ε is the accountant's for σ_eff (gradient and norm queries composed).
    """
    bounds, q = [0.2, 0.1, 0.3, 0.05], 0.05

    def build(sigma, norm_sigma):
        model = k3.make_private(_model())
        opt = k3.AdaptiveDPSGDOptimizer(
            l2_norm_clip=bounds,
            noise_multiplier=sigma,
            norm_noise_multiplier=norm_sigma,
            learning_rate=LR,
            expected_lot_size=B,
            sampling_rate=q,
        )
        assume_poisson(opt)  # the fixed global batches stand for Poisson lots at q
        model.compile(optimizer=opt, loss="mse")
        return model, opt

    with strategy.scope():
        model, opt = build(0.0, 0.0)
    model.fit(_global_batches(X, Y, B), epochs=1, steps_per_epoch=1, verbose=0)
    if WORKER == 0:  # the one-device step (the same on every worker; the test compares the workers' bounds)
        single, single_opt = build(0.0, 0.0)
        single.fit(X, Y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    x2 = np.concatenate([X, X[::-1]])
    y2 = np.concatenate([Y, Y[::-1]])
    with strategy.scope():
        noised, noised_opt = build(1.0, 2.0)
    noised.fit(_global_batches(x2, y2, B), epochs=1, steps_per_epoch=2, verbose=0)
    sigma_eff = noised_opt.effective_noise_multiplier
    result["adaptive"] = out = {
        "bounds": opt.clip_bounds.numpy().tolist(),
        "bounds_moved": float(np.max(np.abs(opt.clip_bounds.numpy() - np.array(bounds)))),
        "noised_steps": int(noised_opt.noised_steps.numpy()),
        "noised_bounds": noised_opt.clip_bounds.numpy().tolist(),
        "replica_bounds": [
            v.numpy().tolist() for v in strategy.experimental_local_results(noised_opt.clip_bounds.value)
        ],
        "epsilon": model_epsilon(noised, target_delta=1e-5)[0],
        "expected_epsilon": compute_epsilon([PoissonSampledGaussianEvent(q, sigma_eff, 2)], 1e-5),
        "sigma_eff": sigma_eff,
    }
    if WORKER == 0:
        out["bounds_error"] = float(np.max(np.abs(opt.clip_bounds.numpy() - single_opt.clip_bounds.numpy())))
        out["weights_error"] = max(
            float(np.max(np.abs(a.numpy() - b.numpy())))
            for a, b in zip(model.trainable_variables, single.trainable_variables)
        )


class _Hooked(k3.DPSGDOptimizer):
    """A hook of its own (as gradient canaries have): its release would not be split across replicas."""

    def on_per_example_sq_norms(self, sq_norms):
        pass


class _HookedAdaptive(k3.AdaptiveDPSGDOptimizer):
    """Adaptive clipping with a hook overridden again: no longer the split release."""

    def on_noised_step(self, num_examples):
        super().on_noised_step(num_examples)


def refusals():
    out = {}
    with strategy.scope():
        for name, make in {
            "hook": lambda: _Hooked(l2_norm_clip=1.0, noise_multiplier=1.0),
            "adaptive_hook": lambda: _HookedAdaptive(
                l2_norm_clip=[1.0] * 4, noise_multiplier=1.0, norm_noise_multiplier=1.0, learning_rate=0.1
            ),
            "clipnorm": lambda: k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, clipnorm=1.0),
            # Before the refusal this trained with bounds that never moved (the query's release was skipped).
            "adaptive_accumulation": lambda: k3.AdaptiveDPSGDOptimizer(
                l2_norm_clip=[1.0] * 4,
                noise_multiplier=1.0,
                norm_noise_multiplier=1.0,
                gradient_accumulation_steps=2,
                learning_rate=0.1,
            ),
            # Accumulation works under R > 1 (test_keras3_accumulate_distribute); with weight decay it is refused.
            "accumulation": lambda: k3.DPSGDOptimizer(
                l2_norm_clip=1.0, noise_multiplier=1.0, gradient_accumulation_steps=2, weight_decay=0.01
            ),
        }.items():
            model = k3.make_private(_model())
            model.compile(optimizer=make(), loss="mse")
            try:
                model.fit(_global_batches(X, Y, B), epochs=1, steps_per_epoch=1, verbose=0)
                out[name] = "trained"
            except ValueError as err:
                out[name] = str(err)
    result["refusals"] = out


def example():
    """examples/multi_worker.py --smoke in this process, on this process's MirroredStrategy."""
    import contextlib
    import importlib.util
    import io
    import json

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "multi_worker.py"
    )
    spec = importlib.util.spec_from_file_location("multi_worker_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main(["--smoke"], strategy=strategy)  # one strategy per process (collective keys)
    result["example"] = json.loads(out.getvalue().strip().splitlines()[-1])


CHECKS = {
    "flat": lambda: step_equals_oracle(
        "flat", CLIP, reg=keras.regularizers.L2(0.01), with_noise_free_one_device=MODE == "mirrored"
    ),
    # No expected lot size: divided by the realized count, summed over the replicas (B).
    "per_layer_realized": lambda: step_equals_oracle("per_layer_realized", [0.2, 0.1, 0.3, 0.05], lot=None),
    "noise_seeded": lambda: noise_std("noise_seeded_per_layer", seed=4, per_layer=True),
    "noise_unseeded": lambda: noise_std("noise_unseeded", seed=None),
    "ledger": ledger_and_callbacks,
    "adaptive": adaptive,
    "checkpoints": lambda: checkpoints(),
    "refusals": refusals,
    "example": example,
}
# Under several workers only what differs from one machine (the rest is the same code, run mirrored).
WORKER_CHECKS = ["flat", "noise_unseeded", "ledger", "adaptive"]


def run(process_strategy: tf.distribute.Strategy, mode: str, only=()) -> dict:
    """Runs the checks of `mode` ("mirrored": all; "mwms": WORKER_CHECKS) under `process_strategy`."""
    global strategy, MODE, R, LOCAL, WORKERS, WORKER, result
    keras.config.disable_traceback_filtering()
    strategy, MODE = process_strategy, mode
    if mode == "mirrored":
        WORKERS, WORKER = 1, 0
    else:
        resolver = strategy.cluster_resolver
        WORKERS, WORKER = resolver.cluster_spec().num_tasks("worker"), resolver.task_id
    R = strategy.num_replicas_in_sync
    LOCAL = R // WORKERS
    result = {"replicas": R, "workers": WORKERS, "worker": WORKER, "cpu_seconds": {"start": time.process_time()}}
    for name, check in CHECKS.items():
        if name in (only or (list(CHECKS) if mode == "mirrored" else WORKER_CHECKS)):
            check()
            result["cpu_seconds"][name] = time.process_time()
    return result

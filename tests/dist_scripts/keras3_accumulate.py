"""Keras 3 gradient accumulation under a MirroredStrategy on 2 logical CPU devices (k = 2 batches per
lot), for tests/keras3/test_keras3_accumulate_distribute.py: :func:`run` (called by strategy_child.py in the
shared MirroredStrategy process) runs every check once and returns the numbers; the test asserts on
them.
"""

import time

import _dist_helpers
import keras
import numpy as np
import tensorflow as tf
from _keras3_helpers import loop_clipped_mean

import keras_dpsgd.keras3 as k3
from keras_dpsgd import model_epsilon, model_privacy_ledger
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.ledger import assume_poisson

strategy = None  # set by run()
K, LR, CLIP = 2, 0.5, 0.3
rng = np.random.default_rng(0)
X = rng.normal(size=(16, 5)).astype("float32")
Y = rng.normal(size=(16, 2)).astype("float32")
result = {}


class Shrink(keras.constraints.Constraint):
    """w -> 0.9 w: not idempotent, so applying it at every batch instead of once per lot shows."""

    def __call__(self, w):
        return w * 0.9


def _model(reg=None, constraint=None):
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh", kernel_regularizer=reg, kernel_constraint=constraint),
            keras.layers.Dense(2),
        ]
    )


def _global_batches(x, y, batch):
    return _dist_helpers.global_batches(strategy, x, y, batch)


class Weights(keras.callbacks.Callback):
    """The first kernel after every batch (the lot's update must wait for its last batch)."""

    def __init__(self):
        super().__init__()
        self.after = []

    def on_train_batch_end(self, batch, logs=None):
        self.after.append(self.model.trainable_variables[0].numpy().copy())


def _private(noise_multiplier=0.0, reg=None, constraint=None, **kwargs):
    with strategy.scope():
        model = k3.make_private(_model(reg, constraint))
        opt = k3.DPSGDOptimizer(
            l2_norm_clip=CLIP,
            noise_multiplier=noise_multiplier,
            learning_rate=LR,
            gradient_accumulation_steps=K,
            **kwargs,
        )
        if opt.sampling_rate is not None:  # the fixed global batches stand for Poisson lots at q
            assume_poisson(opt)
        model.compile(optimizer=opt, loss="mse")
    return model, opt


def lot_equals_oracle():
    """σ = 0, one lot of 8 = 2 batches of 4 (2 per replica), a weight regularizer: the update is
    the one-example-at-a-time clipped mean (+ the regularizer's gradient), once, after batch 2."""
    reg = keras.regularizers.L2(0.01)
    model, opt = _private(reg=reg, expected_lot_size=8)
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    weights = Weights()
    model.fit(_global_batches(X[:8], Y[:8], 4), epochs=1, steps_per_epoch=K, verbose=0, callbacks=[weights])
    after = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    oracle = _model(reg)
    expected = loop_clipped_mean(oracle, X[:8], Y[:8], keras.losses.MeanSquaredError(reduction=None), CLIP)
    with tf.GradientTape() as tape:
        penalty = tf.add_n(oracle.losses)
    expected = [
        e + (0 if g is None else g.numpy())
        for e, g in zip(expected, tape.gradient(penalty, oracle.trainable_variables))
    ]
    result["oracle"] = {
        "max_error": max(float(np.max(np.abs((b - a) / LR - e))) for b, a, e in zip(before, after, expected)),
        "scale": max(float(np.max(np.abs(e))) for e in expected),
        "moved_after_first_batch": float(np.max(np.abs(weights.after[0] - before[0]))),
        "noised_steps": int(opt.noised_steps.numpy()),
        "iterations": int(opt.iterations.numpy()),
    }


def two_lots_equal_one_device():
    """σ = 0, momentum and a constraint applied once per lot: 2 lots under the strategy equal the
    same 2 lots on one device (k = 2, the same batches in order); the steps count lots."""
    kwargs = dict(momentum=0.9, expected_lot_size=8, sampling_rate=8 / 256)
    model, opt = _private(constraint=Shrink(), **kwargs)
    model.fit(_global_batches(X, Y, 4), epochs=1, steps_per_epoch=2 * K, verbose=0)
    single = k3.make_private(_model(constraint=Shrink()))
    single.compile(
        optimizer=assume_poisson(
            k3.DPSGDOptimizer(
                l2_norm_clip=CLIP, noise_multiplier=0.0, learning_rate=LR, gradient_accumulation_steps=K, **kwargs
            )
        ),
        loss="mse",
    )
    single.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    result["one_device"] = {
        "max_error": max(
            float(np.max(np.abs(a.numpy() - s.numpy())))
            for a, s in zip(model.trainable_variables, single.trainable_variables)
        ),
        "moved": max(
            float(np.max(np.abs(a.numpy() - b))) for a, b in zip(model.trainable_variables, _model().get_weights())
        ),
        "noised_steps": int(opt.noised_steps.numpy()),
        "iterations": int(opt.iterations.numpy()),
        "single_iterations": int(single.optimizer.iterations.numpy()),
        "ledger_steps": sum(event.count for event in model_privacy_ledger(model).events),
    }


def noise(name, seed):
    """Zero gradients (x = 0, no bias): the lot moves the kernel by -noise/L only, once; its ε at a
    known q is the accountant's for one step."""
    lot, sigma, clip, width, target_delta = 16, 1.0, 2.0, 100, 1e-5
    model, opt = _dist_helpers.zero_gradient_keras3(
        strategy,
        width,
        l2_norm_clip=clip,
        noise_multiplier=sigma,
        expected_lot_size=lot,
        seed=seed,
        gradient_accumulation_steps=K,
        sampling_rate=lot / 256,
    )
    before = model.trainable_variables[0].numpy()
    weights = Weights()
    x, y = np.zeros((lot, width), "float32"), np.zeros((lot, 1), "float32")
    model.fit(_global_batches(x, y, lot // K), epochs=1, steps_per_epoch=K, verbose=0, callbacks=[weights])
    delta = (model.trainable_variables[0].numpy() - before).ravel()
    result[name] = {
        "std": float(delta.std()),
        "mean": float(delta.mean()),
        "n": int(delta.size),
        "expected": sigma * clip / lot,
        "first": delta[:8].tolist(),
        "moved_after_first_batch": float(np.max(np.abs(weights.after[0] - before))),
        "noised_steps": int(opt.noised_steps.numpy()),
        "iterations": int(opt.iterations.numpy()),
        "epsilon": model_epsilon(model, target_delta=target_delta)[0],
        "expected_epsilon": compute_epsilon([PoissonSampledGaussianEvent(lot / 256, sigma, 1)], target_delta),
    }


def refusals():
    out = {}
    for option in ({"weight_decay": 0.01}, {"use_ema": True}):
        model, _ = _private(**option)
        try:
            model.fit(_global_batches(X[:8], Y[:8], 4), epochs=1, steps_per_epoch=K, verbose=0)
            out[next(iter(option))] = "trained"
        except ValueError as err:
            out[next(iter(option))] = str(err)
    result["refusals"] = out


CHECKS = {
    "oracle": lot_equals_oracle,
    "one_device": two_lots_equal_one_device,
    "noise_seeded": lambda: noise("noise_seeded", 4),
    "noise_unseeded": lambda: noise("noise_unseeded", None),
    "refusals": refusals,
}


def run(process_strategy: tf.distribute.Strategy, only=()) -> dict:
    """Runs the checks (all, or those named in `only`) under `process_strategy` (2 replicas)."""
    global strategy
    keras.config.disable_traceback_filtering()
    strategy = process_strategy
    result.clear()
    result.update(replicas=strategy.num_replicas_in_sync, cpu_seconds={"start": time.process_time()})
    for name, check in CHECKS.items():
        if name in (only or CHECKS):
            check()
            result["cpu_seconds"][name] = time.process_time()
    return result

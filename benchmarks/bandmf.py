"""BandMF against DP-SGD on MNIST at the same ε and steps (Keras 3, TensorFlow): prints one JSON object per run.

The network of ``docs/clipping.md``'s benchmark (ScatterNet features, our NumPy transform in ``_scatter.py``, J = 2,
L = 8, group-normalized per example; a linear classifier; per-example normalization; momentum 0.9; learning rate
1 → 0.1, linear decay; EMA of the weights 0.99; δ = 1e-5), trained twice per seed at the same target ε and the same
number of steps T = epochs × ⌈N/L⌉:

* ``dpsgd``: :class:`keras_dpsgd.PoissonLots` of expected size L, σ calibrated for T steps at q = L/N;
* ``bandmf``: :class:`keras_dpsgd.CyclicPoissonLots` with b parts and the same expected lot size L (q' = bL/N),
  the banded Toeplitz strategy optimized for the run's workload (Keras's SGD with momentum and the learning-rate
  schedule, :func:`keras_dpsgd.dp.bandmf.sgd_workload`), σ calibrated for ⌈T/b⌉ rounds at q'
  (:class:`keras_dpsgd.accounting.BandMFEvent`). ``--bands auto`` takes the b of ``--band-choices`` whose
  expected error σ_b² ‖A C_b⁻¹‖_F² is the smallest (b = 1: BandMF is DP-SGD): the choice uses no data.

ε is read from each model's ledger. Needs MNIST's IDX files (``--data-dir``); downloads nothing. The ScatterNet
features are computed once (about 10 minutes on 2 cores) and kept in ``--cache``.

    python benchmarks/bandmf.py --data-dir DIR --cache scatter.npz --target-epsilon 2 --seed 0 --method both
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _mnist, _scatter
import _mnist  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _mnist.add_common_arguments(p)
    p.add_argument("--cache", required=True, help=".npz file caching the ScatterNet features (public transform)")
    p.add_argument("--method", choices=("bandmf", "dpsgd", "both"), default="both")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lot-size", type=int, default=1024, help="expected lot size L (both methods)")
    p.add_argument("--bands", default="auto", help="b, or 'auto' (the smallest expected error)")
    p.add_argument("--band-choices", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--lr-end", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--stability", type=float, default=0.01)
    p.add_argument("--groups", type=int, default=27)
    p.set_defaults(ema=0.99)
    return p


def _features(args):
    import numpy as np

    import _scatter

    data = _mnist.load(args.data_dir, args.max_train_examples, signed_pixels=True)
    if os.path.exists(args.cache):
        with np.load(args.cache) as f:
            train, test = f["train"], f["test"]
    else:
        train, test = _scatter.scatter(data.x_train), _scatter.scatter(data.x_test)
        np.savez(args.cache, train=train, test=test)
    data.x_train = _scatter.group_normalize(train[: len(data.x_train)], args.groups)
    data.x_test = _scatter.group_normalize(test, args.groups)
    return data


def _learning_rates(args, steps):
    import numpy as np

    return np.linspace(args.lr, args.lr_end, steps) if steps > 1 else np.array([args.lr])


def _plan(args, n, steps):
    """(b, strategy, σ, expected error ratio to DP-SGD, per b) of the BandMF run; σ of DP-SGD."""
    from keras_dpsgd.accounting import BandMFEvent, calibrate_noise_multiplier, compute_noise_multiplier
    from keras_dpsgd.dp.bandmf import BandedToeplitzStrategy, optimize_banded_toeplitz, sgd_workload

    q = args.lot_size / n
    sigma_dpsgd = compute_noise_multiplier(
        target_epsilon=args.target_epsilon, target_delta=args.delta, sampling_rate=q, steps=steps
    )
    workload = sgd_workload(steps, momentum=args.momentum, learning_rates=_learning_rates(args, steps))
    baseline = sigma_dpsgd**2 * BandedToeplitzStrategy.identity(steps).error(workload)
    choices = args.band_choices if args.bands == "auto" else [int(args.bands)]
    plans = []
    for b in choices:
        if b * q > 1 or b > steps:
            continue
        strategy = optimize_banded_toeplitz(steps, b, workload=workload)
        sigma = calibrate_noise_multiplier(
            lambda s, b=b, c=strategy.column_norm: BandMFEvent(b * q, s, steps=steps, bands=b, column_norm=c),
            target_epsilon=args.target_epsilon,
            target_delta=args.delta,
        )
        plans.append((b, strategy, sigma, sigma**2 * strategy.error(workload) / baseline))
    return min(plans, key=lambda p: p[3]), {p[0]: round(p[3], 4) for p in plans}, sigma_dpsgd


def _run(args, data, method, plan, sigma_dpsgd, steps):
    import keras

    import keras_dpsgd.keras3 as k3
    from keras_dpsgd import CyclicPoissonLots, PoissonLots, model_epsilon

    start = time.perf_counter()
    keras.utils.set_random_seed(args.seed)
    b, strategy, sigma, _ = plan
    common = dict(
        clipping="normalize",
        stability=args.stability,
        momentum=args.momentum,
        learning_rate=keras.optimizers.schedules.PolynomialDecay(args.lr, steps, end_learning_rate=args.lr_end),
        seed=args.seed,
        use_ema=True,
        ema_momentum=args.ema,
    )
    if method == "bandmf":
        lots = CyclicPoissonLots(data.x_train, data.y_train, bands=b, expected_lot_size=args.lot_size, seed=args.seed)
        optimizer = k3.BandMFSGDOptimizer(None, sigma, strategy=strategy, **common)
    else:
        lots = PoissonLots(data.x_train, data.y_train, expected_lot_size=args.lot_size, seed=args.seed)
        optimizer = k3.DPSGDOptimizer(None, sigma_dpsgd, **common)
    model = k3.make_private(
        keras.Sequential([keras.Input(data.x_train.shape[1:]), keras.layers.Flatten(), keras.layers.Dense(10)])
    )
    model.compile(
        optimizer=lots.configure(optimizer),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    model.fit(lots.dataset(lots.lots_per_epoch), epochs=args.epochs, verbose=0)
    _, accuracy = model.evaluate(data.x_test, data.y_test, batch_size=2000, verbose=0)
    epsilon, delta = model_epsilon(model, target_delta=args.delta)
    return {
        "method": method,
        "bands": b if method == "bandmf" else 1,
        "sigma": float(sigma if method == "bandmf" else sigma_dpsgd),
        "sampling_rate": float(lots.sampling_rate),
        "steps": int(optimizer.noised_steps.numpy()),
        "epsilon": float(epsilon),
        "delta": float(delta),
        "accuracy": float(accuracy),
        "wall_s": round(time.perf_counter() - start, 1),
        "load_average": os.getloadavg(),
    }


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    data = _features(args)
    n = len(data.x_train)
    steps = args.epochs * math.ceil(n / args.lot_size)
    plan, ratios, sigma_dpsgd = _plan(args, n, steps)
    result = _mnist.record("bandmf.py", args, argv, n)
    paths = ((args.data_dir, "MNIST_DIR"), (args.cache, "scatter.npz"), (args.log or "\0", "runs.jsonl"))
    for path, placeholder in paths:  # no local paths
        result["command"] = result["command"].replace(path, placeholder)
    result["settings"]["cache"] = "scatter.npz"
    result.update(
        planned_steps=steps,
        expected_error_ratio_by_bands=ratios,
        strategy=list(plan[1].coefficients),
        column_norm=plan[1].column_norm,
    )
    methods = ("dpsgd", "bandmf") if args.method == "both" else (args.method,)
    result["runs"] = [_run(args, data, m, plan, sigma_dpsgd, steps) for m in methods]
    return _mnist.finish(result, args.log)


if __name__ == "__main__":
    print(json.dumps(main(), sort_keys=True))

"""A small tanh CNN on real MNIST at a fixed (ε, δ) through the public API: prints one JSON object.

Papernot et al. (2021)'s end-to-end network (two tanh convolutions with max pooling, 32 tanh units,
about 26,000 weights), Poisson lots (`PoissonLots`), σ calibrated by the library's accountant so that
the planned epochs spend exactly the target ε (δ = 1e-5), `WithinLimit` as a guard; ε is read from
the model's ledger. Pixels are scaled to [-1, 1] with public constants (no data-dependent statistics).

The per-example step is one of (``--clipping``):

* ``clip`` with ``--clip C``: flat clipping at C (the bound a user must tune);
* ``normalize``: per-example normalization g/(||g|| + γ) (Bu et al. 2023; De et al. 2022), no C;
* ``flat-adaptive`` / ``quantile``: the no-tuning bounds of ``keras_dpsgd.tools`` (Three Tools rule
  with one group; Andrew et al. 2021), their norm or count queries charged in the calibration and the
  ledger; ``per-layer-adaptive``: the Three Tools rule with one bound per variable.

``--features scatter`` trains a linear model on ScatterNet features (Tramèr & Boneh 2021) instead of
the CNN on pixels.

``--augmentation-multiplicity K`` (pixels only; De et al. 2022): each example's loss is the mean over K
random translations of it by up to ``--translate`` pixels (``keras_dpsgd.tf_keras.make_private(model,
augmentation=RandomTranslation, augmentation_multiplicity=K)``); its gradient is clipped once, so σ and
ε are those of the run without augmentation. (The ScatterNet features are computed once per image
before training, so pixel augmentation does not combine with them here.)

``--ema M`` evaluates Keras' moving average of the weights (post-processing, no privacy cost). ``--log
FILE --run NAME`` appends the JSON object to FILE (benchmarks/results/mnist_cnn_runs.jsonl holds every
run made with it). Needs MNIST's IDX files (``--data-dir``); it downloads nothing.

    python benchmarks/mnist_cnn.py --data-dir DIR --clipping normalize --lot-size 2048 --epochs 40 --lr 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _mnist, _scatter
import _mnist  # noqa: E402

MODES = ("clip", "normalize", "flat-adaptive", "quantile", "per-layer-adaptive")
ADAPTIVE = MODES[2:]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _mnist.add_common_arguments(p)
    p.add_argument("--epochs", type=int, default=40, help="planned epochs (σ is calibrated to them)")
    p.add_argument("--lot-size", type=int, default=2048, help="expected Poisson lot size L")
    p.add_argument("--clipping", choices=MODES, default="normalize")
    p.add_argument("--clip", type=float, default=1.0, help="clip: the flat bound C")
    p.add_argument("--stability", type=float, default=0.01, help="normalize: γ")
    p.add_argument("--alpha", type=float, default=1.0, help="flat-adaptive: C_t = α × noised mean norm")
    p.add_argument("--quantile", type=float, default=0.5, help="quantile: the target quantile of the norms")
    p.add_argument(
        "--query-noise", type=float, default=None, help="flat-adaptive/quantile: σ of the query (default: L/20)"
    )
    p.add_argument(
        "--unit-step",
        action="store_true",
        help="the step in units of the bound: clip: lr/C; flat-adaptive/quantile: divide_by_bound=True "
        "(the released gradient divided by the bound in force); normalize: no effect (its bound is 1)",
    )
    p.add_argument("--lr", type=float, default=4.0)
    p.add_argument("--lr-end", type=float, default=None, help="linear decay to this rate (default: constant)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument(
        "--features",
        choices=("pixels", "scatter"),
        default="pixels",
        help="pixels: the tanh CNN on [-1, 1] pixels; scatter: a linear model on ScatterNet features "
        "(J = 2, L = 8: 81 × 7 × 7, benchmarks/_scatter.py) group-normalized per example (Tramèr & Boneh 2021)",
    )
    p.add_argument("--groups", type=int, default=27, help="scatter: groups of the per-example normalization")
    p.add_argument("--cache", default=None, help="scatter: .npz file caching the features (public transform)")
    p.add_argument("--activation", default="tanh")
    p.add_argument("--filters", type=int, nargs=2, default=[16, 32])
    p.add_argument("--dense", type=int, default=32)
    p.add_argument(
        "--augmentation-multiplicity",
        type=int,
        default=1,
        help="pixels: K random translations of each example, averaged into its one clipped gradient (1: none)",
    )
    p.add_argument("--translate", type=float, default=2.0, help="augmentation: the largest shift, in pixels")
    return p


def _augmented(args, model):
    """The model with the private step on K translated views of each example (--augmentation-multiplicity)."""
    import tf_keras as keras

    from keras_dpsgd.tf_keras import make_private

    if args.augmentation_multiplicity == 1:
        return model
    if args.features != "pixels":
        raise ValueError("--augmentation-multiplicity needs --features pixels (the features are fixed per image)")
    shift = args.translate / 28.0
    translate = keras.layers.RandomTranslation(
        shift, shift, fill_mode="constant", fill_value=-1.0, interpolation="nearest", seed=args.seed
    )
    return make_private(model, augmentation=translate, augmentation_multiplicity=args.augmentation_multiplicity)


def _scatter_features(args, data):
    """ScatterNet features, group-normalized per example: a fixed map of each image alone (no privacy cost)."""
    import numpy as np

    import _scatter

    if args.cache and os.path.exists(args.cache):
        with np.load(args.cache) as f:
            train, test = f["train"], f["test"]
    else:
        train, test = _scatter.scatter(data.x_train), _scatter.scatter(data.x_test)
        if args.cache:
            np.savez(args.cache, train=train, test=test)
    if len(train) != len(data.x_train):
        raise ValueError(f"--cache holds {len(train)} training rows, the data {len(data.x_train)}")
    data.x_train = _scatter.group_normalize(train, args.groups)
    data.x_test = _scatter.group_normalize(test, args.groups)
    return data


def _model(args, input_shape):
    import tf_keras as keras

    if args.features == "scatter":  # a linear model on the features
        return keras.Sequential([keras.Input(shape=input_shape), keras.layers.Flatten(), keras.layers.Dense(10)])
    act, (f1, f2) = args.activation, args.filters
    return keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            keras.layers.Conv2D(f1, 8, strides=2, padding="same", activation=act),
            keras.layers.MaxPool2D(2, strides=1),
            keras.layers.Conv2D(f2, 4, strides=2, padding="valid", activation=act),
            keras.layers.MaxPool2D(2, strides=1),
            keras.layers.Flatten(),
            keras.layers.Dense(args.dense, activation=act),
            keras.layers.Dense(10),
        ]
    )


def _learning_rate(args, steps, scale: float = 1.0):
    import tf_keras as keras

    if args.lr_end is None:
        return args.lr * scale
    steps = steps or args._planned
    return keras.optimizers.schedules.PolynomialDecay(args.lr * scale, steps, end_learning_rate=args.lr_end * scale)


def _events(args, q: float, steps: int, num_vars: int):
    """σ ↦ the events of the planned steps (with the bound's queries for the adaptive modes)."""
    from keras_dpsgd.accounting import PoissonSampledGaussianEvent

    if args.clipping in ("clip", "normalize"):
        return lambda s: PoissonSampledGaussianEvent(q, s, steps)
    from keras_dpsgd.tools import adaptive_clipping_event

    return lambda s: adaptive_clipping_event(  # one gradient release and one query per step
        noise_multiplier=s,
        norm_noise_multiplier=_query_noise(args),
        num_layers=num_vars if args.clipping == "per-layer-adaptive" else 1,
        sampling_rate=q,
        steps=steps,
    )


def _query_noise(args) -> float:
    """σ of the bound's query: Andrew et al. 2021's L/20 unless given."""
    return args.query_noise if args.query_noise is not None else args.lot_size / 20.0


def _optimizer(args, model, sigma: float, learning_rate):
    from keras_dpsgd.tf_keras import DPSGDOptimizer

    common = dict(learning_rate=learning_rate, momentum=args.momentum, seed=args.seed)
    common.update(_mnist.ema_kwargs(args.ema))
    if args.clipping == "clip":
        if args.unit_step:  # the same step size for every C: only the clipping changes
            common["learning_rate"] = _learning_rate(args, None, scale=1.0 / args.clip)
        return DPSGDOptimizer(args.clip, sigma, **common)
    if args.clipping == "normalize":
        return DPSGDOptimizer(None, sigma, clipping="normalize", stability=args.stability, **common)
    from keras_dpsgd.tf_keras import AdaptiveDPSGDOptimizer, initial_clip_bounds, initial_flat_clip_bound

    start = initial_flat_clip_bound(model, seed=args.seed)  # random noise: no privacy cost
    if args.clipping == "per-layer-adaptive":
        start = initial_clip_bounds(model, seed=args.seed)
    if args.clipping != "quantile":
        mode = dict(alpha=args.alpha)
    else:
        mode = dict(rule="quantile", target_quantile=args.quantile)
    return AdaptiveDPSGDOptimizer(start, sigma, _query_noise(args), divide_by_bound=args.unit_step, **mode, **common)


def run_private(args, data) -> dict:
    import tf_keras as keras

    from keras_dpsgd import PoissonLots
    from keras_dpsgd.accounting import calibrate_noise_multiplier
    from keras_dpsgd.tf_keras import ClipBoundsLogger

    start = time.perf_counter()
    model = _augmented(args, _model(args, data.x_train.shape[1:]))
    lots = PoissonLots(data.x_train, data.y_train, expected_lot_size=args.lot_size, seed=args.seed)
    planned = args.epochs * lots.steps_per_epoch
    args._planned = planned
    sigma = calibrate_noise_multiplier(
        _events(args, lots.sampling_rate, planned, len(model.trainable_variables)),
        target_epsilon=args.target_epsilon,
        target_delta=args.delta,
    )
    optimizer = lots.configure(_optimizer(args, model, sigma, _learning_rate(args, planned)))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"),
        weighted_metrics=["accuracy"],
    )
    bounds = ClipBoundsLogger()  # per-epoch bounds of the adaptive modes (nothing for the others)
    _, out = _mnist.fit_and_report(
        model, optimizer, lots, data, args, callbacks=[bounds], planned=planned, sigma=sigma, start=start
    )
    out["num_weights"] = int(model.count_params())
    if args.clipping in ADAPTIVE:  # flat: the same C for every variable
        per_layer = args.clipping == "per-layer-adaptive"
        out["clip_bound_per_epoch"] = [
            [float(f"{v:.4g}") for v in b.values()] if per_layer else float(f"{next(iter(b.values())):.4g}")
            for b in bounds.history
        ]
        out["effective_noise_multiplier"] = float(optimizer.effective_noise_multiplier)
    return out


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    _mnist.seed_everything(args.seed)
    data = _mnist.load(args.data_dir, args.max_train_examples, signed_pixels=True)
    if args.features == "scatter":
        data = _scatter_features(args, data)
    result = _mnist.record("mnist_cnn.py", args, argv, len(data.x_train))
    result.update(run_private(args, data))
    return _mnist.finish(result, args.log)


if __name__ == "__main__":
    print(json.dumps(main(), sort_keys=True))

"""Abadi et al. (2016), Sec. 5.1, on real MNIST through the public API: prints one JSON object.

The paper's pipeline: DP-PCA to 60 dimensions on a Poisson sample (σ_p on AᵀA),
one hidden layer of 1000 ReLU units, Poisson lots of 600, clipping bound 4,
learning rate 0.1 decaying linearly to 0.052 over 10 epochs, then constant,
trained until the (ε, δ = 1e-5) budget is spent (`WithinLimit`). Every data
access (DP-PCA and every step) is in the model's ledger; ε is read from it.

Two ways to spend the budget:

* ``--sigma S`` (the paper): a fixed σ, trained until `WithinLimit` stops.
* ``--epochs E`` without ``--sigma``: σ calibrated so that DP-PCA plus E epochs
  of steps spend exactly the target (``calibrate_noise_multiplier``).

The non-private baseline of the same pipeline (PCA without noise on all the
training data, plain SGD, same model, lots and schedule) is trained for
``--baseline-epochs`` (0 to skip). Needs MNIST's IDX files (``--data-dir``);
it downloads nothing.

    python benchmarks/mnist_paper.py --data-dir ../shared/data/mnist --target-epsilon 2 --sigma 4
    python benchmarks/mnist_paper.py --data-dir DIR --target-epsilon 2 --epochs 30 --clip-mode flat

The defaults are the paper's; docs/reports/mnist.md ("Abadi et al. 2016 on MNIST: paper vs
keras_dpsgd") gives the tuned commands (large lots, flat clip 1, momentum 0.9, a
larger step decaying over the whole run; at ε = 2 500 tanh units) and what
changed the accuracy. ``--log
FILE --run NAME`` appends the JSON object to FILE
(benchmarks/results/mnist_paper_runs.jsonl holds every run made with it).
``--ema M`` evaluates Keras' moving average of the weights (post-processing, no
privacy cost); ``--clip-mode adaptive`` is the Three Tools' adaptive per-layer
clipping, its norm queries in the calibration and the ledger.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _mnist
import _mnist  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _mnist.add_common_arguments(p)
    p.add_argument("--sigma", type=float, default=None, help="fixed σ (paper); default: calibrated to --epochs")
    p.add_argument("--epochs", type=int, default=100, help="planned epochs (with --sigma: at most)")
    p.add_argument("--lot-size", type=int, default=600)
    p.add_argument("--clip", type=float, default=4.0)
    p.add_argument(
        "--clip-mode",
        choices=("flat", "per-layer", "adaptive"),
        default="flat",
        help="flat: one bound C on the whole gradient; per-layer: C per variable, σ_v = σ·√V; "
        "adaptive: per-variable bounds α × a DP estimate of the mean norm (Three Tools, Sec. 3), "
        "σ per variable with the norm queries in the ledger",
    )
    p.add_argument("--norm-noise", type=float, default=10.0, help="adaptive: σ_l2 of each norm query")
    p.add_argument("--alpha", type=float, default=1.0, help="adaptive: bound = α × the noised mean norm")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--lr-end", type=float, default=0.052)
    p.add_argument("--lr-decay-epochs", type=float, default=10.0)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--pca-components", type=int, default=60, help="0: no PCA (raw 784 pixels)")
    p.add_argument("--pca-noise", type=float, default=7.0)
    p.add_argument("--pca-sampling-rate", type=float, default=0.1)
    p.add_argument("--pca-normalize-inputs", action="store_true", help="project unit-norm rows (as adapt sees them)")
    p.add_argument("--hidden", type=int, default=1000)
    p.add_argument("--activation", default="relu", help="hidden activation (the paper: relu; e.g. tanh)")
    p.add_argument("--baseline-epochs", type=int, default=0, help="non-private baseline epochs (0: skip)")
    return p


def _model(pca, hidden: int, activation: str):
    import tf_keras as keras

    inputs = keras.Input(shape=(28, 28, 1))
    x = pca(inputs) if pca is not None else keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(hidden, activation=activation, name="hidden")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(x))


def _schedule(args, steps_per_epoch: int):
    import tf_keras as keras

    decay = max(1, int(round(args.lr_decay_epochs * steps_per_epoch)))
    return keras.optimizers.schedules.PolynomialDecay(args.lr, decay, end_learning_rate=args.lr_end)


def _pca(args, data, noise: float, rate: float):
    from keras_dpsgd.tf_keras import DPPCA

    if not args.pca_components:
        return None
    pca = DPPCA(
        args.pca_components,
        noise_multiplier=noise,
        sampling_rate=rate,
        normalize_inputs=args.pca_normalize_inputs,
        seed=args.seed,
        name="dp_pca",
    )
    pca.adapt(data.x_train)
    return pca


def _step_events(args, q: float, steps: int, num_vars: int):
    """σ ↦ the events of the planned DP-SGD steps (adaptive clipping: with its norm queries)."""
    from keras_dpsgd.accounting import PoissonSampledGaussianEvent
    from keras_dpsgd.tools import adaptive_clipping_event

    if args.clip_mode == "adaptive":
        return lambda s: adaptive_clipping_event(
            noise_multiplier=s, norm_noise_multiplier=args.norm_noise, num_layers=num_vars, sampling_rate=q, steps=steps
        )
    return lambda s: PoissonSampledGaussianEvent(q, s, steps)


def _calibrated_sigma(args, pca, q: float, steps: int, num_vars: int) -> float:
    """σ such that the DP-PCA release already made (its events) plus the planned steps spend the target ε."""
    from keras_dpsgd.accounting import calibrate_noise_multiplier

    return calibrate_noise_multiplier(
        _step_events(args, q, steps, num_vars),
        target_epsilon=args.target_epsilon,
        target_delta=args.delta,
        prior_events=pca.privacy_events if pca else (),
    )


def _optimizer(args, model, sigma: float, learning_rate):
    """The DP optimizer of --clip-mode: flat C; C per variable with σ√V (σ_eff = σ); adaptive per variable."""
    from keras_dpsgd.tf_keras import AdaptiveDPSGDOptimizer, DPSGDOptimizer
    from keras_dpsgd.tools import initial_clip_bounds

    common = dict(learning_rate=learning_rate, momentum=args.momentum, seed=args.seed, **_mnist.ema_kwargs(args.ema))
    num_vars = len(model.trainable_variables)
    if args.clip_mode == "adaptive":  # C_0 from random noise (public), then α × the noised mean norms
        bounds = initial_clip_bounds(model, seed=args.seed)
        return AdaptiveDPSGDOptimizer(bounds, sigma, args.norm_noise, alpha=args.alpha, **common)
    if args.clip_mode == "flat":
        return DPSGDOptimizer(args.clip, sigma, **common)
    return DPSGDOptimizer([args.clip] * num_vars, [sigma * math.sqrt(num_vars)] * num_vars, **common)


def run_private(args, data) -> dict:
    import tf_keras as keras

    from keras_dpsgd import PoissonLots

    start = time.perf_counter()
    pca = _pca(args, data, args.pca_noise, args.pca_sampling_rate)
    model = _model(pca, args.hidden, args.activation)
    lots = PoissonLots(data.x_train, data.y_train, expected_lot_size=args.lot_size, seed=args.seed)
    planned = args.epochs * lots.steps_per_epoch
    num_vars = len(model.trainable_variables)
    sigma = args.sigma
    if sigma is None:
        sigma = _calibrated_sigma(args, pca, lots.sampling_rate, planned, num_vars)
    optimizer = lots.configure(_optimizer(args, model, sigma, _schedule(args, lots.steps_per_epoch)))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"),
        weighted_metrics=["accuracy"],
    )
    _, out = _mnist.fit_and_report(
        model, optimizer, lots, data, args, callbacks=[], planned=planned, sigma=sigma, start=start
    )
    out["sigma_calibrated"] = args.sigma is None
    out["effective_noise_multiplier"] = float(optimizer.effective_noise_multiplier)
    return out


def run_baseline(args, data) -> dict:
    import tf_keras as keras

    start = time.perf_counter()
    pca = _pca(args, data, 0.0, 1.0)  # non-private PCA on all the training data
    model = _model(pca, args.hidden, args.activation)
    steps_per_epoch = math.ceil(len(data.x_train) / args.lot_size)
    model.compile(
        optimizer=keras.optimizers.SGD(
            _schedule(args, steps_per_epoch), momentum=args.momentum, **_mnist.ema_kwargs(args.ema)
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(data.x_train, data.y_train, batch_size=args.lot_size, epochs=args.baseline_epochs, verbose=0)
    _, accuracy = model.evaluate(data.x_test, data.y_test, batch_size=2000, verbose=0)
    return {"accuracy": float(accuracy), "epochs": args.baseline_epochs, "wall_s": time.perf_counter() - start}


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    _mnist.seed_everything(args.seed)
    data = _mnist.load(args.data_dir, args.max_train_examples)
    result = _mnist.record("mnist_paper.py", args, argv, len(data.x_train))
    result.update(run_private(args, data))
    if args.baseline_epochs:
        result["non_private_baseline"] = run_baseline(args, data)
    return _mnist.finish(result, args.log)


if __name__ == "__main__":
    print(json.dumps(main(), sort_keys=True))

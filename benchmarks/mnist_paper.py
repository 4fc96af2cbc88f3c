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

The README's "MNIST: Abadi et al. 2016, measured" lists every run made with it
(benchmarks/results/mnist_paper_runs.jsonl) and what changed the accuracy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="directory of MNIST's IDX files (plain or .gz)")
    p.add_argument("--target-epsilon", type=float, default=2.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--sigma", type=float, default=None, help="fixed σ (paper); default: calibrated to --epochs")
    p.add_argument("--epochs", type=int, default=100, help="planned epochs (with --sigma: at most)")
    p.add_argument("--lot-size", type=int, default=600)
    p.add_argument("--clip", type=float, default=4.0)
    p.add_argument("--clip-mode", choices=("flat", "per-layer"), default="flat",
                   help="flat: one bound C on the whole gradient; per-layer: C per variable, σ_v = σ·√V")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--lr-end", type=float, default=0.052)
    p.add_argument("--lr-decay-epochs", type=float, default=10.0)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--pca-components", type=int, default=60, help="0: no PCA (raw 784 pixels)")
    p.add_argument("--pca-noise", type=float, default=7.0)
    p.add_argument("--pca-sampling-rate", type=float, default=0.1)
    p.add_argument("--pca-normalize-inputs", action="store_true", help="project unit-norm rows (as adapt sees them)")
    p.add_argument("--hidden", type=int, default=1000)
    p.add_argument("--baseline-epochs", type=int, default=0, help="non-private baseline epochs (0: skip)")
    p.add_argument("--max-train-examples", type=int, default=None, help="first N training images only (quick runs)")
    p.add_argument("--seed", type=int, default=None)
    return p


def _load(data_dir: str, limit):
    from keras_dpsgd._datasets import load_dataset

    data = load_dataset("mnist", data_dir=data_dir)
    if limit:
        data.x_train, data.y_train = data.x_train[:limit], data.y_train[:limit]
    return data


def _model(pca, hidden: int):
    import tf_keras as keras

    inputs = keras.Input(shape=(28, 28, 1))
    x = pca(inputs) if pca is not None else keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(hidden, activation="relu", name="hidden")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(x))


def _schedule(args, steps_per_epoch: int):
    import tf_keras as keras

    decay = max(1, int(round(args.lr_decay_epochs * steps_per_epoch)))
    return keras.optimizers.schedules.PolynomialDecay(args.lr, decay, end_learning_rate=args.lr_end)


def _pca(args, data, noise: float, rate: float):
    from keras_dpsgd.tf_keras import DPPCA

    if not args.pca_components:
        return None
    pca = DPPCA(args.pca_components, noise_multiplier=noise, sampling_rate=rate,
                normalize_inputs=args.pca_normalize_inputs, seed=args.seed, name="dp_pca")
    pca.adapt(data.x_train)
    return pca


def _calibrated_sigma(args, q: float, steps: int, num_vars: int) -> float:
    from keras_dpsgd.accounting import GaussianEvent, PoissonSampledGaussianEvent, calibrate_noise_multiplier

    pca = []
    if args.pca_components:
        r = args.pca_sampling_rate
        pca = [GaussianEvent(args.pca_noise) if r == 1 else PoissonSampledGaussianEvent(r, args.pca_noise, 1)]
    return calibrate_noise_multiplier(lambda s: pca + [PoissonSampledGaussianEvent(q, s, steps)],
                                      target_epsilon=args.target_epsilon, target_delta=args.delta)


def run_private(args, data) -> dict:
    import tf_keras as keras

    from keras_dpsgd import PoissonLots, WithinLimit, model_epsilon
    from keras_dpsgd.tf_keras import DPSGDOptimizer

    start = time.perf_counter()
    pca = _pca(args, data, args.pca_noise, args.pca_sampling_rate)
    model = _model(pca, args.hidden)
    lots = PoissonLots(data.x_train, data.y_train, expected_lot_size=args.lot_size, seed=args.seed)
    planned = args.epochs * lots.steps_per_epoch
    num_vars = len(model.trainable_variables)
    sigma = args.sigma if args.sigma is not None else _calibrated_sigma(args, lots.sampling_rate, planned, num_vars)
    if args.clip_mode == "flat":
        clip, noise = args.clip, sigma
    else:  # every variable clipped to C and noised with σ√V: the accounted σ_eff is σ
        clip, noise = [args.clip] * num_vars, [sigma * math.sqrt(num_vars)] * num_vars
    optimizer = lots.configure(DPSGDOptimizer(clip, noise, learning_rate=_schedule(args, lots.steps_per_epoch),
                                              momentum=args.momentum, seed=args.seed))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"),
                  weighted_metrics=["accuracy"])
    limit = WithinLimit(args.target_epsilon, args.delta)
    history = model.fit(lots.dataset(), epochs=args.epochs, steps_per_epoch=lots.steps_per_epoch,
                        callbacks=[limit], validation_data=(data.x_test, data.y_test),
                        validation_batch_size=2000, verbose=0)
    epsilon, delta = model_epsilon(model, target_delta=args.delta)
    _, accuracy = model.evaluate(data.x_test, data.y_test, batch_size=2000, verbose=0)
    steps = int(optimizer.noised_steps.numpy())
    return {
        "epsilon": float(epsilon), "delta": float(delta), "accuracy": float(accuracy),
        "epochs": steps / lots.steps_per_epoch, "steps": steps, "planned_steps": planned,
        "sigma": float(sigma), "sigma_calibrated": args.sigma is None,
        "val_accuracy_per_epoch": [round(a, 4) for a in history.history.get("val_accuracy", [])],
        "wall_s": time.perf_counter() - start,
    }


def run_baseline(args, data) -> dict:
    import tf_keras as keras

    start = time.perf_counter()
    pca = _pca(args, data, 0.0, 1.0)  # non-private PCA on all the training data
    model = _model(pca, args.hidden)
    steps_per_epoch = math.ceil(len(data.x_train) / args.lot_size)
    model.compile(optimizer=keras.optimizers.SGD(_schedule(args, steps_per_epoch), momentum=args.momentum),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(data.x_train, data.y_train, batch_size=args.lot_size, epochs=args.baseline_epochs, verbose=0)
    _, accuracy = model.evaluate(data.x_test, data.y_test, batch_size=2000, verbose=0)
    return {"accuracy": float(accuracy), "epochs": args.baseline_epochs, "wall_s": time.perf_counter() - start}


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    import tf_keras as keras

    if args.seed is not None:
        keras.utils.set_random_seed(args.seed)
    data = _load(args.data_dir, args.max_train_examples)
    result = {"command": "python benchmarks/mnist_paper.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
              "target_epsilon": args.target_epsilon, "num_examples": int(len(data.x_train)),
              "settings": {k: v for k, v in vars(args).items() if k != "data_dir"}}
    result.update(run_private(args, data))
    if args.baseline_epochs:
        result["non_private_baseline"] = run_baseline(args, data)
    result["load_average"] = os.getloadavg()
    result["cpus"] = os.cpu_count()
    return result


if __name__ == "__main__":
    print(json.dumps(main(), sort_keys=True))

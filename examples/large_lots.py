"""Large lots with a linearly scaled learning rate (van der Veen et al. 2018, Sec. 4, Table 1).

At a fixed (ε, δ) and number of epochs, larger lots need a noise multiplier
that grows more slowly than the lot, so the noise per example σ/L falls
(amplification by sampling). Large lots only pay off when the learning rate
grows with the lot (Goyal et al. 2017): lr(L) = lr_base · L / L_base. Lots
larger than memory are split into physical batches whose clipped gradients
are accumulated before the noise is added once (gradient_accumulation_steps).

For each lot size this script takes σ from the accountant's batch table,
trains with the scaled learning rate (Poisson lots, physical batches of at
most --max-batch-size rows) and, for the largest lot, also with the base
learning rate. Every run is charged to its own ledger; each one alone meets
the target ε, but they all touch the same data: together they cost more
(a comparison like this is a hyperparameter search on real data).

    python examples/large_lots.py                # offline: scikit-learn digits, a few minutes on 2 cores
    python examples/large_lots.py --smoke        # < 30 s
    python examples/large_lots.py --dataset cifar10   # paper scale: 60 epochs, ε = 20, lots 128/512/1024
    python examples/large_lots.py --plot lots.png     # the noise-per-example plot: pip install "keras-dpsgd[plot]"
    TF_USE_LEGACY_KERAS=1 python examples/large_lots.py   # on tf_keras

Keras 3 by default, tf_keras where ``TF_USE_LEGACY_KERAS=1`` (TensorFlow's rule
for ``tf.keras``; the output says which). On both, each lot is split into
physical batches of at most --max-batch-size rows whose clipped sums are
accumulated and noised once per lot.
"""

import argparse
import json

from keras_dpsgd.cli import add_option, exit_unless_installed, import_tensorflow_quietly

import_tensorflow_quietly()  # TF_CPP_MIN_LOG_LEVEL=2 unless set; no start-up log lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny run (< 30 s)")
    p.add_argument("--dataset", choices=["digits", "cifar10"], default="digits")
    p.add_argument("--data-dir", default=None, help="tensorflow-datasets data directory (cifar10)")
    p.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="local data instead of --dataset: .npz (x_train, y_train[, x_test, y_test]) or IDX directory",
    )
    p.add_argument("--lot-sizes", type=int, nargs="+", default=None)
    p.add_argument("--epochs", type=float, default=None)
    add_option(p, "--target-epsilon", "--epsilon", type=float, default=None)
    p.add_argument("--base-learning-rate", type=float, default=None)
    p.add_argument("--base-lot-size", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=None, help="largest physical batch (memory)")
    p.add_argument("--plot", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.plot:
        exit_unless_installed("matplotlib", "plot", needed_by="--plot")

    import numpy as np

    from keras_dpsgd import PoissonLots
    from keras_dpsgd.data import models as _models
    from keras_dpsgd.accounting import compute_epsilon, default_delta
    from keras_dpsgd.ledger import model_privacy_ledger
    from keras_dpsgd.tools import large_lot_table, load_digits, load_tfds, plot_noise_per_example

    from keras_dpsgd.data.datasets import load_local_arrays as load_arrays

    front = _models.front_end()  # "keras3", or "tf_keras" with TF_USE_LEGACY_KERAS=1

    rng = np.random.default_rng(args.seed)
    if args.data or args.dataset == "cifar10":
        (xtr, ytr), (xte, yte) = load_arrays(args.data) if args.data else load_tfds("cifar10", data_dir=args.data_dir)
        kind, width = "cnn", 256
        d = dict(lots=[128, 512, 1024], epochs=60, eps=20.0, lr=0.01, base=128, cap=256, clip=1.0)
    else:
        (xtr, ytr), (xte, yte) = load_digits(rng)
        if args.smoke:
            xtr, ytr, xte, yte = xtr[:200], ytr[:200], xte[:100], yte[:100]
            d = dict(lots=[16, 48], epochs=1, eps=3.0, lr=0.05, base=16, cap=48, clip=1.0)
        else:
            d = dict(lots=[32, 128, 256], epochs=20, eps=3.0, lr=0.05, base=32, cap=64, clip=1.0)
        kind, width = "mlp", 32 if args.smoke else 128
    lots_sizes = args.lot_sizes or d["lots"]
    epochs, eps = args.epochs or d["epochs"], args.target_epsilon or d["eps"]
    base_lr, base_lot = args.base_learning_rate or d["lr"], args.base_lot_size or d["base"]
    cap = args.max_batch_size or d["cap"]
    n = len(xtr)
    delta = default_delta(n)
    table = large_lot_table(
        num_examples=n,
        epochs=epochs,
        target_epsilon=eps,
        target_delta=delta,
        lot_sizes=lots_sizes,
        base_learning_rate=base_lr,
        base_lot_size=base_lot,
        max_batch_size=cap,
    )
    if args.plot:
        plot_noise_per_example(table, args.plot)

    def train(row, lr):
        lots = PoissonLots(xtr, ytr, expected_lot_size=row["lot_size"], physical_batch_size=cap, seed=args.seed)
        opt = _models.dp_sgd(
            front,
            l2_norm_clip=d["clip"],
            noise_multiplier=row["noise_multiplier"],
            lots=lots,
            learning_rate=lr,
            momentum=0.9,
            seed=args.seed,
        )
        model = _models.build_model(kind, xtr.shape[1:], 10, width=width, keras_module=_models.keras_module(front))
        model = _models.compile_private(model, opt, front)
        # The table's step count: ceil(epochs * N / L) lots.
        model.fit(
            lots.dataset(num_lots=row["steps"]),
            steps_per_epoch=row["steps"] * lots.gradient_accumulation_steps,
            epochs=1,
            verbose=0,
            shuffle=False,
        )
        acc = float(np.mean(np.argmax(model.predict(xte, verbose=0), -1) == yte))
        spent = compute_epsilon(model_privacy_ledger(model), delta)
        return {
            "lot_size": row["lot_size"],
            "learning_rate": lr,
            "noise_multiplier": row["noise_multiplier"],
            "noise_per_example": row["noise_per_example"],
            "steps": int(opt.noised_steps.numpy()),
            "accumulation_steps": lots.gradient_accumulation_steps,
            "physical_batch_size": lots.physical_batch_size,
            "test_accuracy": acc,
            "epsilon": spent,
        }

    runs = [train(row, row["learning_rate"]) for row in table]
    runs.append(dict(train(table[-1], base_lr), note="base learning rate (not scaled)"))
    if args.json:
        print(
            json.dumps(
                {
                    "table": table,
                    "runs": runs,
                    "delta": delta,
                    "target_epsilon": eps,
                    "keras": _models.keras_label(front),
                }
            )
        )
        return
    print(
        f"{args.dataset}: N = {n}, {epochs} epochs, target epsilon {eps} at delta {delta:.3g}; "
        f"physical batches of <= {cap} rows; "
        f"{_models.keras_display(front)}"
    )
    print(f"{'lot':>6} {'sigma':>8} {'sigma/L':>9} {'lr':>8} {'accum':>6} {'steps':>6} {'epsilon':>8} {'test acc':>9}")
    for r in runs:
        print(
            f"{r['lot_size']:>6} {r['noise_multiplier']:>8.3f} {r['noise_per_example']:>9.4f} "
            f"{r['learning_rate']:>8.4f} {r['accumulation_steps']:>6} {r['steps']:>6} {r['epsilon']:>8.3f} "
            f"{r['test_accuracy']:>9.3f}" + ("  (base lr)" if "note" in r else "")
        )
    print(
        "Each run alone meets the target; all of them together touched the same data (a hyperparameter "
        "search on real data costs privacy: their epsilons compose)."
    )


if __name__ == "__main__":
    main()

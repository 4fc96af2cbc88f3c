"""CLI for the three tools (van der Veen et al. 2018): memorization-test, large-lots, adaptive-clipping-noise.

``--json`` keys. ``memorization-test``: those of ``MemorizationReport.to_dict()``
(both modes). ``large-lots``: target_epsilon, delta,
rows (those of ``large_lot_table``), plot (null without ``--plot``).
``adaptive-clipping-noise``: noise_multiplier, effective_noise_multiplier,
norm_noise_multiplier, num_layers, target_epsilon, delta, sampling_rate, steps.
In the last two the key epsilon (= target_epsilon) is deprecated and will be
removed.
"""

from __future__ import annotations


from keras_dpsgd.cli import add_json_flag, add_option, model_choice, positive_float, positive_int

__all__ = ["register"]

# Shape and class count of the data sets the CLI knows (noise mode needs only these).
_DATASETS = {"digits": ((8, 8, 1), 10), "cifar10": ((32, 32, 3), 10), "mnist": ((28, 28, 1), 10)}


def register(subparsers) -> None:
    _register_memorization(subparsers)
    _register_large_lots(subparsers)
    _register_adaptive(subparsers)


# ------------------------------------------------------------------ memorization-test
def _register_memorization(subparsers) -> None:
    p = subparsers.add_parser(
        "memorization-test",
        help="train on random noise with random labels, with and without DP: does the DP model memorize?",
        description=(
            "Memorization test (Three Tools for Practical DP, Sec. 2). Mode 'noise' (default) trains on "
            "uniform noise with random labels: it touches no real data. Mode 'real' trains on the real "
            "task (digits offline, cifar10/mnist via tensorflow-datasets) and reports test accuracy and "
            "the train-test gap; its DP run is accounted, its non-private run has no guarantee."
        ),
    )
    p.add_argument("--mode", choices=["noise", "real"], default="noise")
    p.add_argument("--dataset", choices=sorted(_DATASETS), default="digits",
                   help="data set whose shape/classes the noise mimics (real mode: the data set trained on)")
    p.add_argument("--data-dir", default=None, help="tensorflow-datasets data_dir (cifar10, mnist)")
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp", type=model_choice("keras-dpsgd memorization-test"))
    p.add_argument("--width", type=positive_int, default=512, help="MLP hidden width")
    p.add_argument("--num-examples", type=positive_int, default=1000, help="noise examples (noise mode)")
    p.add_argument("--epochs", type=positive_int, default=20)
    add_option(p, "--lot-size", "--batch-size", type=positive_int, default=64, metavar="L",
               help="expected Poisson lot size L of the DP run")
    p.add_argument("--physical-batch-size", type=positive_int, default=None,
                   help="split lots into gradient-accumulation steps of this many rows")
    p.add_argument("--l2-norm-clip", type=positive_float, default=1.0)
    p.add_argument("--noise-multiplier", type=float, default=1.1)
    p.add_argument("--learning-rate", type=positive_float, default=0.05, help="DP-SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--nonprivate-learning-rate", type=positive_float, default=0.003, help="Adam, non-private run")
    p.add_argument("--nonprivate-batch-size", type=positive_int, default=32)
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--delta", type=float, default=None, help="default 1/N^1.1")
    p.add_argument("--seed", type=int, default=None, help="for reproducible runs only (default: OS entropy)")
    add_json_flag(p)
    p.set_defaults(func=_memorization, uses_tensorflow=True)


def _memorization(args) -> dict | None:
    from keras_dpsgd.tools import _data
    from keras_dpsgd.tools.memorization import (
        DPSettings,
        convnet_builder,
        memorization_test,
        mlp_builder,
        real_task_test,
    )

    dp = DPSettings(
        l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier, batch_size=args.lot_size,
        learning_rate=args.learning_rate, momentum=args.momentum, physical_batch_size=args.physical_batch_size,
    )
    shape, classes = _DATASETS[args.dataset]
    builder = (mlp_builder(shape, classes, width=args.width) if args.model == "mlp"
               else convnet_builder(shape, classes))
    common = dict(num_classes=classes, dp=dp, epochs=args.epochs, nonprivate_batch_size=args.nonprivate_batch_size,
                  nonprivate_learning_rate=args.nonprivate_learning_rate, confidence=args.confidence,
                  delta=args.delta, seed=args.seed)
    if args.mode == "noise":
        report = memorization_test(builder, input_shape=shape, num_examples=args.num_examples, **common)
    else:
        import numpy as np

        if args.dataset == "digits":
            train, test = _data.load_digits(np.random.default_rng(args.seed))
        else:
            train, test = _data.load_tfds(args.dataset, data_dir=args.data_dir)
        report = real_task_test(builder, train, test, **common)
    if args.json:
        return report.to_dict()
    print(report.summary())
    return None


# ------------------------------------------------------------------ large-lots
def _register_large_lots(subparsers) -> None:
    p = subparsers.add_parser(
        "large-lots",
        help="noise per example vs lot size at fixed (epsilon, delta), with the linearly scaled learning rate",
        description=(
            "Large lots (Three Tools, Sec. 4): the accountant's batch table plus the learning rate scaled "
            "linearly from a base (Goyal et al. 2017) and, with --max-batch-size, the gradient-accumulation "
            "plan for lots larger than memory."
        ),
    )
    p.add_argument("--num-examples", type=positive_int, required=True)
    p.add_argument("--epochs", type=positive_float, required=True)
    add_option(p, "--target-epsilon", "--epsilon", type=positive_float, required=True, metavar="X", help="target ε > 0")
    p.add_argument("--delta", type=float, default=None, help="default 1/N^1.1")
    p.add_argument("--lot-sizes", type=positive_int, nargs="+", default=[128, 256, 512, 1024])
    p.add_argument("--base-learning-rate", type=positive_float, default=0.01)
    p.add_argument("--base-lot-size", type=positive_int, default=128)
    p.add_argument("--max-batch-size", type=positive_int, default=None, help="largest physical batch in memory")
    p.add_argument("--accountant", choices=["rdp", "moments", "pld"], default="rdp")
    p.add_argument("--plot", default=None, metavar="PATH", help="save the noise-per-example plot (matplotlib)")
    add_json_flag(p)
    p.set_defaults(func=_large_lots)


def _large_lots(args) -> dict | None:
    from keras_dpsgd.accounting import check_delta, default_delta
    from keras_dpsgd.tools.large_lots import large_lot_table, plot_noise_per_example

    delta = default_delta(args.num_examples) if args.delta is None else check_delta(args.delta, args.num_examples)
    rows = large_lot_table(
        num_examples=args.num_examples, epochs=args.epochs, target_epsilon=args.target_epsilon, target_delta=delta,
        lot_sizes=args.lot_sizes, base_learning_rate=args.base_learning_rate, base_lot_size=args.base_lot_size,
        max_batch_size=args.max_batch_size, accountant=args.accountant,
    )
    if args.plot:
        plot_noise_per_example(rows, args.plot)
    if args.json:
        return {"delta": delta, "target_epsilon": args.target_epsilon, "epsilon": args.target_epsilon,  # deprecated
                "rows": rows, "plot": args.plot}
    cols = ["lot_size", "steps", "noise_multiplier", "noise_per_example", "learning_rate"]
    if args.max_batch_size:
        cols += ["physical_batch_size", "accumulation_steps"]
    print(f"target epsilon {args.target_epsilon} at delta {delta:.3g}, N = {args.num_examples}, {args.epochs} epochs")
    print("  ".join(f"{c:>18}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>18.6g}" if isinstance(r[c], float) else f"{r[c]:>18}" for c in cols))
    if args.plot:
        print(f"plot saved to {args.plot}")
    return None


# ------------------------------------------------------------------ adaptive-clipping-noise
def _register_adaptive(subparsers) -> None:
    p = subparsers.add_parser(
        "adaptive-clipping-noise",
        help="gradient noise multiplier meeting (epsilon, delta) with adaptive clipping's norm queries",
        description=(
            "Adaptive per-layer clipping (Three Tools, Sec. 3) adds one Gaussian norm query per layer and "
            "step; each step is a sampled Gaussian with sigma_eff = (sum_l 1/sigma_l^2 + sum_l "
            "1/sigma_l2^2)^(-1/2). Finds the per-layer gradient sigma that meets the target."
        ),
    )
    p.add_argument("--num-layers", type=positive_int, required=True, help="clipped variables (layers) V")
    p.add_argument("--norm-noise-multiplier", type=positive_float, required=True, help="sigma_l2 of norm queries")
    add_option(p, "--target-epsilon", "--epsilon", type=positive_float, required=True, metavar="X", help="target ε > 0")
    p.add_argument("--delta", type=float, required=True)
    p.add_argument("--sampling-rate", type=positive_float, required=True)
    p.add_argument("--steps", type=positive_int, required=True)
    p.add_argument("--accountant", choices=["rdp", "moments", "pld"], default="rdp")
    add_json_flag(p)
    p.set_defaults(func=_adaptive)


def _adaptive(args) -> dict | None:
    from keras_dpsgd.tools.adaptive_clipping import calibrate_adaptive_noise_multiplier, composed_noise_multiplier

    sigma = calibrate_adaptive_noise_multiplier(
        num_layers=args.num_layers, norm_noise_multiplier=args.norm_noise_multiplier,
        target_epsilon=args.target_epsilon, target_delta=args.delta, sampling_rate=args.sampling_rate,
        steps=args.steps, accountant=args.accountant,
    )
    sigma_eff = composed_noise_multiplier([sigma] * args.num_layers, [args.norm_noise_multiplier] * args.num_layers)
    result = {"noise_multiplier": sigma, "effective_noise_multiplier": sigma_eff,
              "norm_noise_multiplier": args.norm_noise_multiplier, "num_layers": args.num_layers,
              "target_epsilon": args.target_epsilon, "epsilon": args.target_epsilon,  # epsilon: deprecated
              "delta": args.delta, "sampling_rate": args.sampling_rate, "steps": args.steps}
    if args.json:
        return result
    print(f"per-layer gradient noise multiplier sigma = {sigma:.6g} (sigma_eff per step {sigma_eff:.6g}) "
          f"meets target epsilon {args.target_epsilon} at delta {args.delta} with {args.num_layers} norm queries of "
          f"sigma_l2 = {args.norm_noise_multiplier} per step")
    return None

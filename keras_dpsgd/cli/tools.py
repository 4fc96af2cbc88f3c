"""CLI for the three tools (van der Veen et al. 2018): memorization-test, large-lots, adaptive-clipping-noise.

``large-lots`` is a deprecated alias of ``batch-table`` (see
:mod:`keras_dpsgd.cli.accounting`) with the learning rate on.

``--json`` keys. ``memorization-test``: those of ``MemorizationReport.to_dict()``
(both modes). ``large-lots``: those of ``batch-table``: rows (each lot_size,
sampling_rate, steps, noise_multiplier, noise_per_example, learning_rate, and
with ``--max-batch-size`` physical_batch_size, accumulation_steps),
num_examples, epochs, target_epsilon, delta, accountant, plot.
``adaptive-clipping-noise``: noise_multiplier, effective_noise_multiplier,
norm_noise_multiplier, num_layers, target_epsilon, delta, sampling_rate, steps.
In the last two the key epsilon (= target_epsilon) is deprecated and will be
removed.
"""

from __future__ import annotations


from keras_dpsgd.accounting.accountants import accountant_names
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
    p.add_argument(
        "--dataset",
        choices=sorted(_DATASETS),
        default="digits",
        help="data set whose shape/classes the noise mimics (real mode: the data set trained on)",
    )
    p.add_argument("--data-dir", default=None, help="tensorflow-datasets data_dir (cifar10, mnist)")
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp", type=model_choice("keras-dpsgd memorization-test"))
    p.add_argument("--width", type=positive_int, default=512, help="MLP hidden width")
    p.add_argument("--num-examples", type=positive_int, default=1000, help="noise examples (noise mode)")
    p.add_argument("--epochs", type=positive_int, default=20)
    add_option(
        p,
        "--lot-size",
        "--batch-size",
        type=positive_int,
        default=64,
        metavar="L",
        help="expected Poisson lot size L of the DP run",
    )
    p.add_argument(
        "--physical-batch-size",
        type=positive_int,
        default=None,
        help="split lots into gradient-accumulation steps of this many rows",
    )
    p.add_argument("--l2-norm-clip", type=positive_float, default=1.0)
    p.add_argument("--noise-multiplier", type=float, default=1.1)
    p.add_argument("--learning-rate", type=positive_float, default=0.05, help="DP-SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--nonprivate-learning-rate", type=positive_float, default=0.003, help="Adam, non-private run")
    p.add_argument("--nonprivate-batch-size", type=positive_int, default=32)
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--delta", type=float, default=None, help="default min(1/N^1.1, 1/(10·N))")
    p.add_argument("--seed", type=int, default=None, help="for reproducible runs only (default: OS entropy)")
    add_json_flag(p)
    p.set_defaults(func=_memorization, uses_tensorflow=True)


def _memorization(args) -> dict | None:
    from keras_dpsgd.tools import data as _data
    from keras_dpsgd.tools.memorization import (
        DPSettings,
        convnet_builder,
        memorization_test,
        mlp_builder,
        real_task_test,
    )

    dp = DPSettings(
        l2_norm_clip=args.l2_norm_clip,
        noise_multiplier=args.noise_multiplier,
        batch_size=args.lot_size,
        learning_rate=args.learning_rate,
        momentum=args.momentum,
        physical_batch_size=args.physical_batch_size,
    )
    shape, classes = _DATASETS[args.dataset]
    builder = mlp_builder(shape, classes, width=args.width) if args.model == "mlp" else convnet_builder(shape, classes)
    common = dict(
        num_classes=classes,
        dp=dp,
        epochs=args.epochs,
        nonprivate_batch_size=args.nonprivate_batch_size,
        nonprivate_learning_rate=args.nonprivate_learning_rate,
        confidence=args.confidence,
        delta=args.delta,
        seed=args.seed,
    )
    if args.mode == "noise":
        report = memorization_test(builder, input_shape=shape, num_examples=args.num_examples, **common)
    else:
        if args.dataset == "digits":
            train, test = _data.load_digits()
        else:
            train, test = _data.load_tfds(args.dataset, data_dir=args.data_dir)
        report = real_task_test(builder, train, test, **common)
    if args.json:
        return report.to_dict()
    print(report.summary())
    return None


# ------------------------------------------------------------------ large-lots (deprecated alias)
def _register_large_lots(subparsers) -> None:
    from keras_dpsgd.cli.accounting import add_table_args

    p = subparsers.add_parser(
        "large-lots",
        help="deprecated: use batch-table --base-learning-rate 0.01 (same table)",
        description=(
            "Deprecated alias of batch-table with the linearly scaled learning rate on (base 0.01 at lot "
            "size 128) and lot sizes 128 256 512 1024 by default."
        ),
    )
    add_table_args(p, base_learning_rate=0.01)
    p.set_defaults(func=_large_lots, lot_sizes=["128", "256", "512", "1024"])


def _large_lots(args) -> dict | None:
    from keras_dpsgd.cli import warn_deprecated
    from keras_dpsgd.cli.accounting import run_batch_table

    result = run_batch_table(args)  # bad input: one error line, as for batch-table
    warn_deprecated("keras-dpsgd large-lots", "large-lots", "batch-table --base-learning-rate 0.01")
    result["epsilon"] = result["target_epsilon"]  # deprecated key of 0.1.0
    return result if args.json else None


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
    p.add_argument("--accountant", choices=accountant_names(), default="rdp")
    add_json_flag(p)
    p.set_defaults(func=_adaptive)


def _adaptive(args) -> dict | None:
    from keras_dpsgd.tools.adaptive_clipping import calibrate_adaptive_noise_multiplier, composed_noise_multiplier

    sigma = calibrate_adaptive_noise_multiplier(
        num_layers=args.num_layers,
        norm_noise_multiplier=args.norm_noise_multiplier,
        target_epsilon=args.target_epsilon,
        target_delta=args.delta,
        sampling_rate=args.sampling_rate,
        steps=args.steps,
        accountant=args.accountant,
    )
    sigma_eff = composed_noise_multiplier([sigma] * args.num_layers, [args.norm_noise_multiplier] * args.num_layers)
    result = {
        "noise_multiplier": sigma,
        "effective_noise_multiplier": sigma_eff,
        "norm_noise_multiplier": args.norm_noise_multiplier,
        "num_layers": args.num_layers,
        "target_epsilon": args.target_epsilon,
        "epsilon": args.target_epsilon,  # epsilon: deprecated
        "delta": args.delta,
        "sampling_rate": args.sampling_rate,
        "steps": args.steps,
    }
    if args.json:
        return result
    print(
        f"per-layer gradient noise multiplier sigma = {sigma:.6g} (sigma_eff per step {sigma_eff:.6g}) "
        f"meets target epsilon {args.target_epsilon} at delta {args.delta} with {args.num_layers} norm queries of "
        f"sigma_l2 = {args.norm_noise_multiplier} per step"
    )
    return None

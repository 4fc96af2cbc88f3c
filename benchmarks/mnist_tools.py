"""The Three Tools (van der Veen et al. 2018) on real MNIST: prints one JSON object.

Three studies on the pipeline of ``benchmarks/mnist_paper.py`` (DP-PCA to 60
dimensions, 1000 ReLU units, DP-SGD with momentum; every run's ε is read from
its own ledger and meets the target alone):

* ``adaptive``: adaptive per-layer clipping (bounds α × a DP estimate of each
  layer's mean gradient norm, the norm queries charged) with the best α of a
  small grid against flat clipping with the best bound of a small grid, all at
  the same ε.
* ``lots``: larger lots at the same ε and epochs, with the learning rate
  scaled linearly with the lot (Goyal et al. 2017) and with the base rate
  (the trend of the Three Tools' Table 1).
* ``memorization``: the memorization test on MNIST-shaped random noise
  (28×28 uniform pixels, random labels; no real data): a non-private model
  memorizes it, the DP model at the given σ should not.

Every study on real data is a hyperparameter search: together its runs cost
more than each one's ε (their ledgers are separate). Needs MNIST's IDX files
(``--data-dir``) for ``adaptive`` and ``lots``; it downloads nothing.

    python benchmarks/mnist_tools.py adaptive --data-dir DIR --clips 0.5 1 2 4 --alphas 1 2 4 8
    python benchmarks/mnist_tools.py lots --data-dir DIR
    python benchmarks/mnist_tools.py memorization
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import mnist_paper  # noqa: E402  (the benchmarks directory, above)


def _common(args) -> list[str]:
    return [
        "--data-dir",
        args.data_dir,
        "--target-epsilon",
        str(args.target_epsilon),
        "--epochs",
        str(args.epochs),
        "--lr-decay-epochs",
        str(args.epochs),
        "--momentum",
        "0.9",
        "--pca-sampling-rate",
        "1",
        "--pca-noise",
        str(args.pca_noise),
    ] + (["--seed", str(args.seed)] if args.seed is not None else [])


def _summary(run: dict) -> dict:
    keys = ("accuracy", "epsilon", "sigma", "effective_noise_multiplier", "steps", "wall_s", "command")
    return {k: run[k] for k in keys}


def _lr_args(lr: float) -> list[str]:
    return ["--lr", f"{lr:g}", "--lr-end", f"{lr / 10:g}"]


def _best(runs: dict) -> str:
    return max(runs, key=lambda key: runs[key]["accuracy"])


def adaptive(args) -> dict:
    """Flat clipping over a grid of bounds, then adaptive clipping over a grid of α, at the same ε, lots and schedule.

    Each grid is one search over one hyperparameter: compare the grids' sizes when reading the result.
    """
    base = _common(args) + ["--lot-size", str(args.lot_size)] + _lr_args(args.lr)
    flat = {f"{c:g}": _summary(mnist_paper.main(base + ["--clip", f"{c:g}"])) for c in args.clips}
    adaptive_noise = ["--clip-mode", "adaptive", "--norm-noise", f"{args.norm_noise:g}"]
    runs = {f"{a:g}": _summary(mnist_paper.main(base + adaptive_noise + ["--alpha", f"{a:g}"])) for a in args.alphas}
    best_flat, best_alpha = _best(flat), _best(runs)
    return {
        "study": "adaptive",
        "flat": flat,
        "best_flat_clip": float(best_flat),
        "adaptive": runs,
        "best_alpha": float(best_alpha),
        "norm_noise_multiplier": args.norm_noise,
        "adaptive_minus_best_flat": runs[best_alpha]["accuracy"] - flat[best_flat]["accuracy"],
    }


def lots(args) -> dict:
    """Each lot size with the linearly scaled learning rate; the largest also with the base rate."""
    from keras_dpsgd.tools import scale_learning_rate

    rows = []
    for lot in args.lot_sizes:
        lr = scale_learning_rate(lot, base_learning_rate=args.lr, base_lot_size=args.lot_sizes[0])
        rates = [lr] if lot == args.lot_sizes[0] or lot != args.lot_sizes[-1] else [lr, args.lr]
        for rate in rates:
            run = mnist_paper.main(_common(args) + ["--lot-size", str(lot), "--clip", "1"] + _lr_args(rate))
            rows.append(dict(_summary(run), lot_size=lot, lr=rate, scaled=rate == lr))
    return {"study": "lots", "base_lot_size": args.lot_sizes[0], "base_lr": args.lr, "runs": rows}


def memorization(args) -> dict:
    """The memorization test on MNIST-shaped noise (no real data; the DP run's ε is nominal)."""
    from keras_dpsgd.tools import DPSettings, memorization_test, mlp_builder

    dp = DPSettings(
        l2_norm_clip=1.0, noise_multiplier=args.sigma, batch_size=args.noise_lot_size, learning_rate=0.1, momentum=0.9
    )
    report = memorization_test(
        mlp_builder((28, 28, 1), 10, width=args.width, depth=1),
        input_shape=(28, 28, 1),
        num_classes=10,
        dp=dp,
        num_examples=args.num_examples,
        epochs=args.epochs,
        seed=args.seed,
    )
    out = report.to_dict()
    out["study"] = "memorization"
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="study", required=True)
    for name, defaults in (("adaptive", dict(epochs=20, lr=0.8)), ("lots", dict(epochs=20, lr=0.2))):
        s = sub.add_parser(name)
        s.add_argument("--data-dir", required=True, help="directory of MNIST's IDX files (plain or .gz)")
        s.add_argument("--target-epsilon", type=float, default=2.0)
        s.add_argument("--epochs", type=int, default=defaults["epochs"])
        s.add_argument("--lr", type=float, default=defaults["lr"], help="initial lr (decays linearly to lr/10)")
        s.add_argument("--pca-noise", type=float, default=16.0)
        s.add_argument("--seed", type=int, default=None)
    a = sub.choices["adaptive"]
    a.add_argument("--lot-size", type=int, default=2400)
    a.add_argument("--clips", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="the flat grid")
    a.add_argument(
        "--alphas", type=float, nargs="+", default=[1.0], help="the adaptive grid: bound = α × the noised mean norm"
    )
    a.add_argument("--norm-noise", type=float, default=10.0)
    sub.choices["lots"].add_argument(
        "--lot-sizes", type=int, nargs="+", default=[600, 1200, 2400], help="the first is the base of the scaling"
    )
    m = sub.add_parser("memorization")
    m.add_argument("--num-examples", type=int, default=1000)
    m.add_argument("--epochs", type=int, default=20)
    m.add_argument(
        "--sigma", type=float, default=8.0, help="DP noise multiplier (8: nominal ε = 0.51; 1.1 and 4 memorize)"
    )
    m.add_argument("--noise-lot-size", type=int, default=100)
    m.add_argument("--width", type=int, default=1000)
    m.add_argument("--seed", type=int, default=None)
    for s in sub.choices.values():
        s.add_argument("--log", default=None, metavar="JSONL", help="also append the JSON object to this file")
    return p


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    result = {"adaptive": adaptive, "lots": lots, "memorization": memorization}[args.study](args)
    result["load_average"] = os.getloadavg()
    if args.log:
        with open(args.log, "a") as f:
            f.write(json.dumps(result, sort_keys=True, default=str) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(main(), sort_keys=True, default=str))

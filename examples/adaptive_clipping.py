"""Gradient-aware adaptive per-layer clipping (van der Veen et al. 2018, Sec. 3).

Initial per-layer bounds from one batch of random noise (public data), then
each layer's bound follows α × a DP estimate of the previous lot's mean
per-example gradient norm. The norm queries are Gaussian mechanisms on the
same lot, so each step costs σ_eff = (Σ_l 1/σ_l² + Σ_l 1/σ_l2²)^(-1/2); the
gradient σ is calibrated so that the whole run meets the target (ε, δ), and the
ledger (model_privacy_ledger) charges the optimizer's σ_eff. The per-layer
bounds are written to TensorBoard (--log-dir) and printed per epoch: the
Figure 4 of the paper (norms differ across layers and drift over time).

    python examples/adaptive_clipping.py                  # offline: scikit-learn digits, ~1-2 min
    python examples/adaptive_clipping.py --smoke          # < 30 s
    python examples/adaptive_clipping.py --dataset cifar10 --epochs 60 --alpha 1.1   # paper scale (tfds)
    python examples/adaptive_clipping.py --plot bounds.png   # the bounds' plot: pip install "keras-dpsgd[plot]"
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
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lot-size", type=int, default=None)
    add_option(p, "--target-epsilon", "--epsilon", type=float, default=3.0)
    p.add_argument(
        "--norm-noise-multiplier",
        type=float,
        default=10.0,
        help="sigma_l2 of each norm query (the paper: 2.5, with a larger budget)",
    )
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=2.0)
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--log-dir", default=None, help="TensorBoard directory for the clip bounds")
    p.add_argument("--plot", default=None, help="PNG of the per-layer bounds over epochs (matplotlib)")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also train with flat clipping at the same (epsilon, delta), for comparison",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.plot:
        exit_unless_installed("matplotlib", "plot", needed_by="--plot")

    import numpy as np

    from keras_dpsgd import PoissonLots
    from keras_dpsgd.accounting import compute_epsilon, default_delta
    from keras_dpsgd.ledger import model_privacy_ledger
    from keras_dpsgd.tools import (
        calibrate_adaptive_noise_multiplier,
        convnet_builder,
        initial_clip_bounds,
        load_digits,
        load_tfds,
        mlp_builder,
    )
    from keras_dpsgd.tools import front as _front

    # Keras 3 unless TF_USE_LEGACY_KERAS=1 (the rule of tf.keras).
    front = _front.active()
    keras = front.keras
    if front.name == "keras3":
        from keras_dpsgd.keras3 import AdaptiveDPSGDOptimizer, ClipBoundsLogger, DPSGDOptimizer
    else:
        from keras_dpsgd.tf_keras import AdaptiveDPSGDOptimizer, ClipBoundsLogger, DPSGDOptimizer

    from keras_dpsgd.data.datasets import load_local_arrays as load_arrays

    if args.data or args.dataset == "cifar10":
        (xtr, ytr), (xte, yte) = load_arrays(args.data) if args.data else load_tfds("cifar10", data_dir=args.data_dir)
        build = convnet_builder(xtr.shape[1:], 10)
        epochs, lot, lr = args.epochs or 60, args.lot_size or 128, args.learning_rate or 0.01
    else:
        (xtr, ytr), (xte, yte) = load_digits()
        if args.smoke:
            xtr, ytr, xte, yte = xtr[:200], ytr[:200], xte[:100], yte[:100]
        build = mlp_builder(xtr.shape[1:], 10, width=32, depth=1)
        epochs, lot, lr = args.epochs or (2 if args.smoke else 20), args.lot_size or 128, args.learning_rate or 0.05
    n = len(xtr)
    delta = default_delta(n)
    model = build()
    bounds0 = initial_clip_bounds(model, seed=None if args.seed is None else args.seed + 1)
    lots = PoissonLots(xtr, ytr, expected_lot_size=lot, seed=args.seed)
    steps = epochs * lots.lots_per_epoch
    sigma = calibrate_adaptive_noise_multiplier(
        num_layers=len(bounds0),
        norm_noise_multiplier=args.norm_noise_multiplier,
        target_epsilon=args.target_epsilon,
        target_delta=delta,
        sampling_rate=lots.sampling_rate,
        steps=steps,
    )
    opt = AdaptiveDPSGDOptimizer(
        bounds0,
        sigma,
        args.norm_noise_multiplier,
        alpha=args.alpha,
        beta=args.beta,
        learning_rate=lr,
        momentum=0.9,
        seed=args.seed,
        **_front.dp_optimizer_kwargs(front, lots.gradient_accumulation_steps),
    )
    lots.configure(opt)
    model = front.private(model)
    model.compile(
        optimizer=opt,
        metrics=["accuracy"],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"),
    )
    logger = ClipBoundsLogger(log_dir=args.log_dir, update_freq=10 if args.log_dir else 0)
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=epochs, callbacks=[logger], verbose=0)
    epsilon = compute_epsilon(model_privacy_ledger(model), delta)
    test_acc = float(np.mean(np.argmax(model.predict(xte, verbose=0), -1) == yte))
    names = [getattr(v, "path", None) or v.name[:-2] for v in model.trainable_variables]
    baseline = None
    if args.baseline:
        from keras_dpsgd.accounting import compute_noise_multiplier

        flat_sigma = compute_noise_multiplier(
            target_epsilon=args.target_epsilon, target_delta=delta, sampling_rate=lots.sampling_rate, steps=steps
        )
        flat_clip = float(np.sqrt(np.sum(np.square(bounds0))))  # the initial total norm (public)
        flat = front.private(build())
        flat_lots = PoissonLots(xtr, ytr, expected_lot_size=lot, seed=args.seed)
        flat_opt = flat_lots.configure(
            DPSGDOptimizer(
                flat_clip,
                flat_sigma,
                learning_rate=lr,
                momentum=0.9,
                seed=args.seed,
                **_front.dp_optimizer_kwargs(front, flat_lots.gradient_accumulation_steps),
            )
        )
        flat.compile(
            optimizer=flat_opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        )
        flat.fit(flat_lots.dataset(), steps_per_epoch=flat_lots.steps_per_epoch, epochs=epochs, verbose=0)
        baseline = {
            "l2_norm_clip": flat_clip,
            "noise_multiplier": flat_sigma,
            "epsilon": compute_epsilon(model_privacy_ledger(flat), delta),
            "test_accuracy": float(np.mean(np.argmax(flat.predict(xte, verbose=0), -1) == yte)),
        }
    result = {
        "keras": front.label,
        "dataset": args.dataset,
        "num_examples": n,
        "epochs": epochs,
        "lot_size": lot,
        "steps": steps,
        "noise_multiplier": sigma,
        "norm_noise_multiplier": args.norm_noise_multiplier,
        "effective_noise_multiplier": opt.effective_noise_multiplier,
        "epsilon": epsilon,
        "delta": delta,
        "target_epsilon": args.target_epsilon,
        "test_accuracy": test_acc,
        "initial_bounds": dict(zip(names, bounds0)),
        "bounds_per_epoch": [list(h.values()) for h in logger.history],
        "variables": names,
        "flat_clipping_baseline": baseline,
    }
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        hist = np.array(result["bounds_per_epoch"])
        for j, name in enumerate(names):
            ax.plot(np.arange(1, len(hist) + 1), hist[:, j], label=name)
        ax.set(yscale="log", xlabel="epoch", ylabel="clip bound", title="Adaptive per-layer clip bounds")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(args.plot)
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{args.dataset} ({'Keras 3' if front.name == 'keras3' else 'tf_keras, TF_USE_LEGACY_KERAS=1'}): N = {n}, {epochs} epochs, lots of {lot} ({steps} steps), {len(names)} clipped variables"
    )
    print(
        f"gradient sigma {sigma:.4f} per variable, norm queries sigma_l2 {args.norm_noise_multiplier}: "
        f"sigma_eff {opt.effective_noise_multiplier:.4f} per step"
    )
    print(f"epsilon {epsilon:.3f} at delta {delta:.3g} (target {args.target_epsilon}); test accuracy {test_acc:.3f}")
    if baseline:
        print(
            f"flat clipping at the same budget (C = {baseline['l2_norm_clip']:.3g}, sigma "
            f"{baseline['noise_multiplier']:.4f}): epsilon {baseline['epsilon']:.3f}, test accuracy "
            f"{baseline['test_accuracy']:.3f} (a second run on the same data: the two epsilons compose)"
        )
    print("clip bound per epoch (Figure 4):")
    print("  epoch " + " ".join(f"{nm[-22:]:>22}" for nm in names))
    print("  init  " + " ".join(f"{b:>22.4g}" for b in bounds0))
    for e, row in enumerate(result["bounds_per_epoch"], 1):
        print(f"  {e:<5} " + " ".join(f"{b:>22.4g}" for b in row))


if __name__ == "__main__":
    main()

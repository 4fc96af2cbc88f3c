"""The noise-to-signal ratio of each layer per step, measured along a DP-SGD run of mnist_paper.py's pipeline.

For a step with expected lot size L, flat clip C and noise σ, variable v of the release is
(Σ_i clip(g_i)[v] + N(0, σ²C² I_v)) / L. Its signal is s_v = ‖Σ_i clip(g_i)[v]‖ / L, measured here on a
fixed probe lot (L training examples, the same at every probe) with per-example gradients at the current
weights; its noise has norm ≈ σ C √d_v / L (d_v weights; the norm of a d-dimensional Gaussian is
σ√d to O(1/√d)). The ratio r_v = σ C √d_v / ‖Σ_i clip(g_i)[v]‖ is printed for each variable at the
probe epochs (before training, then after the listed epochs), with ‖Σ clip(g_i)‖ over all variables.
The probes read the training data outside the ledger: this is a measurement of the method, not a release.

    python benchmarks/noise_to_signal.py --data-dir DIR --target-epsilon 2 --epochs 20 --lot-size 2400 \\
        --clip 1 --lr 0.5 --lr-end 0.05 --lr-decay-epochs 20 --momentum 0.9 --pca-sampling-rate 1 --pca-noise 16
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _mnist, mnist_paper
import _mnist  # noqa: E402
import mnist_paper  # noqa: E402


def _clipped_sums(model, x, y, clip: float, chunk: int = 200) -> list:
    """Σ_i clip_C(g_i)[v] for each variable v (flat clipping, g_i by per-example jacobians)."""
    import numpy as np
    import tensorflow as tf
    import tf_keras as keras

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    variables = model.trainable_variables
    total = [np.zeros(v.shape, np.float64) for v in variables]
    for start in range(0, len(x), chunk):
        xb, yb = x[start : start + chunk], y[start : start + chunk]
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        jac = [j.numpy().reshape(len(xb), -1) for j in tape.jacobian(loss, variables, experimental_use_pfor=True)]
        norms = np.sqrt(sum(np.sum(j.astype(np.float64) ** 2, axis=1) for j in jac))
        factors = np.minimum(1.0, clip / np.maximum(norms, 1e-30))
        for v, j in enumerate(jac):
            total[v] += (factors[:, None] * j).sum(axis=0).reshape(variables[v].shape)
    return total


def main(argv=None) -> dict:
    parser = mnist_paper._parser()
    parser.add_argument("--probe-epochs", type=int, nargs="+", default=[1, 5, 10, 20])
    args = parser.parse_args(argv)
    if args.clip_mode != "flat":
        raise ValueError("noise_to_signal measures flat clipping (--clip-mode flat)")
    import numpy as np
    import tf_keras as keras

    from keras_dpsgd import PoissonLots, WithinLimit, model_epsilon

    _mnist.seed_everything(args.seed)
    data = _mnist.load(args.data_dir, args.max_train_examples)
    result = _mnist.record("noise_to_signal.py", args, argv, len(data.x_train))
    start = time.perf_counter()
    pca = mnist_paper._pca(args, data, args.pca_noise, args.pca_sampling_rate)
    model = mnist_paper._model(pca, args.hidden, args.activation)
    lots = PoissonLots(data.x_train, data.y_train, expected_lot_size=args.lot_size, seed=args.seed)
    planned = args.epochs * lots.steps_per_epoch
    sigma = mnist_paper._calibrated_sigma(args, pca, lots.sampling_rate, planned, len(model.trainable_variables))
    optimizer = lots.configure(
        mnist_paper._optimizer(args, model, sigma, mnist_paper._schedule(args, lots.steps_per_epoch))
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"),
        weighted_metrics=["accuracy"],
    )
    probe = np.random.default_rng(12345).permutation(len(data.x_train))[: args.lot_size]
    xp, yp = data.x_train[probe].astype("float32"), data.y_train[probe]
    names = [v.name for v in model.trainable_variables]
    dims = [int(np.prod(v.shape)) for v in model.trainable_variables]
    probes = []

    def measure(epoch: int) -> None:
        sums = _clipped_sums(model, xp, yp, args.clip)
        norms = [float(np.linalg.norm(s)) for s in sums]
        noise = [sigma * args.clip * math.sqrt(d) for d in dims]
        probes.append(
            {
                "epoch": epoch,
                "signal_norm_times_L": {n: round(s, 4) for n, s in zip(names, norms)},
                "noise_to_signal": {n: round(z / max(s, 1e-30), 3) for n, z, s in zip(names, noise, norms)},
                "whole_noise_to_signal": round(
                    sigma * args.clip * math.sqrt(sum(dims)) / max(math.sqrt(sum(s * s for s in norms)), 1e-30), 3
                ),
            }
        )
        print(json.dumps(probes[-1]), flush=True)

    measure(0)
    callback = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: measure(epoch + 1) if epoch + 1 in args.probe_epochs else None
    )
    model.fit(
        lots.dataset(),
        epochs=args.epochs,
        steps_per_epoch=lots.steps_per_epoch,
        callbacks=[WithinLimit(args.target_epsilon, args.delta), callback],
        verbose=0,
    )
    epsilon, delta = model_epsilon(model, target_delta=args.delta)
    _, accuracy = model.evaluate(data.x_test, data.y_test, batch_size=2000, verbose=0)
    result.update(
        epsilon=float(epsilon),
        delta=float(delta),
        accuracy=float(accuracy),
        sigma=float(sigma),
        dims=dict(zip(names, dims)),
        probes=probes,
        wall_s=time.perf_counter() - start,
    )
    return _mnist.finish(result, args.log)


if __name__ == "__main__":
    print(json.dumps(main(), sort_keys=True))

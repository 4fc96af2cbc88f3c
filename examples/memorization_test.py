"""Memorization test (van der Veen et al. 2018, "Three Tools for Practical DP", Sec. 2).

Trains the same model on random noise with random labels, non-privately and
with DP-SGD at several noise multipliers, and prints train accuracy against
chance with a verdict per setting: does the DP model memorize (→ the privacy
parameters are too weak)? The noise run touches no real data. With
--mode real it then trains on the real task and reports test accuracy and the
train-test gap (that run DOES touch the data: its DP ε is reported; the
non-private baseline has no guarantee).

    python examples/memorization_test.py                 # offline: digits shape, ~2 min on 2 cores
    python examples/memorization_test.py --smoke         # < 30 s
    python examples/memorization_test.py --mode real     # + the real task (scikit-learn digits)
    python examples/memorization_test.py --dataset cifar10 --mode real   # paper scale (tfds, GPU advised)

Paper scale (--dataset cifar10): a small convnet, 50,000 noise examples, 60
epochs, lots of 128, C = 2, σ = 0.7225 (the paper clips and noises per layer;
here flat clipping, so compare ε rather than σ).
"""

import argparse
import json

from keras_dpsgd.cli import import_tensorflow_quietly

import_tensorflow_quietly()  # TF_CPP_MIN_LOG_LEVEL=2 unless set; no start-up log lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny run (< 30 s)")
    p.add_argument("--dataset", choices=["digits", "cifar10"], default="digits")
    p.add_argument("--data-dir", default=None, help="tensorflow-datasets data_dir")
    p.add_argument("--mode", choices=["noise", "real"], default="noise", help="real: noise test, then the real task")
    p.add_argument("--noise-multipliers", type=float, nargs="+", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from keras_dpsgd.tools import (
        DPSettings,
        convnet_builder,
        load_digits,
        load_tfds,
        memorization_test,
        mlp_builder,
        real_task_test,
    )
    from keras_dpsgd.tools import front as _front

    # The builders train on Keras 3 unless TF_USE_LEGACY_KERAS=1 (the rule of tf.keras).
    front = _front.active()
    if not args.json:
        print("Keras 3" if front.name == "keras3" else "tf_keras (TF_USE_LEGACY_KERAS=1)")

    if args.dataset == "cifar10":
        shape, classes, build = (32, 32, 3), 10, convnet_builder((32, 32, 3), 10)
        scale = dict(num_examples=50000, epochs=60)
        sigmas = args.noise_multipliers or [0.7225]
        dp = dict(l2_norm_clip=2.0, batch_size=128, learning_rate=0.01, momentum=0.9)
    elif args.smoke:
        shape, classes, build = (8, 8, 1), 4, mlp_builder((8, 8, 1), 4, width=32)
        scale = dict(num_examples=120, epochs=2)
        sigmas = args.noise_multipliers or [4.0]
        dp = dict(l2_norm_clip=1.0, batch_size=40, learning_rate=0.05, momentum=0.9)
    else:
        shape, classes, build = (8, 8, 1), 10, mlp_builder((8, 8, 1), 10, width=512)
        scale = dict(num_examples=1000, epochs=20)
        sigmas = args.noise_multipliers or [1.1, 4.0]
        dp = dict(l2_norm_clip=1.0, batch_size=64, learning_rate=0.05, momentum=0.9)

    results = []
    for sigma in sigmas:
        settings = DPSettings(noise_multiplier=sigma, **dp)
        report = memorization_test(build, input_shape=shape, num_classes=classes, dp=settings, seed=args.seed, **scale)
        results.append(dict(report.to_dict(), keras=front.label))
        if not args.json:
            print(f"\n=== noise multiplier {sigma} ===")
            print(report.summary())
    if args.mode == "real":
        if args.dataset == "cifar10":
            train, test = load_tfds("cifar10", data_dir=args.data_dir)
        else:
            train, test = load_digits()
            if args.smoke:
                train, test = (train[0][:200], train[1][:200]), (test[0][:100], test[1][:100])
            build = mlp_builder(shape, 10, width=32 if args.smoke else 512)
        settings = DPSettings(noise_multiplier=sigmas[-1], **dp)
        report = real_task_test(build, train, test, num_classes=10, dp=settings, epochs=scale["epochs"], seed=args.seed)
        results.append(dict(report.to_dict(), keras=front.label))
        if not args.json:
            print("\n=== real task ===")
            print(report.summary())
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()

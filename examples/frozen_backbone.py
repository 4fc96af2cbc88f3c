"""DP fine-tuning of a new head on a frozen, pretrained backbone with BatchNormalization (offline).

The backbone is ``applications.MobileNetV2`` (BatchNormalization after every convolution) without
its top, frozen: ``backbone.trainable = False`` and called with ``training=False``. A non-trainable
BatchNormalization runs in inference mode (its moving statistics, not the batch's), so it mixes no
examples; keras_dpsgd proves that from the traced step (its moving statistics are never written,
no batch statistic reaches the loss) and trains the new Dense head with DP-SGD on Poisson lots.
Only the head's gradients are clipped and noised: the frozen backbone is public (its training is
outside this run's ledger, so it must not have seen the private training set).

Data: scikit-learn's 8×8 digits (bundled, offline; the private training set here), resized to
``--image-size`` and repeated over 3 channels. Weights: random by default (frozen random features,
nothing downloaded); ``--weights PATH`` loads a backbone's weights from a local file, e.g. Keras's
``mobilenet_v2_weights_tf_dim_ordering_tf_kernels_1.0_96_no_top.h5`` with ``--alpha 1.0``.

    python examples/frozen_backbone.py                         # random frozen backbone, digits
    python examples/frozen_backbone.py --weights mobilenet_v2_no_top.h5 --image-size 96
    python examples/frozen_backbone.py --smoke                 # tiny, < 60 s
    TF_USE_LEGACY_KERAS=1 python examples/frozen_backbone.py   # on tf_keras

Keras 3 by default (``keras_dpsgd.keras3.make_private``), tf_keras where ``TF_USE_LEGACY_KERAS=1``.
The last lines say how each variable's per-example gradients were computed
(``optimizer.per_example_report``: no per-example jacobian fallback for this model).
"""

import argparse
import os
import sys

from keras_dpsgd.cli import import_tensorflow_quietly

import_tensorflow_quietly()  # TF_CPP_MIN_LOG_LEVEL=2 unless set; no start-up log lines

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_dpsgd.data import _models  # noqa: E402

FRONT_END = _models.front_end()  # "keras3", or "tf_keras" with TF_USE_LEGACY_KERAS=1
keras = _models.keras_module(FRONT_END)


def frozen_backbone_model(image_size: int, num_classes: int, alpha: float = 1.0, weights=None) -> keras.Model:
    """MobileNetV2 without its top (frozen: BatchNormalization in inference mode) + a Dense head."""
    backbone = keras.applications.MobileNetV2(
        weights=weights, input_shape=(image_size, image_size, 3), include_top=False, alpha=alpha
    )
    backbone.trainable = False
    images = keras.Input((image_size, image_size, 3))
    features = keras.layers.GlobalAveragePooling2D()(backbone(images, training=False))
    return keras.Model(images, keras.layers.Dense(num_classes, name="head")(features))


def as_images(x: np.ndarray, image_size: int) -> np.ndarray:
    """Grey [N, h, w, 1] in [0, 1] → [N, size, size, 3] in [-1, 1] (MobileNetV2's input range)."""
    resized = tf.image.resize(x, (image_size, image_size)).numpy()
    return np.repeat(resized * 2.0 - 1.0, 3, axis=-1).astype(np.float32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default=None, metavar="PATH", help="backbone weights file (no top), read locally")
    p.add_argument("--alpha", type=float, default=1.0, help="MobileNetV2 width (must match --weights)")
    p.add_argument("--image-size", type=int, default=32, help="inputs are resized to this (>= 32)")
    p.add_argument("--target-epsilon", type=float, default=3.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--noise-multiplier", type=float, default=1.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--lot-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=20, help="at most this many epochs (WithinLimit stops earlier)")
    p.add_argument("--learning-rate", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=None, help="reproducible run (keep it secret; default OS entropy)")
    p.add_argument("--smoke", action="store_true", help="tiny run: 256 training examples, alpha 0.35, one epoch")
    args = p.parse_args(argv)
    if args.weights is not None and not os.path.isfile(args.weights):
        p.error(f"--weights must be an existing file, got {args.weights!r}")
    if args.image_size < 32:
        p.error(f"--image-size must be >= 32 (MobileNetV2's smallest input), got {args.image_size}")

    from keras_dpsgd import PoissonLots, PrivacyLogger, WithinLimit, model_epsilon
    from keras_dpsgd.data._datasets import load_digits

    data = load_digits()
    x_train, y_train = data.x_train, data.y_train
    if args.smoke:
        x_train, y_train = x_train[:256], y_train[:256]
        args.epochs, args.lot_size, args.delta, args.alpha = 1, 64, 1e-3, 0.35
    if args.seed is not None:
        keras.utils.set_random_seed(args.seed)
    x_train, x_test = as_images(x_train, args.image_size), as_images(data.x_test, args.image_size)

    model = frozen_backbone_model(args.image_size, data.num_classes, args.alpha, args.weights)
    lots = PoissonLots(x_train, y_train, expected_lot_size=args.lot_size, seed=args.seed)
    optimizer = _models.dp_sgd(
        FRONT_END,
        l2_norm_clip=args.clip,
        noise_multiplier=args.noise_multiplier,
        lots=lots,
        learning_rate=args.learning_rate,
        seed=args.seed,
        jacobian_fallback="refuse",  # this model must take the fast path for every variable
    )
    model = _models.compile_private(model, optimizer, FRONT_END, weighted_metrics=["accuracy"])
    weights = f"weights from {args.weights}" if args.weights else "random weights"
    print(_models.keras_display(FRONT_END))
    print(
        f"frozen MobileNetV2 (alpha {args.alpha:g}, {weights}, {args.image_size}x{args.image_size}) + DP head "
        f"({len(model.trainable_variables)} DP-trained variables): σ = {args.noise_multiplier:g}, clip {args.clip:g}, "
        f"lot {args.lot_size}, target ε = {args.target_epsilon:g}, δ = {args.delta:g}"
    )
    model.fit(
        lots.dataset(),
        epochs=args.epochs,
        steps_per_epoch=lots.steps_per_epoch,
        callbacks=[PrivacyLogger(args.delta), WithinLimit(args.target_epsilon, args.delta)],
        verbose=2,
        shuffle=False,
    )  # Poisson lots are random already
    epsilon, delta = model_epsilon(model, target_delta=args.delta)
    _, accuracy = model.evaluate(x_test, data.y_test, batch_size=256, verbose=0)
    print(
        f"test accuracy {accuracy:.4f} at ε = {epsilon:.4g} (δ = {delta:g}), "
        f"{int(optimizer.noised_steps.numpy())} DP-SGD steps"
    )
    report = optimizer.per_example_report
    print(f"per-example gradients: {len(report.fast)} variables fast, {len(report.fallback)} on per-example jacobians")
    return 0


if __name__ == "__main__":
    sys.exit(main())

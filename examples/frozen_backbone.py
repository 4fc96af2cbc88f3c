"""DP fine-tuning of a new head on a frozen backbone pretrained on public data (offline, end to end).

The recipe of DP transfer learning: a backbone trained on *public* data, outside the privacy ledger,
then a new head trained with DP-SGD on the *private* data, whose ε the run reports. Offline, on
scikit-learn's 8×8 digits (bundled), split by class so that the two sets are disjoint:

* public: every image of the digits 0-4 (train and test splits). The backbone is pretrained on them
  without privacy; this costs no ε because no private example is in it.
* private: the digits 5-9 (labels 0-4 of the new head). The head is trained with DP-SGD on their
  training split (σ calibrated to ``--target-epsilon`` at ``--delta`` by
  ``keras_dpsgd.make_private_with_epsilon``), and the test accuracy is that of their test split.

The backbone is ``applications.MobileNetV2`` (BatchNormalization after every convolution) without
its top, frozen for the DP part: ``backbone.trainable = False`` and called with ``training=False``.
A non-trainable BatchNormalization runs in inference mode (its moving statistics, not the batch's),
so it mixes no examples; keras_dpsgd proves that from the traced step and trains only the Dense head.
``--weights PATH`` loads a backbone's weights from a local file instead of pretraining (e.g. Keras's
``mobilenet_v2_weights_tf_dim_ordering_tf_kernels_1.0_96_no_top.h5`` with ``--alpha 1.0``); such
weights must not have seen the private training set.

    python examples/frozen_backbone.py                         # pretrain on 0-4, DP head on 5-9
    python examples/frozen_backbone.py --weights mobilenet_v2_no_top.h5 --alpha 1.0 --image-size 96
    python examples/frozen_backbone.py --smoke                 # tiny
    TF_USE_LEGACY_KERAS=1 python examples/frozen_backbone.py   # on tf_keras

Measured (docs/examples.md): test accuracy 0.53 on the private digits at ε = 3 (δ = 1e-5; chance 0.2) in the
full mode (64x64, 10 pretraining epochs, 20 DP epochs), about 0.4 in the smoke (the test asserts >= 0.30).
Keras 3 by default (``keras_dpsgd.keras3``), tf_keras where ``TF_USE_LEGACY_KERAS=1``. The last lines say how
each variable's per-example gradients were computed (``optimizer.per_example_report``).
"""

import argparse
import os
import sys

from keras_dpsgd.cli import import_tensorflow_quietly


def parse_args(argv=None) -> argparse.Namespace:
    """The checked options (a bad one exits 2 with one line; this needs no TensorFlow)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default=None, metavar="PATH", help="backbone weights file (no top), read locally")
    p.add_argument("--alpha", type=float, default=0.35, help="MobileNetV2 width (must match --weights)")
    p.add_argument(
        "--image-size", type=int, default=None, help="inputs are resized to this (>= 32; default 64, smoke 32)"
    )
    p.add_argument(
        "--pretrain-epochs", type=int, default=None, help="public pretraining (default 10; 0 with --weights)"
    )
    p.add_argument("--target-epsilon", type=float, default=3.0, help="ε of the DP head's training")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--lot-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=20, help="planned DP epochs (σ is calibrated to them)")
    p.add_argument("--learning-rate", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=None, help="reproducible run (keep it secret; default OS entropy)")
    p.add_argument("--smoke", action="store_true", help="tiny run: 32x32, 3 pretraining epochs, 5 DP epochs")
    args = p.parse_args(argv)
    if args.weights is not None and not os.path.isfile(args.weights):
        p.error(f"--weights must be an existing file, got {args.weights!r}")
    if args.image_size is None:
        args.image_size = 32 if args.smoke else 64
    if args.image_size < 32:
        p.error(f"--image-size must be >= 32 (MobileNetV2's smallest input), got {args.image_size}")
    if args.pretrain_epochs is None:
        args.pretrain_epochs = 0 if args.weights else 10
    if args.pretrain_epochs < 0:
        p.error(f"--pretrain-epochs must be >= 0, got {args.pretrain_epochs}")
    if args.smoke:
        args.pretrain_epochs, args.epochs = min(args.pretrain_epochs, 3), 5
    return args


if __name__ == "__main__":
    parse_args()  # a bad option exits 2 here, before TensorFlow is imported (below)

import_tensorflow_quietly()  # TF_CPP_MIN_LOG_LEVEL=2 unless set; no start-up log lines

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_dpsgd.data import models as _models  # noqa: E402

FRONT_END = _models.front_end()  # "keras3", or "tf_keras" with TF_USE_LEGACY_KERAS=1
keras = _models.keras_module(FRONT_END)
PUBLIC_CLASSES = (0, 1, 2, 3, 4)  # digits pretrained on without privacy (outside the ledger)
PRIVATE_CLASSES = (5, 6, 7, 8, 9)  # digits of the DP head (in the ledger)


def mobilenet_backbone(image_size: int, alpha: float = 1.0, weights=None) -> keras.Model:
    """MobileNetV2 without its top: random weights, or read from the local file `weights`."""
    return keras.applications.MobileNetV2(
        weights=weights, input_shape=(image_size, image_size, 3), include_top=False, alpha=alpha
    )


def with_head(backbone: keras.Model, num_classes: int, *, training: bool) -> keras.Model:
    """`backbone` + global average pooling + a new Dense head (logits); `training` is BatchNormalization's mode."""
    images = keras.Input(backbone.input_shape[1:])
    features = keras.layers.GlobalAveragePooling2D()(backbone(images, training=training))
    return keras.Model(images, keras.layers.Dense(num_classes, name="head")(features))


def frozen_backbone_model(image_size: int, num_classes: int, alpha: float = 1.0, weights=None) -> keras.Model:
    """A frozen MobileNetV2 (BatchNormalization in inference mode) + a new Dense head."""
    backbone = mobilenet_backbone(image_size, alpha, weights)
    backbone.trainable = False
    return with_head(backbone, num_classes, training=False)


def pretrain_on_public(backbone: keras.Model, x: np.ndarray, y: np.ndarray, epochs: int) -> float:
    """Trains `backbone` (and a throw-away head) without privacy on public data; returns its accuracy there.

    Then BatchNormalization's moving statistics are set to those of the public data (one pass over it in
    training mode at momentum 0: MobileNetV2's 0.999 would keep them near their initial values in a run this
    short), since the frozen backbone normalizes with them. The accuracy is the frozen (inference-mode) one.
    """
    model = with_head(backbone, int(y.max()) + 1, training=True)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    # No compiled metric (the accuracy returned is the frozen model's, below) and Adam built before fit: Keras 3
    # on TensorFlow creates such variables while tracing the step, then traces the step again (~10 s on a CPU).
    model.optimizer.build(model.trainable_variables)
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, shuffle=True)
    for layer in backbone.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = 0.0
    backbone(x, training=True)  # moving statistics := the public data's, layer by layer
    frozen = keras.Model(model.input, model.layers[-1](model.layers[-2](backbone(model.input, training=False))))
    frozen.compile(loss=loss, metrics=["accuracy"])
    return float(frozen.evaluate(x, y, batch_size=256, verbose=0)[1])


def as_images(x: np.ndarray, image_size: int) -> np.ndarray:
    """Grey [N, h, w, 1] in [0, 1] → [N, size, size, 3] in [-1, 1] (MobileNetV2's input range)."""
    resized = tf.image.resize(x, (image_size, image_size)).numpy()
    return np.repeat(resized * 2.0 - 1.0, 3, axis=-1).astype(np.float32)


def split_by_class(data) -> tuple:
    """(public x, y) = every digit 0-4; (private train x, y), (private test x, y) = digits 5-9, labels 0-4."""
    x = np.concatenate([data.x_train, data.x_test])
    y = np.concatenate([data.y_train, data.y_test])
    public = np.isin(y, PUBLIC_CLASSES)
    train, test = np.isin(data.y_train, PRIVATE_CLASSES), np.isin(data.y_test, PRIVATE_CLASSES)
    first = PRIVATE_CLASSES[0]
    return (
        (x[public], y[public]),
        (data.x_train[train], data.y_train[train] - first),
        (data.x_test[test], data.y_test[test] - first),
    )


def main(argv=None) -> int:
    args = parse_args(argv)

    from keras_dpsgd import PrivacyLogger, make_private_with_epsilon, model_epsilon
    from keras_dpsgd.data.datasets import load_digits

    if args.seed is not None:
        keras.utils.set_random_seed(args.seed)
    (x_pub, y_pub), (x_train, y_train), (x_test, y_test) = split_by_class(load_digits())
    x_pub, x_train, x_test = (as_images(x, args.image_size) for x in (x_pub, x_train, x_test))
    print(_models.keras_display(FRONT_END))

    backbone = mobilenet_backbone(args.image_size, args.alpha, args.weights)
    source = f"weights from {args.weights}" if args.weights else "random weights"
    if args.pretrain_epochs:
        public_accuracy = pretrain_on_public(backbone, x_pub, y_pub, args.pretrain_epochs)
        source += f", pretrained without privacy for {args.pretrain_epochs} epochs"
        print(
            f"public data (outside the ledger): {len(y_pub)} digits {PUBLIC_CLASSES[0]}-{PUBLIC_CLASSES[-1]}; "
            f"backbone's training accuracy there {public_accuracy:.4f}"
        )
    backbone.trainable = False  # frozen: BatchNormalization in inference mode, no DP-trained variable
    model = with_head(backbone, len(PRIVATE_CLASSES), training=False)
    print(
        f"private data (in the ledger): digits {PRIVATE_CLASSES[0]}-{PRIVATE_CLASSES[-1]}, {len(y_train)} training "
        f"and {len(y_test)} test examples"
    )
    run = make_private_with_epsilon(
        model,
        x_train,
        y_train,
        target_epsilon=args.target_epsilon,
        target_delta=args.delta,
        epochs=args.epochs,
        expected_lot_size=args.lot_size,
        l2_norm_clip=args.clip,
        optimizer=keras.optimizers.SGD(args.learning_rate),
        seed=args.seed,
        verbose=0,
    )
    model = run.model
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if FRONT_END != "keras3":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    model.compile(optimizer=run.optimizer, loss=loss, weighted_metrics=["accuracy"])
    print(
        f"frozen MobileNetV2 (alpha {args.alpha:g}, {source}, {args.image_size}x{args.image_size}) + DP head "
        f"({len(model.trainable_variables)} DP-trained variables): σ = {run.noise_multiplier:.4g} calibrated to "
        f"{args.epochs} epochs, clip {args.clip:g}, lot {args.lot_size}, target ε = {args.target_epsilon:g}, "
        f"δ = {run.delta:g}"
    )
    model.fit(**run.fit_kwargs, callbacks=[PrivacyLogger(run.delta)], verbose=2)
    epsilon, delta = model_epsilon(model, target_delta=run.delta)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    print(
        f"test accuracy {accuracy:.4f} at ε = {epsilon:.4g} (δ = {delta:g}), "
        f"{int(run.optimizer.noised_steps.numpy())} DP-SGD steps (private digits' held-out split, chance 0.2)"
    )
    report = run.optimizer.per_example_report
    print(f"per-example gradients: {len(report.fast)} variables fast, {len(report.fallback)} on per-example jacobians")
    return 0


if __name__ == "__main__":
    sys.exit(main())

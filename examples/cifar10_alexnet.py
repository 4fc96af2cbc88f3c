"""The small AlexNet of Abadi et al. (2016) and van der Veen et al. (2018) on CIFAR-10, with DP-SGD.

Architecture: conv 5×5×64 → max-pool 3/2 → LRN → conv 5×5×64 → LRN →
max-pool 3/2 → dense 384 → dense 192 → 10 logits (ReLU everywhere). Local
response normalization (``tf.nn.local_response_normalization``) normalizes
each activation by its neighbouring *channels* of the same example, so it does
not mix examples and per-example clipping still bounds each example's
influence (unlike BatchNormalization, which the optimizer refuses).

Training: DP-SGD with momentum on Poisson lots, per-layer clipping with bound 2, stopped by
:class:`keras_dpsgd.WithinLimit` at the target ε; ε is printed every epoch.
As in examples/mnist_dpsgd.py, every trainable variable is clipped separately
and noised with σ·√V so that the accounted effective noise multiplier is σ.

Public layers (Abadi et al. 2016, Sec. 5.2): ``--public-model PATH`` loads a
model saved by this script (``--save-model``) that was trained on *public*
data (e.g. CIFAR-100, as in the paper), copies its two convolutional layers
and freezes them: only the dense layers are trained with DP-SGD and clipped.
The public model's training is outside this run's ledger, so it must not have
seen the private training set.

    python examples/cifar10_alexnet.py                           # needs CIFAR-10 (tfds downloads it once)
    python examples/cifar10_alexnet.py --public-model pub.keras  # frozen public conv layers
    python examples/cifar10_alexnet.py --smoke                   # offline: tfds mock data, tiny, < 60 s
    TF_USE_LEGACY_KERAS=1 python examples/cifar10_alexnet.py     # on tf_keras

The data sets (and --smoke's mock data) come through tensorflow-datasets, an optional extra:
pip install "keras-dpsgd[tfds]" (--data-dir with local files needs none of it).

Keras 3 by default (a model made private with ``keras_dpsgd.keras3.make_private``),
tf_keras where ``TF_USE_LEGACY_KERAS=1`` (TensorFlow's rule for ``tf.keras``);
the first line printed says which. On both, each lot is split into physical
batches of ``--physical-batch-size`` rows (gradient accumulation, default 500).
"""

import argparse
import math
import sys

from keras_dpsgd.cli import exit_unless_installed, import_tensorflow_quietly

import_tensorflow_quietly()  # TF_CPP_MIN_LOG_LEVEL=2 unless set; no start-up log lines

import tensorflow as tf  # noqa: E402

from keras_dpsgd.data import models as _models  # noqa: E402

FRONT_END = _models.front_end()  # "keras3", or "tf_keras" with TF_USE_LEGACY_KERAS=1
keras = _models.keras_module(FRONT_END)

CONV_LAYERS = ("conv1", "conv2")


@keras.saving.register_keras_serializable(package="keras_dpsgd_examples")
class LocalResponseNormalization(keras.layers.Layer):
    """``tf.nn.local_response_normalization`` as a layer (across channels, per example)."""

    def __init__(self, depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, **kwargs):
        super().__init__(**kwargs)
        self.depth_radius, self.bias, self.alpha, self.beta = int(depth_radius), float(bias), float(alpha), float(beta)

    def call(self, inputs):
        return tf.nn.local_response_normalization(
            inputs, depth_radius=self.depth_radius, bias=self.bias, alpha=self.alpha, beta=self.beta
        )

    def get_config(self):
        return {
            **super().get_config(),
            "depth_radius": self.depth_radius,
            "bias": self.bias,
            "alpha": self.alpha,
            "beta": self.beta,
        }


def small_alexnet(input_shape=(32, 32, 3), num_classes: int = 10) -> keras.Model:
    """conv5×5×64 → pool 3/2 → LRN → conv5×5×64 → LRN → pool 3/2 → 384 → 192 → logits."""
    inputs = keras.Input(shape=input_shape)
    x = keras.layers.Conv2D(64, 5, padding="same", activation="relu", name="conv1")(inputs)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same")(x)
    x = LocalResponseNormalization(name="lrn1")(x)
    x = keras.layers.Conv2D(64, 5, padding="same", activation="relu", name="conv2")(x)
    x = LocalResponseNormalization(name="lrn2")(x)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(384, activation="relu", name="dense1")(x)
    x = keras.layers.Dense(192, activation="relu", name="dense2")(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="small_alexnet")


def freeze_public_layers(model: keras.Model, public_path: str) -> None:
    """Copies the conv layers of a saved public model into `model` and freezes them."""
    public = keras.models.load_model(public_path, compile=False)
    for name in CONV_LAYERS:
        layer = model.get_layer(name)
        layer.set_weights(public.get_layer(name).get_weights())
        layer.trainable = False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-epsilon", type=float, default=8.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--noise-multiplier", type=float, default=6.0, help="σ_eff of one step")
    p.add_argument("--clip", type=float, default=2.0, help="per-variable clipping bound")
    p.add_argument("--lot-size", type=int, default=2000)
    p.add_argument(
        "--physical-batch-size",
        type=int,
        default=None,
        help="rows per physical batch (gradient accumulation; default 500)",
    )
    p.add_argument("--epochs", type=int, default=100, help="at most this many epochs (WithinLimit stops earlier)")
    p.add_argument("--learning-rate", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--public-model", default=None, help="saved model whose conv layers are frozen (public data)")
    p.add_argument("--save-model", default=None, help="save the trained model here (.keras)")
    p.add_argument("--data-dir", default=None, help="tensorflow-datasets data directory")
    p.add_argument(
        "--data",
        default=None,
        metavar="PATH",
        help="local CIFAR-10 as a .npz (x_train, y_train, x_test, y_test; uint8 32x32x3), no download",
    )
    p.add_argument("--seed", type=int, default=None, help="reproducible run (keep it secret; default OS entropy)")
    p.add_argument("--smoke", action="store_true", help="tiny offline run on tfds mock data")
    args = p.parse_args(argv)

    from keras_dpsgd import PoissonLots, PrivacyLogger, WithinLimit, model_epsilon
    from keras_dpsgd.data.datasets import load_local, load_tfds

    if args.smoke:
        exit_unless_installed("tensorflow_datasets", "tfds", needed_by="--smoke")
        import tensorflow_datasets as tfds

        with tfds.testing.mock_data(num_examples=64):
            data = load_tfds("cifar10")
        args.epochs, args.lot_size, args.delta = 1, 16, 1e-3
        args.physical_batch_size = 32
    else:
        try:
            data = load_local(args.data) if args.data else load_tfds("cifar10", data_dir=args.data_dir)
        except ValueError as err:
            print(f"cifar10_alexnet.py: error: {err}", file=sys.stderr)
            return 2
    if args.physical_batch_size is None and not args.smoke:
        args.physical_batch_size = 500
    if args.seed is not None:
        keras.utils.set_random_seed(args.seed)

    model = small_alexnet(data.input_shape, data.num_classes)
    if args.public_model:
        freeze_public_layers(model, args.public_model)
    lots = PoissonLots(
        data.x_train,
        data.y_train,
        expected_lot_size=args.lot_size,
        physical_batch_size=args.physical_batch_size,
        seed=args.seed,
    )
    num_vars = len(model.trainable_variables)
    try:
        optimizer = _models.dp_sgd(
            FRONT_END,
            l2_norm_clip=[args.clip] * num_vars,
            noise_multiplier=[args.noise_multiplier * math.sqrt(num_vars)] * num_vars,
            lots=lots,
            learning_rate=args.learning_rate,
            momentum=args.momentum,
            seed=args.seed,
        )
    except ValueError as err:
        print(f"cifar10_alexnet.py: error: {err}", file=sys.stderr)
        return 2
    model = _models.compile_private(model, optimizer, FRONT_END, weighted_metrics=["accuracy"])
    frozen = "frozen public conv layers, " if args.public_model else ""
    print(_models.keras_display(FRONT_END))
    print(
        f"small AlexNet ({frozen}{num_vars} DP-trained variables): σ_eff = "
        f"{optimizer.effective_noise_multiplier:.4g}, clip {args.clip:g} per variable, lot {args.lot_size} "
        f"({lots.gradient_accumulation_steps} × {lots.physical_batch_size}), target ε = {args.target_epsilon:g}, "
        f"δ = {args.delta:g}"
    )
    model.fit(
        lots.dataset(),
        epochs=args.epochs,
        steps_per_epoch=lots.steps_per_epoch,
        callbacks=[PrivacyLogger(args.delta), WithinLimit(args.target_epsilon, args.delta)],
        validation_data=(data.x_test, data.y_test),
        validation_batch_size=500,
        verbose=2,
        shuffle=False,
    )  # Poisson lots are random already
    epsilon, delta = model_epsilon(model, target_delta=args.delta)
    _, accuracy = model.evaluate(data.x_test, data.y_test, batch_size=500, verbose=0)
    print(
        f"test accuracy {accuracy:.4f} at ε = {epsilon:.4g} (δ = {delta:g}), "
        f"{int(optimizer.noised_steps.numpy())} DP-SGD steps"
    )
    if args.save_model:
        model.save(args.save_model)
        print(f"model saved to {args.save_model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

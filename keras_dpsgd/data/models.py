"""Small classifiers for ``keras-dpsgd train`` and the examples (logits out, no BatchNormalization), on either Keras.

DP-SGD clips every example's gradient, so layers that mix the examples of a
batch (BatchNormalization) are excluded; small models also suffer less from
the noise, whose norm grows with the square root of the number of parameters.

Which Keras: :func:`front_end` follows TensorFlow's rule for ``tf.keras``:
Keras 3 unless ``TF_USE_LEGACY_KERAS`` is ``1``/``true``/``True`` (then tf_keras).
"""

from __future__ import annotations

from typing import Any, Sequence

from keras_dpsgd import _validate
from keras_dpsgd._which_keras import KERAS3, TF_KERAS, active_front_end, import_tf_keras

MODELS = ("mlp", "cnn")
FRONT_ENDS = (KERAS3, TF_KERAS)


def front_end() -> str:
    """ "keras3", or "tf_keras" where ``TF_USE_LEGACY_KERAS`` asks for it (:func:`active_front_end`)."""
    return active_front_end()


def _check_front(front: str) -> None:
    if front not in FRONT_ENDS:
        raise ValueError(f"front_end must be one of {list(FRONT_ENDS)}, got {front!r}")


def keras_module(front: str) -> Any:
    """The Keras package of a front end: ``keras`` (Keras 3) or ``tf_keras``."""
    _check_front(front)
    if front == "keras3":
        import keras

        return keras
    return import_tf_keras()


def keras_label(front: str) -> str:
    """Which Keras ran, for reports: e.g. "3.15.0" (Keras 3) or "tf_keras 2.21.0"."""
    version = keras_module(front).__version__
    return version if front == "keras3" else f"tf_keras {version}"


def backend_label(front: str) -> str:
    """The backend that ran, for reports: "tensorflow" (tf_keras; Keras 3 on TensorFlow) or Keras 3's own
    (``keras.config.backend()``: "jax")."""
    return keras_module(front).config.backend() if front == "keras3" else "tensorflow"


def keras_display(front: str) -> str:
    """Which Keras ran, for people: "Keras 3.15.0 on tensorflow", "Keras 3.15.0 on jax" or "tf_keras 2.21.0"."""
    label = keras_label(front)
    return f"Keras {label} on {backend_label(front)}" if front == "keras3" else label


def build_model(name: str, input_shape: Sequence[int], num_classes: int, *, width: int = 256, keras_module=None):
    """Builds an uncompiled classifier that outputs logits.

    Args:
      name: "mlp" (flatten → dense `width`, ReLU → dense) or "cnn" (two 3×3
        convolutions with tanh, 16 and 32 channels, max-pooling between,
        then global average pooling → dense).
      input_shape: shape of one example, e.g. (8, 8, 1).
      num_classes: number of output logits (>= 2).
      width: hidden units of the MLP (>= 1).
      keras_module: the Keras to build with (``keras`` for Keras 3); default tf_keras. A Keras 3
        model still needs ``keras_dpsgd.keras3.make_private`` before DP training.

    Raises:
      ValueError: unknown name or arguments out of range.
    """
    keras = import_tf_keras() if keras_module is None else keras_module
    if name not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {name!r}")
    num_classes = _validate.integer_at_least(2, num_classes=num_classes)
    width = _validate.integer_at_least(1, width=width)
    inputs = keras.Input(shape=tuple(input_shape))
    if name == "mlp":
        x = keras.layers.Flatten()(inputs)
        x = keras.layers.Dense(int(width), activation="relu")(x)
    else:
        x = keras.layers.Conv2D(16, 3, padding="same", activation="tanh")(inputs)
        x = keras.layers.MaxPooling2D(2)(x)
        x = keras.layers.Conv2D(32, 3, padding="same", activation="tanh")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(int(num_classes))(x)
    return keras.Model(inputs, outputs, name=f"dpsgd_{name}")


def dp_sgd_class(front: str) -> type:
    """The DP-SGD optimizer class of a front end (``keras_dpsgd.keras3`` or ``keras_dpsgd.tf_keras``)."""
    _check_front(front)
    if front == "keras3":
        from keras_dpsgd.keras3 import DPSGDOptimizer
    else:
        from keras_dpsgd.tf_keras import DPSGDOptimizer
    return DPSGDOptimizer


def dp_sgd(front: str, *, l2_norm_clip: Any, noise_multiplier: Any, lots: Any, **kwargs) -> Any:
    """A DP-SGD optimizer of the front end, configured for `lots` (a :class:`keras_dpsgd.PoissonLots`).

    Both front ends take the lots' gradient accumulation: a lot split into
    ``lots.gradient_accumulation_steps`` physical batches is released once.
    """
    optimizer = dp_sgd_class(front)(
        l2_norm_clip, noise_multiplier, gradient_accumulation_steps=lots.gradient_accumulation_steps, **kwargs
    )
    return lots.configure(optimizer)


def private(model: Any, front: str) -> Any:
    """The model with the private train step (Keras 3: ``make_private``; tf_keras: the optimizer's own)."""
    _check_front(front)
    if front == "keras3":
        from keras_dpsgd.keras3 import make_private

        return make_private(model)
    return model


def compile_private(model: Any, optimizer: Any, front: str, **kwargs) -> Any:
    """Compiles `model` for DP-SGD with a logits cross-entropy (per example), private on Keras 3 too.

    On Keras 3 the model gets the private train step (``make_private``); the
    accuracy is weighted, so padding rows of the lots (weight 0) do not count.
    """
    keras = keras_module(front)
    model = private(model, front)
    if front == "keras3":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    model.compile(optimizer=optimizer, loss=loss, **kwargs)
    return model

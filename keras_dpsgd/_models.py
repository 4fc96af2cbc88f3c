"""Small tf_keras classifiers for ``keras-dpsgd train`` (logits out, no BatchNormalization).

DP-SGD clips every example's gradient, so layers that mix the examples of a
batch (BatchNormalization) are excluded; small models also suffer less from
the noise, whose norm grows with the square root of the number of parameters.
"""

from __future__ import annotations

from typing import Sequence

MODELS = ("mlp", "cnn")


def build_model(name: str, input_shape: Sequence[int], num_classes: int, *, width: int = 256, keras_module=None):
    """Builds an uncompiled classifier that outputs logits.

    Args:
      name: "mlp" (flatten → dense `width`, ReLU → dense) or "cnn" (two 3×3
        convolutions with tanh, 16 and 32 channels, max-pooling between,
        then global average pooling → dense).
      input_shape: shape of one example, e.g. (8, 8, 1).
      num_classes: number of output logits (>= 2).
      width: hidden units of the MLP (>= 1).
      keras_module: the Keras to build with (``keras`` for Keras 3); default tf_keras.

    Raises:
      ValueError: unknown name or arguments out of range.
    """
    if keras_module is None:
        import tf_keras as keras
    else:
        keras = keras_module
    if name not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {name!r}")
    if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    if isinstance(width, bool) or int(width) != width or width < 1:
        raise ValueError(f"width must be an integer >= 1, got {width!r}")
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

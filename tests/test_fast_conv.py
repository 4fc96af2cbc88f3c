"""Fast per-example clipping of Conv1D/Conv2D (im2col patches, mixed ghost norm) vs loop and reference."""

import pytest
import tf_keras as keras
from _fast_helpers import check, data, per_layer_factors

L = keras.layers


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kernel_size=3, strides=2, padding="same"),
        dict(kernel_size=(3, 2), strides=(1, 2), padding="valid"),
        # Dilated convs run as SpaceToBatchND + Conv2D: rows are not examples, so the kernel
        # must fall back to per-example jacobians (the bias stays on the fast path).
        dict(kernel_size=2, dilation_rate=2, padding="same"),
        dict(kernel_size=3, padding="valid", filters_override=16),  # ghost norm for conv (T small)
    ],
)
def test_conv2d_variants(kwargs):
    kwargs = dict(kwargs)
    filters = kwargs.pop("filters_override", 4)
    size = 4 if filters == 16 else 9
    x, y = data((3, size, size, 3), (3, 2), seed=5)
    model = keras.Sequential(
        [L.Conv2D(filters, activation="relu", **kwargs), L.Flatten(), L.Dense(2)]
    )
    model(x[:1])
    dilated = kwargs.get("dilation_rate", 1) != 1
    check(model, x, y, fallback=[model.layers[0].kernel] if dilated else ())


def test_conv1d_causal_and_pooling():
    x, y = data((4, 10, 3), (4, 2), seed=6)
    model = keras.Sequential(
        [
            L.Conv1D(5, 3, padding="causal", activation="relu"),
            L.MaxPooling1D(2),
            L.Conv1D(4, 2, strides=2),
            L.GlobalAveragePooling1D(),
            L.Dense(2),
        ]
    )
    check(model, x, y, factors=per_layer_factors([0.5, 0.1, 0.5, 0.1, 1.0, 0.2]))

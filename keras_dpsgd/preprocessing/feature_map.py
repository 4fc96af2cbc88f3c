"""PublicFeatureMap: the CLI's fixed per-example feature map as the first layer of the model it saves.

``keras-dpsgd train --data PATH`` maps each raw row by public constants before the network: features
clipped to their public range ``[lower, upper]`` and scaled to [0, 1] (``--feature-range``, or 0..255
for uint8 data), or mapped by ``asinh`` (the default private scaling of features without a public
range, whose DP centring follows in a ``DPNormalization``), and images of shape (H, W) given their
channel axis. The map holds no state computed from the data (its constants are the user's or the storage
type's), so it releases nothing and costs no privacy; as a layer of the model, the saved model takes the
rows the user trained from (issue 40.2).

The call is written once over a small table of ops (:data:`_TF_OPS` on tf_keras, ``keras.ops`` on
Keras 3, any backend); the Keras 3 class is in :mod:`keras_dpsgd.keras3._layers`, the tf_keras class is
defined here at first access (so this module imports without tf_keras); the CLI picks one
(``keras_dpsgd.cli.train.feature_map_layer``).
"""

from __future__ import annotations

import math
import threading
import types
from typing import Any, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

__all__ = ["PublicFeatureMapMixin"]

Bound = Union[float, Sequence[float], None]

# tf_keras: the keras.ops names the call uses, as TensorFlow ops.
_TF_OPS = types.SimpleNamespace(
    cast=tf.cast,
    convert_to_tensor=tf.convert_to_tensor,
    maximum=tf.maximum,
    minimum=tf.minimum,
    arcsinh=tf.math.asinh,
    reshape=tf.reshape,
)


def _bounds(name: str, value: Bound) -> Optional[list]:
    """A public bound as a list of finite floats (one, or one per feature), or None."""
    if value is None:
        return None
    flat = np.asarray(value, np.float64).reshape(-1)
    if flat.size == 0 or not np.all(np.isfinite(flat)):
        raise ValueError(f"{name} must be a finite number or a non-empty list of finite numbers, got {value!r}")
    return [float(v) for v in flat]


class PublicFeatureMapMixin:
    """A fixed per-example map of the raw features (no adapt, no state from the data); put first.

    ``y = asinh(x)`` if `asinh`, else ``y = (clip(x, lower, upper) - lower) / (upper - lower)`` if the
    bounds are given, else ``y = x`` (float); then reshaped to `target_shape` if given.

    Args:
      lower, upper: the public range of the features (a number, or one per feature of the flattened row),
        never computed from the data; both or neither.
      asinh: map by ``asinh`` instead (not with bounds).
      target_shape: the shape of one mapped example (e.g. (H, W, 1) for (H, W) images), or None.

    Raises:
      ValueError: one bound without the other, a bound not finite, lower >= upper, bounds with `asinh`.
    """

    _ops: Any = None  # the front end's ops table

    def __init__(
        self,
        lower: Bound = None,
        upper: Bound = None,
        asinh: bool = False,
        target_shape: Optional[Sequence[int]] = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.lower, self.upper = _bounds("lower", lower), _bounds("upper", upper)
        if (self.lower is None) != (self.upper is None):
            raise ValueError(f"lower and upper must be given together, got lower={lower!r}, upper={upper!r}")
        if self.lower is not None:
            lo, hi = np.broadcast_arrays(np.asarray(self.lower), np.asarray(self.upper))
            if not np.all(lo < hi):
                raise ValueError(f"lower must be < upper for every feature, got lower={lower!r}, upper={upper!r}")
            if asinh:
                raise ValueError("asinh=True maps features without a public range: give no lower/upper with it")
        if not isinstance(asinh, bool):
            raise TypeError(f"asinh must be a bool, got {asinh!r}")
        self.asinh = asinh
        self.target_shape = None if target_shape is None else tuple(int(d) for d in target_shape)

    def call(self, inputs: Any) -> Any:
        ops = self._ops
        x = ops.cast(inputs, self.compute_dtype)
        if self.asinh:
            x = ops.arcsinh(x)
        elif self.lower is not None:
            flat = ops.reshape(x, (-1, math.prod(x.shape[1:])))
            lo = ops.convert_to_tensor(np.asarray(self.lower, self.compute_dtype))
            hi = ops.convert_to_tensor(np.asarray(self.upper, self.compute_dtype))
            width = ops.convert_to_tensor((np.asarray(self.upper) - np.asarray(self.lower)).astype(self.compute_dtype))
            flat = (ops.minimum(ops.maximum(flat, lo), hi) - lo) / width
            x = ops.reshape(flat, (-1, *x.shape[1:]))
        if self.target_shape is not None:
            x = ops.reshape(x, (-1, *self.target_shape))
        return x

    def compute_output_shape(self, input_shape: Any) -> tuple:
        shape = tuple(input_shape)
        return shape if self.target_shape is None else (shape[0], *self.target_shape)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(lower=self.lower, upper=self.upper, asinh=self.asinh, target_shape=self.target_shape)
        return config


_DEFINE_LOCK = threading.Lock()


def __getattr__(name: str) -> type:
    """``PublicFeatureMap`` for tf_keras: defined and registered at first access (PEP 562)."""
    if name != "PublicFeatureMap":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from keras_dpsgd._which_keras import import_tf_keras

    tf_keras = import_tf_keras()
    with _DEFINE_LOCK:
        if name not in globals():
            namespace = {"__doc__": PublicFeatureMapMixin.__doc__, "__module__": __name__, "_ops": _TF_OPS}
            cls = types.new_class(
                name, (PublicFeatureMapMixin, tf_keras.layers.Layer), exec_body=lambda ns: ns.update(namespace)
            )
            globals()[name] = tf_keras.saving.register_keras_serializable(package="keras_dpsgd")(cls)
    return globals()[name]

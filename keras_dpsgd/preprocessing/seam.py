"""Where the DP release layers differ by backend: the ops of their ``call``, and the precision of their records.

* :class:`TfOps`: the few ``keras.ops`` functions the layers use, as TensorFlow ops. ``call`` is written
  once against such a namespace (the glue's ``_ops``): this one on tf_keras, ``keras.ops`` on Keras 3
  (any backend, so also inside a jitted JAX train step). The exact sums of ``adapt`` use this one on
  every backend (tf.Variables; TensorFlow comes with the library).
* :func:`outward`: the events' (q, σ) as the weights can hold them. Keras on JAX without x64 holds
  float64 weights as float32; rounding to nearest could lower q or raise σ, and so ε.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["TfOps", "outward"]


class TfOps:
    """The few ``keras.ops`` functions the layers use, as TensorFlow ops (``keras.ops`` names and arguments)."""

    convert_to_tensor = staticmethod(tf.convert_to_tensor)
    cast = staticmethod(tf.cast)
    reshape = staticmethod(tf.reshape)
    abs = staticmethod(tf.abs)
    sqrt = staticmethod(tf.sqrt)
    maximum = staticmethod(tf.maximum)
    matmul = staticmethod(tf.matmul)
    divide_no_nan = staticmethod(tf.math.divide_no_nan)

    @staticmethod
    def max(x, axis=None, keepdims=False):
        return tf.reduce_max(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def norm(x, axis=None, keepdims=False):
        return tf.norm(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def is_floating(x) -> bool:
        return x.dtype.is_floating


def outward(value: float, dtype: Any, up: bool) -> float:
    """`value` as a number of `dtype`, rounded up (`up`) or down where `dtype` cannot hold it exactly.

    The layers record q rounded up and σ rounded down: the events read back then give an ε at
    least the true one (ε grows with q and shrinks with σ). Round-to-nearest could lower it.
    Where `dtype` holds `value` (float64: TensorFlow), the value itself.
    """
    stored = np.asarray(value, dtype)
    if up and float(stored) < value:
        stored = np.nextafter(stored, np.asarray(np.inf, dtype))
    elif not up and float(stored) > value:
        stored = np.nextafter(stored, np.asarray(-np.inf, dtype))
    return float(stored)

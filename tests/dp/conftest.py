"""The array tables every test of the DP core runs over: NumPy (the reference, ``keras_dpsgd.dp.numpy_ops``: the
table torch's noise runs on, under another key tag), TensorFlow, JAX and torch.

Each test of ``keras_dpsgd.dp`` takes the ``table`` fixture and runs once per table; JAX is imported
lazily, inside the fixture (the Keras of this process is Keras 3 on TensorFlow).
"""

import dataclasses
from typing import Any, Callable

import numpy as np
import pytest

from keras_dpsgd.dp.numpy_ops import NUMPY_OPS
from keras_dpsgd.dp.ops import ArrayOps


@dataclasses.dataclass(frozen=True)
class Table:
    """One backend's table, with what a test needs around it."""

    ops: ArrayOps
    array: Callable[[Any], Any]  # NumPy in, the backend's array out
    key: Callable[[int, int, int], Any]  # (seed, position, index) -> the backend's key

    def numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)


def _tensorflow() -> Table:
    import tensorflow as tf

    from keras_dpsgd.backends.tensorflow.ops import TF_OPS
    from keras_dpsgd.dp.noise import noise_key

    return Table(TF_OPS, tf.constant, lambda s, p, i: noise_key(TF_OPS, s, tf.constant(p, tf.int64), i))


def _jax() -> Table:
    jnp = pytest.importorskip("jax.numpy")

    from keras_dpsgd.backends.jax.ops import JAX_OPS
    from keras_dpsgd.dp.noise import noise_key

    return Table(JAX_OPS, jnp.asarray, lambda s, p, i: noise_key(JAX_OPS, s, p, i))


def _numpy() -> Table:
    from keras_dpsgd.dp.noise import noise_key

    return Table(NUMPY_OPS, np.asarray, lambda s, p, i: noise_key(NUMPY_OPS, s, p, i))


def _torch() -> Table:
    torch = pytest.importorskip("torch")

    from keras_dpsgd.backends.torch import TORCH_OPS
    from keras_dpsgd.dp.noise import noise_key

    return Table(TORCH_OPS, torch.as_tensor, lambda s, p, i: noise_key(TORCH_OPS, s, p, i))


@pytest.fixture(scope="module", params=["numpy", "tensorflow", "jax", "torch"])
def table(request) -> Table:
    return {"numpy": _numpy, "tensorflow": _tensorflow, "jax": _jax, "torch": _torch}[request.param]()

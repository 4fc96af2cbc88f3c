"""The array tables every test of the DP core runs over: NumPy (the reference), TensorFlow, JAX and torch.

Each test of ``keras_dpsgd.dp`` takes the ``table`` fixture and runs once per table; JAX is imported
lazily, inside the fixture (the Keras of this process is Keras 3 on TensorFlow).
"""

import dataclasses
from typing import Any, Callable

import numpy as np
import pytest

from keras_dpsgd.dp.noise import circle_by_trig
from keras_dpsgd.dp.ops import ArrayOps


def _numpy_words(key, shape, stream):
    seq = np.random.SeedSequence([int(k) for k in np.ravel(key)] + [stream])
    return np.random.Generator(np.random.Philox(seq)).integers(0, 2**32, tuple(shape), dtype=np.uint32)


def _numpy_group_sum(x, groups, num_groups):
    member = np.zeros((len(groups), num_groups), x.dtype)
    member[np.arange(len(groups)), list(groups)] = 1
    return x @ member


NUMPY_OPS = ArrayOps(
    name="numpy",
    minimum=np.minimum,
    maximum=np.maximum,
    exp=np.exp,
    where=np.where,
    zeros_like=np.zeros_like,
    ones_like=np.ones_like,
    log=np.log,
    sqrt=np.sqrt,
    is_finite=np.isfinite,
    cast=lambda x, dtype: np.asarray(x).astype(dtype),
    reshape=np.reshape,
    reduce_all=lambda x, axis=None, keepdims=False: np.all(x, axis=axis, keepdims=keepdims),
    group_sum=_numpy_group_sum,
    gather_columns=lambda x, index: x[:, list(index)],
    cond=lambda pred, true_fn, false_fn: true_fn() if bool(pred) else false_fn(),
    random_words=_numpy_words,
    fold_in=lambda key, index: np.append(np.ravel(key), np.uint64(index)).astype(np.uint64),
    seed_key=lambda seed, position: np.array([int(seed) % 2**64, int(position)], np.uint64),
    unit_circle=circle_by_trig(np.cos, np.sin, np.stack),
)


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

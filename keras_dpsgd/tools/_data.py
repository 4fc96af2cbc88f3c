"""Data for the tools: random noise (public), scikit-learn digits (offline), tfds (paper scale)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def random_noise_data(
    num_examples: int, input_shape: Sequence[int], num_classes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Uniform [0, 1) noise inputs with balanced random labels (public: no real data).

    The labels are a random permutation of a balanced multiset (each class
    ⌊N/K⌋ or ⌈N/K⌉ times), so that predicting the most frequent class cannot
    beat chance: any prediction independent of the labels is correct on
    exactly N/K examples in expectation, with at most the binomial variance
    (sampling without replacement), which keeps the binomial test valid.
    """
    if isinstance(num_examples, bool) or int(num_examples) != num_examples or num_examples < 1:
        raise ValueError(f"num_examples must be an integer >= 1, got {num_examples!r}")
    if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"input_shape must be a non-empty tuple of integers >= 1, got {input_shape!r}")
    x = rng.random((int(num_examples),) + shape, dtype=np.float32)
    y = rng.permutation(np.arange(int(num_examples)) % int(num_classes)).astype(np.int64)
    return x, y


def load_digits(rng: np.random.Generator, test_fraction: float = 0.25):
    """scikit-learn's 8x8 digits (offline), scaled to [0, 1], shape (8, 8, 1), split at random."""
    from sklearn.datasets import load_digits as _load

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    data = _load()
    x = (data.images / 16.0).astype(np.float32)[..., None]
    y = data.target.astype(np.int64)
    order = rng.permutation(len(x))
    n_test = int(round(test_fraction * len(x)))
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def load_tfds(name: str = "cifar10", data_dir: str | None = None):
    """Loads a tensorflow-datasets image set as ((x_train, y_train), (x_test, y_test)), x in [0, 1].

    A thin adapter over :func:`keras_dpsgd._datasets.load_tfds` (the loader of
    ``keras-dpsgd train``), so that both fail the same way offline.

    Raises:
      ValueError: naming the fix, when the data set is not prepared and
        cannot be downloaded (offline).
    """
    from keras_dpsgd._datasets import load_tfds as _load_tfds

    data = _load_tfds(name, data_dir=data_dir)
    return (data.x_train, data.y_train), (data.x_test, data.y_test)

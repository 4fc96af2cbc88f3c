"""Data for the tools: random noise (public), scikit-learn digits (offline), tfds (paper scale)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from keras_dpsgd import _validate


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
    num_examples = _validate.integer_at_least(1, num_examples=num_examples)
    num_classes = _validate.integer_at_least(2, num_classes=num_classes)
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"input_shape must be a non-empty tuple of integers >= 1, got {input_shape!r}")
    x = rng.random((int(num_examples),) + shape, dtype=np.float32)
    y = rng.permutation(np.arange(int(num_examples)) % int(num_classes)).astype(np.int64)
    return x, y


def load_digits(rng: np.random.Generator | None = None, test_fraction: float | None = None):
    """scikit-learn's 8x8 digits as ((x_train, y_train), (x_test, y_test)), x in [0, 1], shape (8, 8, 1).

    The split is the one of ``keras-dpsgd train``: fixed and stratified, 75/25
    (:func:`keras_dpsgd.data.datasets.load_digits`), so every tool and command
    trains and tests on the same examples.

    Args:
      rng: deprecated and ignored (the split used to be drawn at random).
      test_fraction: deprecated; only the fixed split's fraction is accepted.

    Raises:
      ValueError: a `test_fraction` other than the fixed split's.
    """
    import warnings

    from keras_dpsgd.data.datasets import DIGITS_TEST_FRACTION
    from keras_dpsgd.data.datasets import load_digits as _load_digits

    if test_fraction is not None and test_fraction != DIGITS_TEST_FRACTION:
        raise ValueError(
            f"test_fraction must be {DIGITS_TEST_FRACTION} (the fixed digits split), got {test_fraction!r}"
        )
    if rng is not None or test_fraction is not None:
        warnings.warn(
            "load_digits(rng, test_fraction) is deprecated: the digits split is fixed; call load_digits()",
            DeprecationWarning,
            stacklevel=2,
        )
    data = _load_digits()
    return (data.x_train, data.y_train), (data.x_test, data.y_test)


def load_tfds(name: str = "cifar10", data_dir: str | None = None):
    """Loads a tensorflow-datasets image set as ((x_train, y_train), (x_test, y_test)), x in [0, 1].

    A thin adapter over :func:`keras_dpsgd.data.datasets.load_tfds` (the loader of
    ``keras-dpsgd train``), so that both fail the same way offline.

    Raises:
      ValueError: naming the fix, when the data set is not prepared and
        cannot be downloaded (offline).
    """
    from keras_dpsgd.data.datasets import load_tfds as _load_tfds

    data = _load_tfds(name, data_dir=data_dir)
    return (data.x_train, data.y_train), (data.x_test, data.y_test)

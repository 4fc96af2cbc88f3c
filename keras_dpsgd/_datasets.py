"""Data sets for ``keras-dpsgd train`` and the examples: digits offline, the rest through tfds.

* ``digits``: scikit-learn's 8×8 handwritten digits (1,797 images, bundled with
  scikit-learn, so offline). The train/test split is fixed (stratified, 75/25:
  1,347 training and 450 test examples) so that runs are comparable; the split
  is a public, data-independent choice and costs no privacy.
* ``mnist``, ``fashion_mnist``, ``cifar10``: loaded with tensorflow-datasets,
  which downloads them on first use. Offline, loading fails with a one-line
  ``ValueError`` that names the fix (the CLI prints it and exits with code 2).

Images are float32 in [0, 1] with a channel axis; labels are int64.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

DATASETS = ("digits", "mnist", "fashion_mnist", "cifar10")
_TFDS_SHAPES = {"mnist": (28, 28, 1), "fashion_mnist": (28, 28, 1), "cifar10": (32, 32, 3)}
DIGITS_TEST_FRACTION = 0.25
# The fixed split of the public digits data (not a privacy seed: it only
# decides which public images are held out for testing).
_DIGITS_SPLIT_SEED = 0


@dataclasses.dataclass
class Dataset:
    """A train/test split in memory.

    Attributes:
      name: the data set's name.
      x_train, y_train, x_test, y_test: images in [0, 1] (N, H, W, C) and
        integer labels.
      num_classes: number of classes.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def num_examples(self) -> int:
        """N, the number of training examples (the privacy unit is one of them)."""
        return int(len(self.x_train))

    @property
    def input_shape(self) -> tuple:
        return tuple(self.x_train.shape[1:])


def load_digits() -> Dataset:
    """scikit-learn's digits with the fixed stratified 75/25 split."""
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    data = _load()
    x = (data.images / 16.0).astype(np.float32)[..., None]
    y = data.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=DIGITS_TEST_FRACTION, stratify=y, random_state=_DIGITS_SPLIT_SEED
    )
    return Dataset("digits", x_tr, y_tr, x_te, y_te, 10)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def _split_to_numpy(tfds, split_ds) -> tuple[np.ndarray, np.ndarray]:
    # Batched iteration rather than tfds.load(batch_size=-1), which also works
    # on tfds.testing.mock_data (unknown cardinality).
    xs, ys = [], []
    for x, y in tfds.as_numpy(split_ds.batch(8192)):
        xs.append(x)
        ys.append(y)
    if not xs:
        raise ValueError("the tensorflow-datasets split is empty")
    return np.concatenate(xs), np.concatenate(ys)


# Where tfds downloads mnist, fashion_mnist and cifar10 from.
_DOWNLOAD_HOSTS = ("storage.googleapis.com", "www.cs.toronto.edu")


def _check_can_download(tfds, name: str, data_dir: Optional[str]) -> None:
    """Fails at once, instead of after minutes of download retries, when offline.

    Only when the data set is not prepared in `data_dir` and tfds would really
    download (under ``tfds.testing.mock_data`` nothing is downloaded).
    """
    import socket

    if tfds.builder(name, data_dir=data_dir).is_prepared():
        return
    if "mock" in getattr(tfds.core.DatasetBuilder.download_and_prepare, "__qualname__", ""):
        return
    for host in _DOWNLOAD_HOSTS:
        try:
            socket.getaddrinfo(host, 443)
        except OSError as err:
            raise OSError(f"no network: cannot resolve {host} ({err})") from None


def load_tfds(name: str, *, data_dir: Optional[str] = None) -> Dataset:
    """Loads `name` ("mnist", "fashion_mnist", "cifar10") through tensorflow-datasets.

    Raises:
      ValueError: one line naming the fix, when the data cannot be loaded
        (typically offline before the first download).
    """
    if name not in _TFDS_SHAPES:
        raise ValueError(f"dataset must be one of {list(DATASETS)}, got {name!r}")
    try:
        import tensorflow_datasets as tfds

        _check_can_download(tfds, name, data_dir)
        train, test = tfds.load(name, split=["train", "test"], as_supervised=True, data_dir=data_dir)
        x_tr, y_tr = _split_to_numpy(tfds, train)
        x_te, y_te = _split_to_numpy(tfds, test)
    except Exception as err:  # noqa: BLE001  tfds raises many types when offline
        where = f" into {data_dir}" if data_dir else ""
        raise ValueError(
            f"cannot load dataset {name!r} with tensorflow-datasets ({_one_line(err)}). Fix: run once "
            f"with internet access so that tfds downloads it{where} (or pass --data-dir DIR holding a "
            f"prepared copy); offline, use the bundled default --dataset digits"
        ) from None
    shape = _TFDS_SHAPES[name]
    if x_tr.shape[1:] != shape:
        raise ValueError(f"dataset {name!r} must have images of shape {shape}, got {x_tr.shape[1:]}")
    scale = lambda a: a.astype(np.float32) / 255.0  # noqa: E731
    return Dataset(name, scale(x_tr), y_tr.astype(np.int64), scale(x_te), y_te.astype(np.int64), 10)


def load_dataset(name: str, *, data_dir: Optional[str] = None) -> Dataset:
    """Loads one of :data:`DATASETS` (digits offline, the others through tfds).

    Raises:
      ValueError: unknown name, or a tfds data set that cannot be loaded.
    """
    if name == "digits":
        return load_digits()
    if name in _TFDS_SHAPES:
        return load_tfds(name, data_dir=data_dir)
    raise ValueError(f"dataset must be one of {list(DATASETS)}, got {name!r}")

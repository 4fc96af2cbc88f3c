"""Data sets for ``keras-dpsgd train`` and the examples: digits offline, the rest through tfds.

* ``digits``: scikit-learn's 8×8 handwritten digits (1,797 images, bundled with
  scikit-learn, so offline). The train/test split is fixed (stratified, 75/25:
  1,347 training and 450 test examples) so that runs are comparable; the split
  is a public, data-independent choice and costs no privacy.
* ``mnist``, ``fashion_mnist``, ``cifar10``: loaded with tensorflow-datasets,
  which downloads them on first use. Offline, loading fails with a one-line
  ``ValueError`` that names the fix (the CLI prints it and exits with code 2).

* ``--data PATH``: the user's own ``.npz``, ``.csv`` or directory of IDX files
  (:func:`load_local`, formats in :mod:`keras_dpsgd.data.local_data`). A
  ``data_dir`` that holds IDX files (e.g. MNIST's four files) is read locally
  for ``mnist`` and ``fashion_mnist`` too, without tensorflow-datasets.

Images are float32 in [0, 1] with a channel axis; labels are int64. Nothing is
fitted on the private data: see :mod:`keras_dpsgd.data.local_data` for scaling.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import numpy as np

from keras_dpsgd.data import local_data as _local_data

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
      notes: sentences about the split and the preprocessing, for the user
        (what was held out, what was scaled with which public range).
      known_range: False when the features have no public range (a CSV or a float
        npz without ``feature_range``): they are as given, and ``keras-dpsgd train``
        scales them privately (DP normalization, in ε).
      raw: (x_train, x_test) as read, before the public scaling and the channel axis (``--data`` only),
        or None: the rows a model saved by ``keras-dpsgd train --data`` takes.
      feature_range: the public (lower, upper) of each flattened feature used to scale ``raw`` to
        ``x_train``/``x_test``, or None where the features were not scaled.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    notes: tuple = ()
    known_range: bool = True
    raw: Optional[tuple] = None
    feature_range: Optional[tuple] = None

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


# The extra of setup.cfg that installs tensorflow-datasets (keras_dpsgd.cli.install_line("tfds"), written here
# because the data sets do not import the CLI).
TFDS_INSTALL_LINE = 'pip install "keras-dpsgd[tfds]"'


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
    except ImportError:  # an optional extra: --data, --dataset digits and IDX files need none of it
        raise ValueError(
            f"dataset {name!r} needs tensorflow-datasets: {TFDS_INSTALL_LINE} (or --data table.csv, or the bundled "
            "default --dataset digits)"
        ) from None
    try:
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

    For ``mnist`` and ``fashion_mnist``, a `data_dir` that holds LeCun's IDX
    files is read directly (:func:`load_local`), offline.

    Raises:
      ValueError: unknown name, or a data set that cannot be loaded.
    """
    if name == "digits":
        return load_digits()
    if name in ("mnist", "fashion_mnist") and data_dir and _local_data.idx_files(data_dir):
        data = load_local(data_dir, num_classes=10)  # public: the data set's documented classes
        return dataclasses.replace(data, name=name)
    if name in _TFDS_SHAPES:
        return load_tfds(name, data_dir=data_dir)
    raise ValueError(f"dataset must be one of {list(DATASETS)}, got {name!r}")


def load_local(
    path: str,
    *,
    label_column: Optional[str] = None,
    feature_range: Optional[Sequence[str]] = None,
    test_fraction: float = _local_data.DEFAULT_TEST_FRACTION,
    num_classes: Optional[int] = None,
) -> Dataset:
    """Loads the user's own data: an ``.npz``, a ``.csv`` or a directory of IDX files.

    Args:
      path: the file or directory.
      label_column: the CSV column holding the labels (CSV only): integers, or text mapped to
        0..K-1 in sorted order (stated in a note).
      feature_range: public ranges, ``["LO,HI"]`` for every feature and/or
        ``["NAME=LO,HI", ...]`` per feature (CSV column names, or indices of
        2-D arrays); features are clipped to them and mapped to [0, 1]. Default:
        0..255 for IDX and uint8 arrays (the storage type's range), else
        features are used as given. Never fitted on the data.
      test_fraction: share of the rows held out as the test set when the data
        has no test set (a fixed split that depends only on N).
      num_classes: the number of classes K if public; default: the largest
        label + 1 (a note says that this is read from the data).

    Returns:
      A :class:`Dataset` whose ``notes`` state the split and the scaling.

    Raises:
      ValueError: one line, for a missing file, unknown format, wrong npz
        keys, a missing label column, non-numeric cells, NaN or infinite
        values, labels that are not integers 0..K-1, or a single class.
    """
    ranges = _local_data.parse_feature_ranges(feature_range)
    if not os.path.exists(path):
        raise ValueError(f"data file or directory {path!r} does not exist")
    if label_column is not None and not path.lower().endswith(".csv"):
        raise ValueError(f"label_column is for CSV files only, got {path!r}")
    names, notes = None, []
    if os.path.isdir(path):
        files = _local_data.idx_files(path)
        if files is None:
            raise ValueError(
                f"directory {path!r} holds no IDX files (train-images-idx3-ubyte and "
                f"train-labels-idx1-ubyte, plain or .gz)"
            )
        x, y = (_local_data.read_idx(f) for f in files["train"])
        x_te, y_te = (_local_data.read_idx(f) for f in files["test"]) if files["test"] else (None, None)
    elif path.lower().endswith(".npz"):
        x, y, x_te, y_te = _local_data.read_npz(path)
    elif path.lower().endswith(".csv"):
        x, y, names, notes = _local_data.read_csv(path, label_column)
        x_te = y_te = None
    else:
        raise ValueError(f"data must be a .npz file, a .csv file or a directory of IDX files, got {path!r}")
    return _assemble(path, x, y, x_te, y_te, names, ranges, test_fraction, num_classes, notes)


def _assemble(path, x, y, x_te, y_te, names, ranges, test_fraction, num_classes, notes) -> Dataset:
    notes = list(notes)
    x = _local_data.check_features(x, "x_train")
    y = _local_data.check_labels(y, "y_train")
    if len(x) != len(y):
        raise ValueError(f"x_train has {len(x)} rows but y_train has {len(y)}")
    if x_te is None:
        train, test = _local_data.held_out_split(len(x), test_fraction)
        x, x_te, y, y_te = x[train], x[test], y[train], y[test]
        notes.append(
            f"no test set in the data: held out {len(test)} of {len(train) + len(test)} rows "
            f"({test_fraction:.0%}, a fixed split) as the test set; ε covers the {len(train)} training "
            f"rows only, not the held-out rows nor the test accuracy computed on them"
        )
    else:
        x_te = _local_data.check_features(x_te, "x_test")
        y_te = _local_data.check_labels(y_te, "y_test")
        if x_te.shape[1:] != x.shape[1:] or len(x_te) != len(y_te):
            raise ValueError(
                f"x_test {x_te.shape} / y_test {y_te.shape} do not match x_train's feature shape {x.shape[1:]}"
            )
    known_range = bool(ranges) or x.dtype == np.uint8
    raw = (x, x_te)
    x, x_te, bounds = _scale(x, x_te, names, ranges, notes)
    if x.ndim == 3:  # (N, H, W) images: a channel axis, as the tfds data sets have
        x, x_te = x[..., None], x_te[..., None]
    k = _num_classes(y, y_te, num_classes, notes)
    return Dataset(path, x, y, x_te, y_te, k, tuple(notes), known_range, raw, bounds)


def _scale(x, x_te, names, ranges, notes):
    if not ranges and x.dtype == np.uint8:
        ranges = _local_data.FeatureRanges(_local_data.UINT8_RANGE)
        notes.append("uint8 features scaled from their type's range 0..255 to [0, 1] (public, not fitted)")
    elif ranges:
        notes.append("features clipped to the given public ranges and scaled to [0, 1] (not fitted on the data)")
    else:
        notes.append(
            "features have no public range and are not scaled here: fitting a scaler on the private data "
            "would be a release outside ε; give public ranges with --feature-range LO,HI or NAME=LO,HI"
        )
        return x.astype(np.float32), x_te.astype(np.float32), None
    width = int(np.prod(x.shape[1:]))
    if names is None:
        names = [str(i) for i in range(width)]
    if ranges.per_feature and x.ndim != 2:
        raise ValueError(f"per-feature ranges need 2-D features (N, F), got shape {x.shape}")
    lo, hi = ranges.bounds(names)
    return _local_data.scale_to_unit(x, lo, hi), _local_data.scale_to_unit(x_te, lo, hi), (lo, hi)


def _num_classes(y, y_te, num_classes, notes) -> int:
    present = np.unique(y)
    if len(present) < 2:
        raise ValueError(f"y_train has one class only (label {int(present[0])}): a classifier needs >= 2 classes")
    if num_classes is None:
        k = int(max(y.max(), y_te.max() if len(y_te) else 0)) + 1
        notes.append(
            f"{k} classes: the largest label + 1, read from the data (pass --num-classes K if K is "
            f"public, so the model's shape does not depend on the data)"
        )
        return k
    if y.max() >= num_classes or (len(y_te) and y_te.max() >= num_classes):
        raise ValueError(
            f"num_classes is {num_classes} but a label is {int(max(y.max(), y_te.max()))}: labels "
            f"must be in 0..{num_classes - 1}"
        )
    return int(num_classes)


def load_local_arrays(path: str, **kwargs) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """:func:`load_local` as ((x_train, y_train), (x_test, y_test)), the form the tools' examples use."""
    data = load_local(path, **kwargs)
    for note in data.notes:
        print(f"data: {note}")
    return (data.x_train, data.y_train), (data.x_test, data.y_test)

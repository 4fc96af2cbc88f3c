"""The user's own data for ``keras-dpsgd train --data PATH`` and the examples.

Three formats, read with numpy only:

* ``.npz``: arrays ``x_train``, ``y_train`` and optionally ``x_test``, ``y_test``.
* ``.csv``: a header row, one numeric column per feature and a label column
  named by ``label_column`` (integers, or text mapped to 0..K-1 in sorted order).
* A directory of LeCun's IDX files (MNIST, Fashion-MNIST, EMNIST):
  ``train-images-idx3-ubyte`` and ``train-labels-idx1-ubyte`` (also spelled
  ``train-images.idx3-ubyte``), optionally ``t10k-images-idx3-ubyte`` and
  ``t10k-labels-idx1-ubyte``, each plain or gzipped (``.gz``).

Without a test set (a CSV, an npz without ``x_test``, IDX without ``t10k``
files) a fixed fraction of the rows is held out; the held-out rows are not
trained on, so ε does not cover them (nor the test accuracy computed on them).

Privacy of preprocessing. Scaling with the data's own minimum, maximum, mean
or variance is a release about the private data that the accountant does not
see, so nothing here is fitted on the data. Features are scaled only with
*public* ranges: those the user gives (:func:`parse_feature_ranges`), or the
range of the storage type of IDX and uint8 arrays (0..255), which says nothing
about the data. Each example is clipped to its range and mapped to [0, 1], a
per-example map with public constants that costs no privacy. Without a range,
features are used as given.
"""

from __future__ import annotations

import csv
import difflib
import gzip
import math
import os
import re
import warnings
from typing import Optional, Sequence

import numpy as np

from keras_dpsgd.dp.refusals import refuse

# The fixed split of data without a test set. Public and data-independent:
# which rows are held out depends only on N, not on the values.
_SPLIT_SEED = 0
DEFAULT_TEST_FRACTION = 0.2
UINT8_RANGE = (0.0, 255.0)


class FeatureRanges:
    """Public feature ranges: a default (lo, hi) and/or one per named feature.

    Attributes:
      default: (lo, hi) for features without their own range, or None.
      per_feature: {feature name: (lo, hi)}; names are CSV column names, or
        feature indices ("0", "1", ...) of 2-D arrays.
    """

    def __init__(self, default: Optional[tuple] = None, per_feature: Optional[dict] = None):
        self.default = default
        self.per_feature = dict(per_feature or {})

    def __bool__(self) -> bool:
        return self.default is not None or bool(self.per_feature)

    def bounds(self, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) arrays for the features `names`.

        Raises:
          ValueError: a named range for an unknown feature, or features left
            without a range and no default.
        """
        unknown = sorted(set(self.per_feature) - set(names))
        if unknown:
            raise ValueError(f"feature_range names unknown features {unknown[:5]}; the features are {_preview(names)}")
        missing = [n for n in names if n not in self.per_feature]
        if missing and self.default is None:
            raise ValueError(
                f"feature_range gives no range for features {_preview(missing)}: give them "
                f"NAME=LO,HI or a default LO,HI"
            )
        pairs = [self.per_feature.get(n, self.default) for n in names]
        return (np.array([p[0] for p in pairs], np.float64), np.array([p[1] for p in pairs], np.float64))


def _preview(names: Sequence[str], k: int = 5) -> str:
    names = list(names)
    return str(names[:k])[:-1] + (f", ... ({len(names)} in all)]" if len(names) > k else "]")


def _parse_range(text: str, what: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        lo, hi = (float(p) for p in parts)
    except ValueError:
        raise ValueError(f"feature_range must be LO,HI or NAME=LO,HI with numbers LO < HI, got {what!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"feature_range must have finite LO < HI, got {what!r}")
    return lo, hi


def parse_feature_ranges(specs: Optional[Sequence[str]]) -> FeatureRanges:
    """Parses ``["LO,HI", "NAME=LO,HI", ...]`` (the CLI's repeated ``--feature-range``).

    Raises:
      ValueError: a malformed range, LO >= HI, or a name or default given twice.
    """
    default, per = None, {}
    for spec in specs or ():
        name, sep, text = spec.rpartition("=")
        if not sep:
            if default is not None:
                raise ValueError(f"feature_range: the default LO,HI is given twice ({spec!r})")
            default = _parse_range(spec, spec)
        else:
            name = name.strip()
            if not name or name in per:
                raise ValueError(f"feature_range: empty or repeated feature name in {spec!r}")
            per[name] = _parse_range(text, spec)
    return FeatureRanges(default, per)


def scale_to_unit(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Clips every feature to its public [lo, hi] and maps it to [0, 1] (float32)."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    flat = (np.clip(flat, lo, hi) - lo) / (hi - lo)
    return flat.astype(np.float32).reshape(x.shape)


# ---------------------------------------------------------------------------------------------- checks


def _location(x: np.ndarray, bad: np.ndarray, names: Optional[Sequence[str]]) -> str:
    """Where the first True of `bad` is: its row (0-based), or CSV line and column if named."""
    where = np.argwhere(bad)[0]
    at = f"row {int(where[0])}"
    if x.ndim == 2:
        return (
            f"line {int(where[0]) + 2}, column {names[where[1]]!r}"
            if names is not None
            else f"{at}, feature {int(where[1])}"
        )
    return at


def check_finite(x: np.ndarray, what: str, names: Optional[Sequence[str]] = None) -> None:
    """Raises ValueError naming the first NaN/inf entry, or the first that float32 cannot hold.

    Training runs in float32: a value beyond its largest (about 3.4e38, e.g. 1e300) would become
    infinite there and break clipping and training as NaN and inf do.
    """
    bad = ~np.isfinite(x)
    if bad.any():
        raise refuse(
            "non-finite-data",
            f"{what} holds NaN or infinite values ({int(bad.sum())} in all; first at {_location(x, bad, names)}): "
            f"remove or impute them before training",
        )
    big = np.abs(x) > np.finfo(np.float32).max
    if big.any():
        raise refuse(
            "non-finite-data",
            f"{what} holds values that do not fit float32 (|value| > {np.finfo(np.float32).max:.4g}; "
            f"{int(big.sum())} in all; first {float(x[tuple(np.argwhere(big)[0])]):g} at "
            f"{_location(x, big, names)}): rescale or remove them before training",
        )


def check_labels(y: np.ndarray, what: str) -> np.ndarray:
    """Integer class labels >= 0 as int64, or ValueError."""
    if y.ndim != 1:
        raise refuse(
            "labels-not-classes", f"{what} must be one integer label per row (shape (N,)), got shape {y.shape}"
        )
    if not np.issubdtype(y.dtype, np.number) or np.issubdtype(y.dtype, np.complexfloating):
        raise refuse("labels-not-classes", f"{what} must be integer class labels, got dtype {y.dtype}")
    check_finite(y.astype(np.float64), what)
    if np.any(y < 0) or np.any(y != np.round(y)):
        bad = y[(y < 0) | (y != np.round(y))][0]
        raise refuse("labels-not-classes", f"{what} must be integer class labels 0, 1, ..., K-1, got {bad!r}")
    return y.astype(np.int64)


def check_features(x: np.ndarray, what: str) -> np.ndarray:
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)) or x.dtype == np.bool_:
        raise ValueError(f"{what} must hold numbers, got dtype {x.dtype}")
    if x.ndim < 2 or len(x) == 0:
        raise ValueError(f"{what} must have shape (N, features...) with N >= 1, got {x.shape}")
    if np.issubdtype(x.dtype, np.floating):
        check_finite(x.reshape(len(x), -1), what)
    return x


def held_out_split(n: int, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, test rows): a fixed random split that depends only on n."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    n_test = int(round(test_fraction * n))
    if n_test < 1 or n_test >= n:
        raise ValueError(f"test_fraction {test_fraction:g} of N = {n} rows leaves no training or no test rows")
    order = np.random.default_rng(_SPLIT_SEED).permutation(n)
    return np.sort(order[n_test:]), np.sort(order[:n_test])


# ---------------------------------------------------------------------------------------------- formats


def read_npz(path: str) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray]]:
    """(x_train, y_train, x_test or None, y_test or None) from an .npz file.

    Raises:
      ValueError: unreadable file, missing or unexpected keys, object arrays.
    """
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise refuse(
            "data-file-unreadable", f"cannot read {path!r} as an .npz file ({type(err).__name__}: {err})"
        ) from None
    with archive:
        keys = set(archive.files)
        if not {"x_train", "y_train"} <= keys or ("x_test" in keys) != ("y_test" in keys):
            raise refuse(
                "data-file-unreadable",
                f"{path!r} must hold arrays x_train and y_train (and optionally both x_test and "
                f"y_test), found keys {sorted(keys)}",
            )
        try:
            arrays = {k: archive[k] for k in ("x_train", "y_train", "x_test", "y_test") if k in keys}
        except ValueError as err:  # object arrays need pickle: refused
            raise refuse("data-file-unreadable", f"{path!r} holds an array that is not numeric ({err})") from None
    return arrays["x_train"], arrays["y_train"], arrays.get("x_test"), arrays.get("y_test")


def _suggest(name: str, choices: Sequence[str]) -> str:
    """ " (did you mean 'x'?)" for the column that matches `name` up to case, else the closest one; or ""."""
    same = [c for c in choices if c.lower() == name.lower()]
    close = same or difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _load_columns(path: str, columns: Sequence[int], dtype) -> np.ndarray:
    with warnings.catch_warnings():  # a header without rows: our one-line error below, not numpy's warning
        warnings.filterwarnings("ignore", message="loadtxt: input contained no data", category=UserWarning)
        return np.loadtxt(
            path,
            delimiter=",",
            skiprows=1,
            dtype=dtype,
            ndmin=2,
            quotechar='"',
            encoding="utf-8",
            usecols=columns,
        )


def _text_labels(labels: np.ndarray, label_column: str) -> tuple[np.ndarray, str]:
    """Class names mapped to 0..K-1 in sorted order, and the note that states the mapping."""
    names, y = np.unique(np.char.strip(labels.astype(str)), return_inverse=True)
    mapping = ", ".join(f"{str(n)!r} → {i}" for i, n in enumerate(names[:20]))
    more = f", ... ({len(names)} in all)" if len(names) > 20 else ""
    note = (
        f"text labels of column {label_column!r} mapped to classes in sorted order: {mapping}{more} (the class "
        f"names are read from the data, as K is; encode them as 0..K-1 yourself if the list is not public)"
    )
    return y.astype(np.float64), note


def read_csv(path: str, label_column: Optional[str]) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    """(features float64 (N, F), labels float64 (N,), feature names, notes) from a CSV with a header row.

    Labels that are not numbers (``malignant``, ``benign``) are mapped to 0..K-1 in sorted order, stated in
    a note. A first column without a name that holds the row numbers 0..N-1 (the index pandas'
    ``DataFrame.to_csv`` writes without ``index=False``) is not used as a feature, also stated in a note.

    Raises:
      ValueError: no label column named, the column missing (with the closest name), a ragged row, an
        empty or non-numeric feature cell (its row and column are named), no rows.
    """
    with open(path, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), None)
    if not header:
        raise refuse("data-file-unreadable", f"{path!r} is empty: a CSV needs a header row naming its columns")
    header = [h.strip() for h in header]
    if label_column is None:
        raise refuse("csv-label-column", f"a CSV needs --label-column NAME (label_column), one of {_preview(header)}")
    if label_column not in header:
        raise refuse(
            "csv-label-column",
            f"label_column {label_column!r} is not a column of {path!r}{_suggest(label_column, header)}; "
            f"columns: {_preview(header)}",
        )
    if len(set(header)) != len(header):
        raise ValueError(f"{path!r} repeats a column name in its header")
    j = header.index(label_column)
    notes = []
    try:
        table = _load_columns(path, None, np.float64)
    except ValueError:
        _raise_bad_cell(path, header, skip=j)  # returns only if every bad cell is a label: text labels
        labels = _load_columns(path, [j], str)[:, 0]
        if all(_is_number(label) for label in labels):
            raise
        y, note = _text_labels(labels, label_column)
        notes.append(note)
        features = _load_columns(path, [i for i in range(len(header)) if i != j], np.float64)
        table = np.insert(features, j, y, axis=1)
    if table.shape[0] == 0:
        raise refuse("data-file-unreadable", f"{path!r} has a header but no rows")
    if table.shape[1] != len(header):
        raise refuse(
            "csv-cells", f"{path!r}: the rows have {table.shape[1]} cells but the header names {len(header)} columns"
        )
    check_finite(table, repr(path), header)
    drop = [j]
    if j != 0 and header[0] == "":
        first = table[:, 0]
        if np.all(first == np.round(first)) and np.all(np.diff(first) > 0):
            drop.append(0)
            notes.append(
                "the first column has no name and holds increasing row numbers (the index pandas writes "
                "without to_csv(index=False)): not used as a feature"
            )
        else:
            notes.append(
                "the first column has no name: it is used as a feature (name it, or drop it if it is an index)"
            )
    names = [h for i, h in enumerate(header) if i not in drop]
    if not names:
        raise ValueError(f"{path!r} has no feature columns besides the label column {label_column!r}")
    return np.delete(table, drop, axis=1), table[:, j], names, notes


def _raise_bad_cell(path: str, header: list[str], skip: Optional[int] = None) -> None:
    """Finds the first ragged row or non-numeric cell (np.loadtxt's message does not name the column).

    Cells of column `skip` (the label column, which may hold text) are not checked.
    """
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        next(reader)
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(header):
                raise refuse("csv-cells", f"{path!r} line {line} has {len(row)} cells, the header has {len(header)}")
            for i, (name, cell) in enumerate(zip(header, row)):
                if i == skip:
                    if not cell.strip():
                        raise refuse("csv-cells", f"{path!r} line {line}, column {name!r}: the label is empty")
                    continue
                try:
                    float(cell)
                except ValueError:
                    raise refuse(
                        "csv-cells",
                        f"{path!r} line {line}, column {name!r}: {cell.strip()[:40]!r} is not a "
                        f"number (all feature cells must be numeric; encode categories as numbers)",
                    ) from None


_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
    """Reads one IDX file (plain or gzipped): a big-endian header, then the array.

    Raises:
      ValueError: not an IDX file (bad magic, unknown type) or truncated.
    """
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as err:
        raise refuse("data-file-unreadable", f"cannot read {path!r} ({type(err).__name__}: {err})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES or raw[3] == 0:
        raise refuse(
            "data-file-unreadable", f"{path!r} is not an IDX file (its first bytes must be 0, 0, a type code, a rank)"
        )
    ndim = raw[3]
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise refuse("data-file-unreadable", f"{path!r} is truncated (IDX header of {ndim} dimensions)")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    size = int(np.prod(shape)) * dtype.itemsize
    if len(raw) != header + size:
        raise refuse(
            "data-file-unreadable",
            f"{path!r}: the IDX header announces shape {shape} ({header + size} bytes), the file has {len(raw)} bytes",
        )
    return np.frombuffer(raw, dtype, offset=header).reshape(shape)


def _idx_file(directory: str, split: str, kind: str, rank: int) -> Optional[str]:
    """The one file of `directory` named like ``train-images-idx3-ubyte[.gz]`` (or ``.idx3-ubyte``)."""
    pattern = re.compile(rf"^{split}-{kind}[-.]idx{rank}-ubyte(\.gz)?$")
    found = sorted(n for n in os.listdir(directory) if pattern.match(n))
    if len(found) > 1:
        raise refuse(
            "data-file-unreadable", f"{directory!r} holds more than one {split} {kind} file: {found}; keep one"
        )
    return os.path.join(directory, found[0]) if found else None


def idx_files(directory: str) -> Optional[dict]:
    """{"train": (images, labels), "test": (images, labels) or None} if `directory` holds IDX files, else None.

    Raises:
      ValueError: training images without labels (or the reverse), or an
        incomplete test pair.
    """
    if not os.path.isdir(directory):
        return None
    pairs = {s: (_idx_file(directory, s, "images", 3), _idx_file(directory, s, "labels", 1)) for s in ("train", "t10k")}
    if pairs["train"] == (None, None) and pairs["t10k"] == (None, None):
        return None
    for split, (images, labels) in pairs.items():
        if (images is None) != (labels is None) or (split == "train" and images is None):
            raise refuse(
                "data-file-unreadable",
                f"{directory!r} must hold {split}-images-idx3-ubyte and {split}-labels-idx1-ubyte "
                f"(plain or .gz) together; found {sorted(os.listdir(directory))[:8]}",
            )
    test = pairs["t10k"] if pairs["t10k"][0] else None
    return {"train": pairs["train"], "test": test}

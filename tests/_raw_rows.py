"""Data files and closed forms shared by the tests of models that take raw rows (issue 40.2).

``keras-dpsgd train --data PATH --save DIR`` saves a model whose first layer maps the rows as read; these
helpers write small files (wine as a CSV, uint8 images as an npz), read their held-out rows back with numpy,
map them by the closed forms of the CLI's scalings, and run a loaded model's layers after its map.
"""

import contextlib
import io
import json

import numpy as np
from sklearn.datasets import load_wine

from keras_dpsgd.data.local_data import DEFAULT_TEST_FRACTION, held_out_split

# Public ranges (wider than the features of wine): proline's own, a default for the others.
RANGE = ("--feature-range", "0,170", "--feature-range", "proline=0,1700")
PROLINE = list(load_wine().feature_names).index("proline")
# scaling -> (data file, extra flags)
RUNS = {"asinh": ("table", ()), "range": ("table", RANGE), "uint8_images": ("images", ())}


def write_images(path) -> str:
    """uint8 images of shape (6, 6) (no channel axis, as IDX files hold them): class 1 is brighter on the left."""
    rng = np.random.default_rng(0)

    def split(n):
        y = rng.integers(0, 2, n)
        x = rng.integers(0, 128, (n, 6, 6))
        x[:, :, :3] += 120 * y[:, None, None]
        return x.astype(np.uint8), y

    (x, y), (x_te, y_te) = split(400), split(100)
    np.savez(path, x_train=x, y_train=y, x_test=x_te, y_test=y_te)
    return str(path)


def write_wine(path) -> str:
    data = load_wine()
    header = ",".join([name.replace(" ", "_").replace("/", "_") for name in data.feature_names] + ["label"])
    np.savetxt(path, np.column_stack([data.data, data.target]), delimiter=",", header=header, comments="", fmt="%.6g")
    return str(path)


def write_files(directory) -> dict:
    return {"table": write_wine(directory / "wine.csv"), "images": write_images(directory / "images.npz")}


def train_and_save(main, files, scaling, save) -> dict:
    """Runs ``keras-dpsgd train --json --data ... --save save`` in this process (2 epochs, width 8); its result."""
    kind, extra = RUNS[scaling]
    argv = ["train", "--json", "--data", files[kind], "--epochs", "2", "--width", "8", "--seed", "2"]
    argv += ["--lot-size", "32", *extra, "--save", str(save)]
    argv += ["--label-column", "label"] if kind == "table" else []
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code == 0, err.getvalue()[-3000:]
    return json.loads(out.getvalue().strip().splitlines()[-1])


def held_out(path) -> tuple:
    """(raw rows, labels) of the test set: the npz's, or the CSV's fixed split of N rows, read with numpy."""
    if str(path).endswith(".npz"):
        with np.load(path) as arrays:
            return arrays["x_test"], arrays["y_test"]
    table = np.loadtxt(path, delimiter=",", skiprows=1)
    _, test = held_out_split(len(table), DEFAULT_TEST_FRACTION)
    return table[test, :-1], table[test, -1].astype(np.int64)


def preprocessed(scaling, raw) -> np.ndarray:
    """The rows as the network was trained on them, by the closed forms (not by the library's layer)."""
    if scaling == "uint8_images":  # the storage type's range 0..255, and the channel axis
        return (raw.astype(np.float64) / 255.0).astype(np.float32)[..., None]
    if scaling == "asinh":
        return np.arcsinh(raw.astype(np.float64)).astype(np.float32)
    hi = np.full(raw.shape[1], 170.0)
    hi[PROLINE] = 1700.0
    return (np.clip(raw.astype(np.float64), 0, hi) / hi).astype(np.float32)


def after_feature_map(model, x) -> np.ndarray:
    """`model`'s layers after its input, but its PublicFeatureMap, applied to `x` in turn (a chain model)."""
    for layer in model.layers[1:]:
        if type(layer).__name__ != "PublicFeatureMap":
            x = layer(x)
    return np.asarray(x)

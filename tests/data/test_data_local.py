"""The user's own data (``keras-dpsgd train --data PATH``): npz, CSV, IDX; public scaling; one-line errors.

Every file is generated here (never /work/shared/data).
"""

import gzip
import json
import struct
import warnings

import numpy as np
import pytest

from keras_dpsgd.data.datasets import load_dataset, load_local
from keras_dpsgd.data.local_data import held_out_split, parse_feature_ranges, read_idx
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.cli import main


def _blobs(n=240, f=6, seed=0):
    """Two well-separated classes in f dimensions, features in [0, 10]."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = np.clip(5.0 + np.where(y[:, None] == 1, 2.5, -2.5) + rng.normal(0, 1, (n, f)), 0, 10)
    return x, y


def _write_csv(path, x, y, label="label", names=None):
    names = names or [f"f{i}" for i in range(x.shape[1])]
    lines = [",".join(names[:2] + [label] + names[2:])]
    for row, lab in zip(x, y):
        cells = [repr(float(v)) for v in row]
        lines.append(",".join(cells[:2] + [str(int(lab))] + cells[2:]))
    path.write_text("\n".join(lines) + "\n")
    return path


def _write_idx(path, array, gz):
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">f4"): 0x0D}
    header = bytes([0, 0, codes[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)


def _idx_dir(tmp_path, gz, test=True, sep="-", n=50):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (n, 7, 5), dtype=np.uint8)
    labels = (np.arange(n) % 3).astype(np.uint8)
    d = tmp_path / ("idx_gz" if gz else "idx")
    d.mkdir()
    _write_idx(d / f"train-images{sep}idx3-ubyte", images, gz)
    _write_idx(d / f"train-labels{sep}idx1-ubyte", labels, gz)
    if test:
        _write_idx(d / f"t10k-images{sep}idx3-ubyte", images[:10], gz)
        _write_idx(d / f"t10k-labels{sep}idx1-ubyte", labels[:10], gz)
    return d, images, labels


def _train_json(capsys, *argv):
    code = main(["train", "--json", "--epochs", "1", "--lot-size", "64", "--seed", "1", "--width", "16", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    return json.loads(out), err


# ------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("sep", ["-", "."])
def test_idx_directory_exact_pixels_and_labels(tmp_path, gz, sep):
    d, images, labels = _idx_dir(tmp_path, gz, sep=sep)
    data = load_local(str(d))
    assert data.x_train.shape == (50, 7, 5, 1) and data.x_train.dtype == np.float32
    np.testing.assert_array_equal(data.x_train[..., 0], images.astype(np.float32) / 255.0)
    np.testing.assert_array_equal(data.y_train, labels)
    np.testing.assert_array_equal(data.x_test[..., 0], images[:10] / np.float32(255.0))
    assert data.num_classes == 3
    assert any("0..255" in n for n in data.notes)


def test_idx_without_test_files_holds_out_a_fixed_split(tmp_path):
    d, images, labels = _idx_dir(tmp_path, gz=True, test=False)
    data = load_local(str(d), test_fraction=0.2)
    train, test = held_out_split(50, 0.2)
    assert len(test) == 10 and len(train) == 40 and not set(train) & set(test)
    np.testing.assert_array_equal(data.y_train, labels[train])
    np.testing.assert_array_equal(data.x_test[..., 0], images[test] / np.float32(255.0))
    assert any("held out 10 of 50 rows" in n and "ε covers the 40 training rows only" in n for n in data.notes)
    # The split depends on N only: the same on every call.
    np.testing.assert_array_equal(held_out_split(50, 0.2)[1], test)


def test_read_idx_float_type(tmp_path):
    a = np.arange(12, dtype=">f4").reshape(3, 4)
    _write_idx(tmp_path / "a", a, gz=False)
    np.testing.assert_array_equal(read_idx(str(tmp_path / "a")), a)


def test_mnist_name_with_idx_data_dir_reads_locally(tmp_path):
    d, images, _ = _idx_dir(tmp_path, gz=True)
    data = load_dataset("mnist", data_dir=str(d))
    assert data.name == "mnist" and data.num_classes == 10  # public: MNIST has 10 classes
    np.testing.assert_array_equal(data.x_train[..., 0], images / np.float32(255.0))


def test_csv_public_ranges_clip_and_scale(tmp_path):
    x = np.array([[0.0, 5.0, -3.0], [10.0, 20.0, 1.0], [2.5, 12.5, 0.0], [1.0, 1.0, 1.0], [9.0, 9.0, 9.0]])
    y = np.array([0, 1, 0, 1, 1])
    path = _write_csv(tmp_path / "t.csv", x, y, names=["a", "b", "c"])
    data = load_local(str(path), label_column="label", feature_range=["0,10", "b=5,15"], test_fraction=0.4)
    train, test = held_out_split(5, 0.4)
    expected = np.column_stack([x[:, 0] / 10, (np.clip(x[:, 1], 5, 15) - 5) / 10, np.clip(x[:, 2], 0, 10) / 10])
    np.testing.assert_allclose(data.x_train, expected[train], rtol=1e-6)
    np.testing.assert_allclose(data.x_test, expected[test], rtol=1e-6)
    np.testing.assert_array_equal(data.y_train, y[train])
    assert data.x_train.min() >= 0 and data.x_train.max() <= 1


def test_features_without_ranges_are_not_fitted(tmp_path):
    x, y = _blobs(40, 3)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x[:5], y_test=y[:5])
    data = load_local(str(tmp_path / "d.npz"))
    np.testing.assert_allclose(data.x_train, x.astype(np.float32))  # unchanged: no min/max/mean of the data
    assert any("not scaled" in n and "--feature-range" in n for n in data.notes)


def test_feature_range_parsing():
    r = parse_feature_ranges(["-1,1", "age=0,120"])
    assert r.default == (-1.0, 1.0) and r.per_feature == {"age": (0.0, 120.0)}
    for bad in (["1,0"], ["a,b"], ["0,1", "2,3"], ["x=0,1", "x=0,2"], ["0,inf"], ["=0,1"]):
        with pytest.raises(ValueError, match="feature_range"):
            parse_feature_ranges(bad)
    with pytest.raises(ValueError, match="no range for features"):
        parse_feature_ranges(["age=0,1"]).bounds(["age", "height"])
    with pytest.raises(ValueError, match="unknown features"):
        parse_feature_ranges(["0,1", "weight=0,1"]).bounds(["age"])


# ------------------------------------------------------------------------------------------- CLI


def test_cli_npz_with_test_set_trains_honestly(capsys, tmp_path):
    x, y = _blobs(300, 6)
    np.savez(tmp_path / "d.npz", x_train=x[:240], y_train=y[:240], x_test=x[240:], y_test=y[240:])
    result, err = _train_json(
        capsys,
        "--data",
        str(tmp_path / "d.npz"),
        "--feature-range",
        "0,10",
        "--num-classes",
        "2",
        "--target-epsilon",
        "3",
        "--delta",
        "1e-4",
        "--learning-rate",
        "0.5",
        "--epochs",
        "5",
    )
    assert result["dataset"] == str(tmp_path / "d.npz") and result["num_examples"] == 240
    assert "DP-SGD on " + str(tmp_path / "d.npz") + " (N = 240)" in err
    q = 64 / 240
    eps = compute_epsilon(PoissonSampledGaussianEvent(q, result["noise_multiplier"], result["steps"]), 1e-4)
    assert result["epsilon"] == pytest.approx(eps, rel=1e-9) and result["epsilon"] <= 3 + 1e-9
    assert any("public ranges" in n for n in result["data_notes"])
    assert result["test_accuracy"] > 0.8  # two separated blobs (chance 0.5)


def test_cli_csv_held_out_split_is_stated(capsys, tmp_path):
    x, y = _blobs(250, 4)
    path = _write_csv(tmp_path / "p.csv", x, y, label="diagnosis")
    result, err = _train_json(
        capsys,
        "--data",
        str(path),
        "--label-column",
        "diagnosis",
        "--feature-range",
        "0,10",
        "--test-fraction",
        "0.2",
        "--delta",
        "1e-4",
    )
    assert result["num_examples"] == 200
    assert "data: no test set in the data: held out 50 of 250 rows" in err
    assert any("held out 50" in n for n in result["data_notes"])


def _bad_inputs(tmp_path):
    x, y = _blobs(100, 3)
    np.savez(tmp_path / "keys.npz", features=x, labels=y)
    np.savez(tmp_path / "one.npz", x_train=x, y_train=np.zeros(100, int))
    xn = x.copy()
    xn[7, 1] = np.nan
    np.savez(tmp_path / "nan.npz", x_train=xn, y_train=y)
    xi = x.copy()
    xi[3, 0] = np.inf
    np.savez(tmp_path / "inf.npz", x_train=xi, y_train=y)
    np.savez(tmp_path / "small.npz", x_train=x[:40], y_train=y[:40])
    np.savez(tmp_path / "frac.npz", x_train=x, y_train=y + 0.5)
    good = _write_csv(tmp_path / "good.csv", x, y)
    text = good.read_text().splitlines()
    text[5] = text[5].replace(text[5].split(",")[3], "abc", 1)
    (tmp_path / "cell.csv").write_text("\n".join(text) + "\n")
    text = good.read_text().splitlines()
    text[4] = text[4] + ",1.0"
    (tmp_path / "ragged.csv").write_text("\n".join(text) + "\n")
    text = good.read_text().splitlines()
    text[6] = text[6].replace(text[6].split(",")[0], "nan", 1)
    (tmp_path / "nan.csv").write_text("\n".join(text) + "\n")
    text = good.read_text().splitlines()
    text[3] = text[3].replace(text[3].split(",")[1], "1e300", 1)
    (tmp_path / "huge.csv").write_text("\n".join(text) + "\n")
    (tmp_path / "header.csv").write_text(text[0] + "\n")
    xh = x.astype(np.float64)
    xh[5, 2] = -1e300
    np.savez(tmp_path / "huge.npz", x_train=xh, y_train=y)
    t = str(tmp_path)
    return {
        "missing file": ([f"{t}/nope.npz"], "does not exist"),
        "unknown format": ([str(good).replace(".csv", ".txt")], "does not exist"),
        "wrong keys": ([f"{t}/keys.npz"], "must hold arrays x_train and y_train"),
        "one class": ([f"{t}/one.npz"], "one class only"),
        "NaN": ([f"{t}/nan.npz"], "NaN or infinite values .* row 7, feature 1"),
        "inf": ([f"{t}/inf.npz"], "NaN or infinite values .* row 3, feature 0"),
        "fewer rows than the lot size": ([f"{t}/small.npz"], "lot_size must be in \\[1, N = 32\\]"),
        "labels not integers": ([f"{t}/frac.npz"], "integer class labels"),
        "no label column": ([str(good)], "needs --label-column"),
        "missing label column": ([str(good), "--label-column", "target"], "'target' is not a column"),
        "non-numeric cell": ([f"{t}/cell.csv", "--label-column", "label"], "line 6, column 'f2': 'abc' is not a"),
        "ragged row": ([f"{t}/ragged.csv", "--label-column", "label"], "line 5 has 5 cells, the header has 4"),
        "NaN cell": ([f"{t}/nan.csv", "--label-column", "label"], "NaN or infinite values .* line 7, column 'f0'"),
        "beyond float32 cell": (
            [f"{t}/huge.csv", "--label-column", "label"],
            "do not fit float32 .* line 4, column 'f1'",
        ),
        "beyond float32 array": ([f"{t}/huge.npz"], "do not fit float32 .*-1e\\+300 at row 5, feature 2"),
        "header only": ([f"{t}/header.csv", "--label-column", "label"], "has a header but no rows"),
        "empty directory": ([t + "/emptydir"], "holds no IDX files"),
        "with --dataset": ([str(good), "--dataset", "mnist", "--label-column", "label"], "not both"),
        "bad range": ([str(good), "--label-column", "label", "--feature-range", "5,1"], "LO < HI"),
    }


def test_cli_bad_data_exits_2_one_line_nothing_written(capsys, tmp_path):
    (tmp_path / "emptydir").mkdir()
    for what, (argv, message) in _bad_inputs(tmp_path).items():
        save = tmp_path / f"save_{what.replace(' ', '_')}"
        code = main(["train", "--data", *argv, "--lot-size", "64", "--save", str(save)])
        out, err = capsys.readouterr()
        assert code == 2, (what, err[-2000:])
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("keras-dpsgd train: error: "), (what, err[-2000:])
        assert __import__("re").search(message, lines[0]), (what, lines[0])
        assert not save.exists(), what


def test_cli_header_only_csv_is_one_line_without_numpy_warning(capsys, tmp_path):
    # numpy's "loadtxt: input contained no data" UserWarning (and its source line) came first.
    (tmp_path / "header.csv").write_text("f0,f1,label\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["train", "--data", str(tmp_path / "header.csv"), "--label-column", "label"])
    assert code == 2 and [str(w.message) for w in caught] == []
    assert "has a header but no rows" in capsys.readouterr().err


def test_cli_local_flags_need_data(capsys):
    assert main(["train", "--label-column", "y"]) == 2
    assert "apply to --data PATH only" in capsys.readouterr().err


def test_cli_cnn_refuses_flat_features(capsys, tmp_path):
    x, y = _blobs(100, 3)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y)
    assert main(["train", "--data", str(tmp_path / "d.npz"), "--model", "cnn"]) == 2
    assert "model cnn needs images" in capsys.readouterr().err


def test_mnist_example_reads_idx_data_dir(tmp_path):
    """examples/mnist_dpsgd.py --data-dir DIR trains on local IDX files (28×28), no download."""
    import os
    import subprocess
    import sys

    rng = np.random.default_rng(2)
    d = tmp_path / "mnist"
    d.mkdir()
    labels = (np.arange(128) % 10).astype(np.uint8)
    _write_idx(d / "train-images-idx3-ubyte", rng.integers(0, 256, (128, 28, 28), dtype=np.uint8), gz=True)
    _write_idx(d / "train-labels-idx1-ubyte", labels, gz=True)
    _write_idx(d / "t10k-images-idx3-ubyte", rng.integers(0, 256, (20, 28, 28), dtype=np.uint8), gz=False)
    _write_idx(d / "t10k-labels-idx1-ubyte", labels[:20], gz=False)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "examples", "mnist_dpsgd.py"),
            "--data-dir",
            str(d),
            "--preset",
            "large",
            "--epochs",
            "1",
            "--lot-size",
            "32",
            "--hidden",
            "8",
            "--pca-components",
            "4",
            "--pca-sampling-rate",
            "1",
            "--delta",
            "1e-3",
            "--seed",
            "0",
            "--clip-mode",
            "flat",
            "--momentum",
            "0.9",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "DP-SGD steps" in proc.stdout and "test accuracy" in proc.stdout


# ------------------------------------------------------------------------------- issue 40.9: first-week slips


def _diagnosis_csv(path, n=120, index=False):
    """Two classes named by text ("benign", "malignant"), quoted or not; optionally pandas' unnamed index first."""
    x, y = _blobs(n, 3)
    names = np.array(["benign", "malignant"])[y]
    lines = [("," if index else "") + "f0,diagnosis,f1,f2"]
    for i, (row, name) in enumerate(zip(x, names)):
        label = f'"{name}"' if i % 2 else name
        cells = [repr(float(v)) for v in row]
        lines.append((f"{i}," if index else "") + ",".join([cells[0], label, *cells[1:]]))
    path.write_text("\n".join(lines) + "\n")
    return path, x, y


def test_text_labels_are_mapped_to_classes_with_the_mapping_stated(tmp_path):
    path, x, y = _diagnosis_csv(tmp_path / "bc.csv")
    data = load_local(str(path), label_column="diagnosis", test_fraction=0.25)
    train, test = held_out_split(len(y), 0.25)
    np.testing.assert_array_equal(data.y_train, y[train])  # benign → 0, malignant → 1 (sorted)
    np.testing.assert_array_equal(data.y_test, y[test])
    np.testing.assert_allclose(data.x_train, x[train])  # the label column is not a feature
    assert data.num_classes == 2
    assert any("'benign' → 0, 'malignant' → 1" in note for note in data.notes)


def test_a_text_label_next_to_a_text_feature_still_names_the_feature(tmp_path):
    path, _, _ = _diagnosis_csv(tmp_path / "bc.csv")
    lines = path.read_text().splitlines()
    lines[4] = "abc," + lines[4].split(",", 1)[1]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="line 5, column 'f0': 'abc' is not a number"):
        load_local(str(path), label_column="diagnosis")


@pytest.mark.parametrize("given", ["Diagnosis", "DIAGNOSIS", "diagnosys"])
def test_a_label_column_spelled_differently_suggests_the_column(capsys, tmp_path, given):
    path, _, _ = _diagnosis_csv(tmp_path / "bc.csv")
    assert main(["train", "--data", str(path), "--label-column", given]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"label_column {given!r} is not a column" in line and "(did you mean 'diagnosis'?)" in line


def test_pandas_index_column_is_not_a_feature_and_is_said(tmp_path):
    path, x, y = _diagnosis_csv(tmp_path / "bc.csv", index=True)
    data = load_local(str(path), label_column="diagnosis", test_fraction=0.25)
    train, _ = held_out_split(len(y), 0.25)
    np.testing.assert_allclose(data.x_train, x[train])  # the row numbers are dropped
    assert any("increasing row numbers" in note and "index=False" in note for note in data.notes)
    # The index of a filtered frame (0, 2, 5, ...) is an index too; an unnamed column of values is a feature.
    lines = path.read_text().splitlines()
    filtered = [lines[0]] + [f"{3 * i + 1}," + line.split(",", 1)[1] for i, line in enumerate(lines[1:])]
    path.write_text("\n".join(filtered) + "\n")
    np.testing.assert_allclose(load_local(str(path), label_column="diagnosis", test_fraction=0.25).x_train, x[train])
    values = [lines[0]] + [f"{(-1) ** i}," + line.split(",", 1)[1] for i, line in enumerate(lines[1:])]
    path.write_text("\n".join(values) + "\n")
    data = load_local(str(path), label_column="diagnosis", test_fraction=0.25)
    assert data.x_train.shape == (len(train), 4)
    assert any("the first column has no name: it is used as a feature" in note for note in data.notes)


def test_saved_files_have_the_mode_of_a_new_file_and_the_report_states_the_mapping(capsys, tmp_path):
    import os
    import stat

    path, _, _ = _diagnosis_csv(tmp_path / "bc.csv", n=100, index=True)
    save = tmp_path / "run"
    result, _ = _train_json(capsys, "--data", str(path), "--label-column", "diagnosis", "--save", str(save))
    assert result["saved_to"] == str(save)
    mask = os.umask(0o022)
    os.umask(mask)
    for name in ("model.keras", "privacy_report.json"):  # mkstemp's 0600 was kept
        assert stat.S_IMODE(os.stat(save / name).st_mode) == 0o666 & ~mask, name
    report = json.loads((save / "privacy_report.json").read_text())
    notes = " | ".join(report["settings"]["data_notes"])
    assert "'benign' → 0, 'malignant' → 1" in notes and "increasing row numbers" in notes

"""Tests for ``keras-dpsgd train``: JSON output, honest ε, the budget, saving, tfds loading and errors."""

import json
import math

import numpy as np
import pytest

from keras_dpsgd.accounting import (
    PoissonSampledGaussianEvent,
    compute_epsilon,
    compute_noise_multiplier,
    default_delta,
)
from keras_dpsgd.cli import main

REQUIRED = {
    "dataset",
    "epsilon",
    "target_epsilon",
    "delta",
    "test_accuracy",
    "steps",
    "noise_multiplier",
    "l2_norm_clip",
    "seconds",
}


def _run_json(capsys, *argv):
    code = main(["train", "--json", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"stdout must be exactly one JSON object, got {out[:500]!r}"
    return json.loads(lines[0]), err


def test_digits_json_calibrated_sigma_is_honest(capsys):
    result, err = _run_json(capsys, "--epochs", "2", "--seed", "3", "--target-epsilon", "2")
    assert REQUIRED <= set(result)
    assert result["dataset"] == "digits" and result["num_examples"] == 1347
    assert result["delta"] == pytest.approx(default_delta(1347))
    # Progress (with ε) went to stderr, not stdout.
    assert "epsilon" in err and "DP-SGD on digits (N = 1347)" in err
    # 2 epochs of ceil(1347 / 256) = 6 lots, all taken: the calibrated σ fits them.
    assert result["steps"] == result["planned_steps"] == 12
    q = 256 / 1347
    assert result["sampling_rate"] == pytest.approx(q)
    expected_sigma = compute_noise_multiplier(
        target_epsilon=2.0, target_delta=result["delta"], sampling_rate=q, steps=12
    )
    assert result["noise_multiplier"] == pytest.approx(expected_sigma)
    # ε recomputed independently from (q, σ, steps) matches and is within the target.
    eps = compute_epsilon(PoissonSampledGaussianEvent(q, result["noise_multiplier"], 12), result["delta"])
    assert result["epsilon"] == pytest.approx(eps, rel=1e-9)
    assert result["epsilon"] <= 2.0 + 1e-9
    # It learned something (chance is 0.1).
    assert result["test_accuracy"] > 0.5


def test_given_sigma_stops_within_budget(capsys):
    result, _ = _run_json(
        capsys,
        "--epochs",
        "5",
        "--noise-multiplier",
        "1.2",
        "--target-epsilon",
        "2",
        "--lot-size",
        "128",
        "--learning-rate",
        "0.1",
    )
    assert result["noise_calibrated"] is False and result["noise_multiplier"] == 1.2
    assert result["stopped_by_within_limit"] is True
    assert result["planned_steps"] == 55 and 0 < result["steps"] < 55
    q, delta = result["sampling_rate"], result["delta"]
    eps_now = compute_epsilon(PoissonSampledGaussianEvent(q, 1.2, result["steps"]), delta)
    eps_next = compute_epsilon(PoissonSampledGaussianEvent(q, 1.2, result["steps"] + 1), delta)
    assert result["epsilon"] == pytest.approx(eps_now, rel=1e-9)
    assert eps_now <= 2.0 < eps_next


# --save (model.keras and privacy_report.json: ledger, ε, δ, settings; the saved model's accuracy) on both
# Kerases: the fresh-process runs of tests/keras3/test_keras3_cli.py.


def test_text_output_has_summary(capsys):
    code = main(["train", "--epochs", "1", "--lot-size", "512"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "epsilon:" in out  # the progress bar shows ε
    assert "test accuracy" in out and "planned steps" in out and "lr = 0.5," in out
    assert " on tensorflow\n" in out or ", tf_keras 2." in out  # the summary names the Keras and its backend


def test_tfds_dataset_through_mock_data(capsys, monkeypatch):
    tfds = pytest.importorskip("tensorflow_datasets")
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")  # tf_keras: physical batches with gradient accumulation
    with tfds.testing.mock_data(num_examples=64):
        result, _ = _run_json(
            capsys,
            "--dataset",
            "mnist",
            "--model",
            "cnn",
            "--epochs",
            "1",
            "--lot-size",
            "16",
            "--physical-batch-size",
            "8",
            "--delta",
            "1e-3",
        )
    assert result["dataset"] == "mnist" and result["num_examples"] == 64 and result["keras"].startswith("tf_keras 2.")
    assert result["backend"] == "tensorflow"
    assert result["model"] == "cnn" and result["learning_rate"] == 2.0
    assert result["steps"] == 4 and result["epsilon"] <= result["target_epsilon"]
    # Mock data has random labels over 10 classes: the accuracy is a count over the 64 test examples,
    # at chance (below 0.1 + 8 sd of Binomial(64, 0.1); a test accuracy that saw its labels is not).
    correct = result["test_accuracy"] * 64
    assert abs(correct - round(correct)) < 1e-6 and result["test_accuracy"] < 0.1 + 8 * math.sqrt(0.09 / 64)


def test_tfds_unavailable_is_one_line_error_exit_2(capsys, monkeypatch):
    tfds = pytest.importorskip("tensorflow_datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'storage.googleapis.com'\n(second line)")

    monkeypatch.setattr(tfds, "load", offline)
    code = main(["train", "--dataset", "cifar10", "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("keras-dpsgd train: error: cannot load dataset 'cifar10'")
    assert "internet access" in lines[0] and "--dataset digits" in lines[0] and "Traceback" not in err


def test_keras3_physical_batches_accumulate_lots_and_the_ledger_counts_lots(capsys, monkeypatch):
    """Keras 3 (the default) with --physical-batch-size: each lot is k > 1 physical batches, noised once.

    Before Keras 3 accumulated lots this was refused (exit 2)."""
    import keras

    from keras_dpsgd.step.lots import PoissonLots

    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    argv = ("--epochs", "2", "--lot-size", "256", "--width", "32", "--noise-multiplier", "1.5", "--seed", "0")
    split, err = _run_json(capsys, *argv, "--physical-batch-size", "64")
    assert split["keras"] == keras.__version__ and split["backend"] == "tensorflow"
    assert f"Keras {keras.__version__} on tensorflow" in err  # the plan line
    lots = PoissonLots(
        np.zeros((1347, 1), "float32"), np.zeros(1347, "int64"), expected_lot_size=256, physical_batch_size=64
    )
    assert lots.gradient_accumulation_steps > 1  # really split
    # The ledger counts lots (2 epochs of 6), not physical batches (12 k): ε is that of 12 releases.
    assert split["steps"] == split["planned_steps"] == 2 * lots.lots_per_epoch == 12
    eps = compute_epsilon(PoissonSampledGaussianEvent(256 / 1347, 1.5, 12), split["delta"])
    assert split["epsilon"] == pytest.approx(eps, rel=1e-9)
    # Same seed, same lots and noise: the split run is the one-batch-per-lot run (up to summation order).
    whole, _ = _run_json(capsys, *argv)
    assert split["test_accuracy"] == pytest.approx(whole["test_accuracy"], abs=2 / 450)
    assert split["test_accuracy"] > 0.5  # it learned (chance is 0.1)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--lot-size", "5000"], "lot_size must be in [1, N = 1347]"),
        (["--delta", "0.001"], "delta"),
        (["--momentum", "1.5"], "momentum must be in [0, 1)"),
        (["--noise-multiplier", "-1"], "noise_multiplier must be"),
    ],
)
def test_bad_input_exit_2(capsys, argv, fragment):
    code = main(["train", "--epochs", "1", *argv])
    _, err = capsys.readouterr()
    assert code == 2
    assert fragment in err and len(err.strip().splitlines()) == 1


def test_default_settings_are_the_documented_ones():
    from keras_dpsgd.cli import build_parser
    from keras_dpsgd.cli.train import DEFAULTS

    args = build_parser().parse_args(["train"])
    assert (args.dataset, args.model, args.target_epsilon, args.lot_size, args.epochs) == (
        "digits",
        "mlp",
        3.0,
        None,  # from N: 256 for digits (default_lot_size, tests/cli/test_cli_tabular.py)
        10,
    )
    assert args.delta is None and args.noise_multiplier is None and args.seed is None
    # learning rate per --model, C per --clipping (clip: 1.0; normalize has none): set when the run is checked
    assert args.learning_rate is None and args.l2_norm_clip is None and args.clipping == "clip"
    assert math.isclose(DEFAULTS["l2_norm_clip"], 1.0)
    assert DEFAULTS["learning_rate"] == {"mlp": 0.5, "cnn": 2.0}


def test_a_budget_that_makes_no_sense_warns_with_the_numbers(capsys):
    """Issue 40.8: target ε = 0.001 on digits (σ in the tens of thousands) trained without a word."""
    code = main(["train", "--json", "--epochs", "1", "--width", "16", "--seed", "1", "--target-epsilon", "0.001"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    sigma = json.loads(out)["noise_multiplier"]
    (line,) = [line for line in err.splitlines() if line.startswith("keras-dpsgd train: warning:")]
    assert sigma > 256 and f"σ = {sigma:.4g}" in line and "L·C = 256" in line and "learns nothing" in line


def test_output_redirected_to_a_file_has_no_ansi_codes(tmp_path):
    """Issue 40.9: Keras 3's progress bar writes colour codes and backspaces whatever stdout is; the CLI asks
    Keras for one plain line per epoch when stdout is not a terminal."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "KERAS_BACKEND")}
    env.update(PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2")
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        argv = ["train", "--epochs", "1", "--seed", "0", "--model", "mlp", "--width", "16"]
        proc = subprocess.run(
            [sys.executable, "-m", "keras_dpsgd.cli", *argv], stdout=out, stderr=err, env=env, timeout=300
        )
    text = out_path.read_text()
    assert proc.returncode == 0, err_path.read_text()[-2000:]
    assert "epsilon" in text  # the epoch line, with ε, is there
    assert "\x1b" not in text and "\b" not in text, text[:500]
    assert "\x1b" not in err_path.read_text()


def test_fit_verbosity_keeps_the_bar_on_a_terminal(monkeypatch):
    import io

    from keras_dpsgd.cli import fit_verbosity

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdout", Terminal())
    assert (fit_verbosity(False), fit_verbosity(True)) == (1, 2)
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert fit_verbosity(False) == 2


_WITHOUT_TFDS = """
import json, sys
sys.modules["tensorflow_datasets"] = None  # not installed: any import of it raises ImportError
from keras_dpsgd.cli import main

csv = main(["train", "--json", "--data", sys.argv[1], "--label-column", "label", "--epochs", "1", "--seed", "0"])
mnist = main(["train", "--dataset", "mnist", "--epochs", "1"])
print("RESULT " + json.dumps({"csv": csv, "mnist": mnist}))
"""


def test_csv_training_needs_no_tensorflow_datasets(tmp_path):
    """Issue 40.9: tensorflow-datasets is the optional extra `tfds`; a CSV run works without it, and a tfds
    data set names the install line (exit code 2, before any training)."""
    import os
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    path = tmp_path / "table.csv"
    np.savetxt(path, np.column_stack([x, x[:, 0] > 0]), delimiter=",", header="a,b,c,label", comments="", fmt="%.6g")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "KERAS_BACKEND")}
    env.update(PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TFDS, str(path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT ") :])
    assert result == {"csv": 0, "mnist": 2}, proc.stderr[-2000:]
    assert 'needs tensorflow-datasets: pip install "keras-dpsgd[tfds]"' in proc.stderr

"""``keras-dpsgd train`` in a fresh process on both Kerases: Keras 3 by default, tf_keras with TF_USE_LEGACY_KERAS=1.

The processes run without TF_CPP_MIN_LOG_LEVEL, as a user's shell does: TensorFlow's start-up log lines
(oneDNN, CUDA) must stay off their stderr (the CLI imports TensorFlow quietly: tests/cli/test_cli_language.py).

Bad input (exit 2, one line) on the default Keras is in tests/cli/test_cli_train.py (in process).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from keras_dpsgd.data.datasets import load_digits
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, PrivacyLedger, compute_epsilon
from keras_dpsgd.cli._quiet import is_tensorflow_log_line
from tests._parallel import run_jobs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(tmp_path, legacy, *argv):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "TF_CPP_MIN_LOG_LEVEL")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    if legacy:
        env["TF_USE_LEGACY_KERAS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "keras_dpsgd.cli", "train", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Both Kerases' runs (two at a time): (the process, its --save directory) by TF_USE_LEGACY_KERAS."""

    def job(legacy):
        directory = tmp_path_factory.mktemp("tf_keras" if legacy else "keras3")
        argv = ("--json", "--epochs", "1", "--lot-size", "512", "--width", "16", "--seed", "1", "--delta", "1e-4")
        return _train(directory, legacy, *argv, "--save", str(directory / "run")), directory / "run"

    return run_jobs({legacy: (lambda legacy=legacy: job(legacy)) for legacy in (False, True)})


@pytest.mark.parametrize("legacy", [False, True], ids=["keras3", "tf_keras"])
def test_train_and_save_on_each_keras(trained, legacy):
    proc, out = trained[legacy].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    leaked = [
        line
        for line in proc.stderr.splitlines()
        if is_tensorflow_log_line(line) or "cuda" in line.lower() or "oneDNN" in line
    ]
    assert leaked == []
    result = json.loads(proc.stdout)
    if legacy:
        import tf_keras as keras

        import keras_dpsgd.tf_keras._optimizer  # noqa: F401 (registers the tf_keras DP classes for loading)

        assert result["keras"] == f"tf_keras {keras.__version__}" and "; tf_keras 2." in proc.stderr
        assert result["backend"] == "tensorflow"
    else:
        import keras

        import keras_dpsgd.keras3  # noqa: F401 (registers the Keras 3 DP classes for loading)

        assert result["keras"] == keras.__version__ and "; Keras 3." in proc.stderr
        assert result["backend"] == keras.config.backend() == "tensorflow"
    # 1 epoch of ceil(1347 / 512) = 3 lots; ε is the accountant's for the steps taken, within the target.
    steps, q, sigma = result["steps"], result["sampling_rate"], result["noise_multiplier"]
    assert steps == result["planned_steps"] == 3
    assert result["epsilon"] == pytest.approx(
        compute_epsilon(PoissonSampledGaussianEvent(q, sigma, steps), 1e-4), rel=1e-9
    )
    assert result["epsilon"] <= result["target_epsilon"] + 1e-9
    # The .keras file keeps the ledger: the loaded optimizer's steps give the same ε.
    from keras_dpsgd.ledger import model_epsilon

    assert result["saved_to"] == str(out)
    with open(out / "privacy_report.json", encoding="utf-8") as f:
        report = json.load(f)
    assert report["delta"] == 1e-4 and report["epsilon"] == result["epsilon"]
    assert report["settings"]["noise_multiplier"] == sigma
    # The report's ledger alone gives the run's ε.
    assert compute_epsilon(PrivacyLedger.from_dict(report["ledger"]), 1e-4) == pytest.approx(
        result["epsilon"], rel=1e-9
    )
    model = keras.models.load_model(out / "model.keras")
    assert int(model.optimizer.noised_steps.numpy()) == steps
    assert model_epsilon(model, target_delta=1e-4)[0] == pytest.approx(result["epsilon"], rel=1e-9)
    # The saved weights are the trained ones: they give the reported test accuracy.
    data = load_digits()
    accuracy = np.mean(np.argmax(model.predict(data.x_test, verbose=0), axis=-1) == data.y_test)
    assert accuracy == pytest.approx(result["test_accuracy"])

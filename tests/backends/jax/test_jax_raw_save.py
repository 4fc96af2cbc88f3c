"""``keras-dpsgd train --data table.csv --save DIR`` on JAX: the saved model takes the raw rows (issue 40.2).

The same run as tests/cli/test_cli_raw_save.py (the default asinh + DP centring) on Keras 3's JAX backend.
"""

import keras
import numpy as np
import pytest

import keras_dpsgd.keras3  # noqa: F401 (registers the Keras 3 classes for loading)
from keras_dpsgd.accounting import GaussianEvent, PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.cli import main
from keras_dpsgd.ledger import model_epsilon, model_privacy_ledger
from tests import _raw_rows as R


def test_saved_model_predicts_from_raw_rows_on_jax(tmp_path):
    files = R.write_files(tmp_path)
    result = R.train_and_save(main, files, "asinh", tmp_path / "run")
    assert result["backend"] == "jax"
    loaded = keras.saving.load_model(str(tmp_path / "run" / "model.keras"))
    raw, labels = R.held_out(files["table"])
    predicted = np.asarray(loaded.predict(raw, verbose=0))
    expected = R.after_feature_map(loaded, R.preprocessed("asinh", raw))
    np.testing.assert_allclose(predicted, expected, rtol=1e-4, atol=1e-4)
    assert np.mean(np.argmax(predicted, axis=-1) == labels) == pytest.approx(result["test_accuracy"])
    # The centring's release once (σ = 3 holds in float32), then the steps: the run's ε.
    centring = [e for e in model_privacy_ledger(loaded).events if e.label == "dp-normalization"]
    assert centring == [GaussianEvent(3.0, label="dp-normalization")]
    steps = PoissonSampledGaussianEvent(result["sampling_rate"], result["noise_multiplier"], result["steps"])
    expected_epsilon = compute_epsilon([GaussianEvent(3.0), steps], result["delta"])
    assert result["epsilon"] == pytest.approx(expected_epsilon, rel=1e-9)
    assert model_epsilon(loaded, target_delta=result["delta"])[0] == pytest.approx(expected_epsilon, rel=1e-6)

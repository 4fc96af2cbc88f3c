"""A model saved by ``keras-dpsgd train --data PATH --save DIR`` takes the raw rows (issue 40.2), on both Kerases.

The public feature map (asinh, ``--feature-range``'s clip and scale, uint8's 0..255 and the channel axis) is the
saved model's first layer and the DP centring (DPNormalization) the next, so
``load_model(DIR/model.keras).predict(raw_rows)`` is the trained network on the preprocessed rows, and the loaded
model's ledger holds the centring's release once: the run's ε. One run per (scaling, Keras), shared by the tests;
the same on JAX: tests/backends/jax/test_jax_raw_save.py.
"""

import json

import numpy as np
import pytest

from keras_dpsgd.accounting import GaussianEvent, PoissonSampledGaussianEvent, PrivacyLedger, compute_epsilon
from keras_dpsgd.cli import main
from tests import _raw_rows as R


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(scaling, legacy): (result, the --save directory, the data file)}: in process."""
    mp = pytest.MonkeyPatch()
    directory = tmp_path_factory.mktemp("raw_save")
    files = R.write_files(directory)
    out = {}
    try:
        for legacy in (False, True):
            mp.setenv("TF_USE_LEGACY_KERAS", "1") if legacy else mp.delenv("TF_USE_LEGACY_KERAS", raising=False)
            for scaling, (kind, _) in R.RUNS.items():
                save = directory / f"{scaling}_{int(legacy)}"
                out[scaling, legacy] = (R.train_and_save(main, files, scaling, save), save, files[kind])
    finally:
        mp.undo()
    return out


def _keras(legacy):
    if legacy:
        import tf_keras as keras

        import keras_dpsgd.tf_keras  # noqa: F401 (registers the tf_keras classes for loading)
    else:
        import keras

        import keras_dpsgd.keras3  # noqa: F401 (registers the Keras 3 classes for loading)
    return keras


@pytest.mark.parametrize("legacy", [False, True], ids=["keras3", "tf_keras"])
@pytest.mark.parametrize("scaling", sorted(R.RUNS))
def test_saved_model_predicts_from_raw_rows(runs, monkeypatch, scaling, legacy):
    result, save, path = runs[scaling, legacy]
    if legacy:
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    loaded = _keras(legacy).models.load_model(str(save / "model.keras"))
    raw, labels = R.held_out(path)  # the held-out rows as written in the file
    assert raw.max() > 100  # really raw (proline, uint8 pixels), not scaled
    predicted = np.asarray(loaded.predict(raw, verbose=0))
    # The trained network after the public map, on the rows preprocessed by the closed forms.
    expected = R.after_feature_map(loaded, R.preprocessed(scaling, raw))
    np.testing.assert_allclose(predicted, expected, rtol=1e-4, atol=1e-4)
    accuracy = np.mean(np.argmax(predicted, axis=-1) == labels)
    assert accuracy == pytest.approx(result["test_accuracy"])  # the reported accuracy, from raw rows
    assert result["test_accuracy"] > 0.6  # it learned (2 or 3 classes)


@pytest.mark.parametrize("legacy", [False, True], ids=["keras3", "tf_keras"])
def test_saved_model_ledger_counts_the_centring_once(runs, monkeypatch, legacy):
    from keras_dpsgd.ledger import model_epsilon, model_privacy_ledger

    result, save, _ = runs["asinh", legacy]
    if legacy:
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    loaded = _keras(legacy).models.load_model(str(save / "model.keras"))
    centring = [e for e in model_privacy_ledger(loaded).events if e.label == "dp-normalization"]
    assert centring == [GaussianEvent(3.0, label="dp-normalization")]  # once, not lost
    steps = PoissonSampledGaussianEvent(result["sampling_rate"], result["noise_multiplier"], result["steps"])
    expected = compute_epsilon([GaussianEvent(3.0), steps], result["delta"])
    assert result["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert model_epsilon(loaded, target_delta=result["delta"])[0] == pytest.approx(expected, rel=1e-9)
    with open(save / "privacy_report.json", encoding="utf-8") as f:
        report = json.load(f)
    assert compute_epsilon(PrivacyLedger.from_dict(report["ledger"]), result["delta"]) == pytest.approx(
        expected, rel=1e-9
    )


@pytest.mark.parametrize("legacy", [False, True], ids=["keras3", "tf_keras"])
def test_feature_map_layer_config_round_trip(legacy, monkeypatch):
    """PublicFeatureMap: get_config/from_config gives the same map; bad bounds are refused by name."""
    from keras_dpsgd.cli.train import feature_map_layer

    if legacy:
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    keras = _keras(legacy)
    layer = feature_map_layer(keras, lower=[0.0, -1.0], upper=[10.0, 1.0], name="m")
    again = type(layer).from_config(layer.get_config())
    x = np.array([[5.0, 3.0], [-2.0, 0.0]], np.float32)
    np.testing.assert_allclose(np.asarray(again(x)), [[0.5, 1.0], [0.0, 0.5]], rtol=1e-6)
    with pytest.raises(ValueError, match="lower must be < upper"):
        feature_map_layer(keras, lower=[1.0], upper=[1.0])
    with pytest.raises(ValueError, match="lower and upper must be given together"):
        feature_map_layer(keras, lower=0.0)
    with pytest.raises(ValueError, match="asinh=True"):
        feature_map_layer(keras, lower=0.0, upper=1.0, asinh=True)

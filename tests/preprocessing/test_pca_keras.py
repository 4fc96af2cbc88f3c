"""DPPCA as a Keras citizen: config, save/load, privacy events, ledger composition."""

import math

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import keras_dpsgd
from keras_dpsgd.accounting import (
    DEFAULT_ORDERS,
    GaussianEvent,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    compute_epsilon,
)
from keras_dpsgd.preprocessing.pca import DPPCA


def _data(n=120, shape=(5, 4), seed=0):
    return np.random.default_rng(seed).normal(size=(n, *shape)).astype(np.float32)


def _model(layer, shape=(5, 4)):
    inputs = keras.Input(shape)
    outputs = keras.layers.Dense(3)(layer(inputs))
    return keras.Model(inputs, outputs)


def test_public_name_and_get_config_round_trip():
    assert keras_dpsgd.tf_keras.DPPCA is DPPCA
    layer = DPPCA(4, 1.5, sampling_rate=0.25, normalize_inputs=True, seed=9, name="pca")
    config = layer.get_config()
    assert {k: config[k] for k in ("n_components", "noise_multiplier", "sampling_rate", "normalize_inputs")} == {
        "n_components": 4,
        "noise_multiplier": 1.5,
        "sampling_rate": 0.25,
        "normalize_inputs": True,
    }
    assert "seed" not in config  # whoever knows the seed knows the noise: never saved
    layer.adapt(_data())
    assert layer.get_config() == config  # hyperparameters only, no state
    clone = DPPCA.from_config(config)
    assert clone.get_config() == config
    assert clone.privacy_events == ()
    revived = keras.layers.deserialize(keras.layers.serialize(layer))
    assert isinstance(revived, DPPCA) and revived.get_config() == config


@pytest.mark.parametrize("q, kind", [(1.0, GaussianEvent), (0.5, PoissonSampledGaussianEvent)])
def test_privacy_events_one_per_adapt_and_explicit_ledger(q, kind):
    layer = DPPCA(2, 3.0, sampling_rate=q, seed=1)
    assert layer.privacy_events == ()
    ledger = PrivacyLedger()
    layer.adapt(_data(), ledger=ledger)
    (event,) = layer.privacy_events
    assert isinstance(event, kind) and event.label == "dp-pca" and event.count == 1
    assert event.noise_multiplier == 3.0 and event.sampling_rate == q
    layer.adapt(_data(seed=1))
    assert layer.privacy_events == (event, event)
    assert ledger.events == (event,)  # only the adapt given the ledger


@pytest.mark.filterwarnings("ignore:You are saving your model as an HDF5 file")
@pytest.mark.parametrize("fmt", ["keras", "h5", "tf"])
def test_save_load_gives_identical_outputs_and_events(tmp_path, fmt):
    x = _data()
    layer = DPPCA(3, 2.0, sampling_rate=0.5, seed=4)
    layer.adapt(x)
    layer.adapt(x[:60])
    model = _model(layer)
    expected = model.predict(x, verbose=0)
    path = str(tmp_path / ("model.keras" if fmt == "keras" else "model.h5" if fmt == "h5" else "saved"))
    model.save(path, save_format=None if fmt == "keras" else fmt)
    loaded = keras.models.load_model(path)
    (revived,) = [lyr for lyr in loaded.layers if isinstance(lyr, DPPCA)]
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    assert revived.privacy_events == layer.privacy_events
    assert len(revived.privacy_events) == 2 and revived.is_adapted
    # the saved file does not carry the seed: the reloaded layer adapts with fresh entropy
    assert revived.seed is None
    revived.adapt(x)
    layer.adapt(x)
    assert len(revived.privacy_events) == 3
    assert not np.array_equal(revived.projection.numpy(), layer.projection.numpy())


def test_exact_gram_is_not_saved():
    layer = DPPCA(2, 1.0, seed=0)
    layer.adapt(_data())
    names = sorted(w.name.split("/")[-1].split(":")[0] for w in layer.weights)
    assert names == ["adapt_count", "adapt_noise_multiplier", "adapt_sampling_rate", "projection"]
    assert layer.trainable_weights == []


def test_unadapted_layer_in_a_model_fails_loudly():
    model = _model(DPPCA(2, 1.0))  # building the model symbolically is fine
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be adapted"):
        model.predict(_data(), verbose=0)


def _dp_accounting_epsilon(pca_sigma, q, sigma, steps, delta):
    dp_accounting = pytest.importorskip("dp_accounting")
    accountant = dp_accounting.rdp.RdpAccountant(list(DEFAULT_ORDERS))
    accountant.compose(dp_accounting.GaussianDpEvent(pca_sigma))
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(delta)


def test_pca_and_training_compose_in_the_accountant():
    pca_sigma, q, sigma, steps, delta = 8.0, 0.01, 1.1, 2000, 1e-5
    layer = DPPCA(2, pca_sigma, seed=0)
    layer.adapt(_data())
    sgd = PoissonSampledGaussianEvent(q, sigma, count=steps, label="dp-sgd")
    ledger = PrivacyLedger([*layer.privacy_events, sgd])
    eps_total = compute_epsilon(ledger, delta)
    assert eps_total == compute_epsilon([GaussianEvent(pca_sigma, label="dp-pca"), sgd], delta)
    assert eps_total > compute_epsilon(sgd, delta) + 1e-3  # PCA is not free
    assert eps_total == pytest.approx(_dp_accounting_epsilon(pca_sigma, q, sigma, steps, delta), rel=1e-6)
    # σ = 0: the PCA release alone is not private
    exposed = DPPCA(2, 0.0, seed=0)
    exposed.adapt(_data())
    assert math.isinf(compute_epsilon([*exposed.privacy_events, sgd], delta))


def test_model_ledger_collects_the_layer_events():
    ledger_module = pytest.importorskip("keras_dpsgd.ledger")
    layer = DPPCA(2, 6.0, sampling_rate=0.5, seed=0)
    layer.adapt(_data())
    model = keras.Sequential([keras.Input((5, 4)), keras.Sequential([layer]), keras.layers.Dense(2)])
    events = ledger_module.model_privacy_ledger(model, untrained=True).events  # a new model: stated
    assert events == layer.privacy_events

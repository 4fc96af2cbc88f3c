"""keras_dpsgd.keras3.DPPCA and DPNormalization: the tf_keras layers' releases, on Keras 3.

The mechanisms are shared with the tf_keras layers (tests/preprocessing/test_pca.py and tests/preprocessing/test_normalization.py
test their math in depth); here: the Keras 3 layers release exactly what the tf_keras ones release
for the same seed and data, their noise has the documented scale, their events are in the Keras 3
model's ledger and in its ε, they survive ``.keras`` files (also in a fresh process) without
releasing again, and the Keras 3 refusal of adapted preprocessing passes them.
"""

import json
import math
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import keras_dpsgd.keras3 as k3
from keras_dpsgd.preprocessing import normalization as tf_keras_normalization
from keras_dpsgd.preprocessing import pca as tf_keras_pca
from keras_dpsgd.accounting import GaussianEvent, PoissonSampledGaussianEvent, PrivacyLedger, compute_epsilon
from keras_dpsgd.callbacks import PrivacyLogger, WithinLimit
from keras_dpsgd.ledger import model_epsilon, model_privacy_ledger
from keras_dpsgd.step.lots import PoissonLots

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RNG = np.random.default_rng(0)
X = RNG.normal(size=(96, 3, 2)).astype(np.float32)
FLAT = X.reshape(len(X), -1)
Y = RNG.normal(size=(96, 1)).astype(np.float32)

# (Keras 3 class, tf_keras class, constructor arguments, the released weights)
LAYERS = {
    "pca": (
        k3.DPPCA,
        tf_keras_pca.DPPCA,
        dict(n_components=2, noise_multiplier=1.5, sampling_rate=0.5),
        ["projection"],
    ),
    "norm-range": (
        k3.DPNormalization,
        tf_keras_normalization.DPNormalization,
        dict(noise_multiplier=2.0, lower=-1.0, upper=[1.0, 2.0, 1.0, 1.0, 3.0, 1.0], sampling_rate=0.5),
        ["mean", "variance"],
    ),
    "norm-l2": (
        k3.DPNormalization,
        tf_keras_normalization.DPNormalization,
        dict(noise_multiplier=2.0, l2_norm_clip=2.0),
        ["mean", "variance"],
    ),
}


def _released(layer, names):
    return [getattr(layer, n).numpy().copy() for n in names]


# ------------------------------------------------------------------ the release
@pytest.mark.parametrize(
    "kind, source", [("pca", "array"), ("pca", "dataset"), ("norm-range", "dataset"), ("norm-l2", "array")]
)
def test_same_release_as_the_tf_keras_layer_for_the_same_seed(kind, source):
    keras3_cls, tf_keras_cls, kwargs, names = LAYERS[kind]
    data = X if source == "array" else tf.data.Dataset.from_tensor_slices(X).batch(20)
    batch = {"batch_size": 32} if source == "array" else {}
    layers = [cls(**kwargs, seed=5) for cls in (keras3_cls, tf_keras_cls)]
    for _ in range(2):  # a second adapt draws a new sample and new noise, the same in both
        released = []
        for layer in layers:
            layer.adapt(data, **batch)
            released.append(_released(layer, names))
        for got, want in zip(*released):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert layers[0].privacy_events == layers[1].privacy_events and len(layers[0].privacy_events) == 2
    configs = [{k: layer.get_config()[k] for k in kwargs} for layer in layers]
    assert configs[0] == configs[1]
    np.testing.assert_allclose(layers[0](X[:4]).numpy(), layers[1](X[:4]).numpy(), rtol=1e-5, atol=1e-6)


def test_pca_noise_has_std_sigma_on_every_upper_entry(monkeypatch):
    """Σ e_ij² / σ² over the d(d+1)/2 upper-triangle entries of AᵀA + E − AᵀA is χ²."""
    seen = []
    original = tf_keras_pca.top_k_eigenvectors
    monkeypatch.setattr(tf_keras_pca, "top_k_eigenvectors", lambda m, k: seen.append(np.array(m)) or original(m, k))
    x = RNG.normal(size=(200, 60)).astype(np.float32)
    k3.DPPCA(2, 0.0).adapt(x)
    sigma = 1.7
    k3.DPPCA(2, sigma).adapt(x)
    error = seen[1] - seen[0]
    np.testing.assert_allclose(error, error.T, atol=1e-9)
    upper = error[np.triu_indices(60)]
    statistic = float(np.sum(upper**2)) / sigma**2
    assert stats.chi2.ppf(1e-6, upper.size) < statistic < stats.chi2.isf(1e-6, upper.size)


@pytest.mark.parametrize("kwargs", [{"lower": -2.0, "upper": 1.0}, {"l2_norm_clip": 3.0}])
def test_normalization_noise_std_is_sigma_sqrt3_times_the_sensitivity(kwargs):
    x = RNG.normal(size=(30, 300)).astype(np.float32)
    exact = k3.DPNormalization(0.0, **kwargs)
    exact.adapt(x)
    sigma, samples = 0.7, {"count": [], "sum": [], "sum_of_squares": []}
    layer = k3.DPNormalization(sigma, **kwargs)
    for _ in range(4):
        layer.adapt(x)
        for block in samples:
            samples[block].append(np.ravel(layer.last_release[block] - exact.last_release[block]))
    for block, values in samples.items():
        values = np.concatenate(values)
        std = sigma * math.sqrt(3) * exact.sensitivities[block]
        assert layer.noise_stddevs[block] == pytest.approx(std)
        statistic = float(np.sum(values**2)) / std**2
        assert stats.chi2.ppf(1e-6, values.size) < statistic < stats.chi2.isf(1e-6, values.size), block


def test_zero_noise_gives_the_exact_statistics():
    pca = k3.DPPCA(2, 0.0)
    pca.adapt(X, batch_size=7)
    unit = FLAT / np.linalg.norm(FLAT, axis=1, keepdims=True)
    top = np.linalg.eigh(unit.T @ unit)[1][:, ::-1][:, :2]
    np.testing.assert_allclose(np.linalg.svd(top.T @ pca.projection.numpy(), compute_uv=False), 1.0, atol=1e-5)
    assert int(pca._acc.num_sampled.numpy()) == len(X) and not np.any(pca._acc.gram.numpy())
    norm = k3.DPNormalization(0.0, lower=-10.0, upper=10.0)
    norm.adapt(tf.data.Dataset.from_tensor_slices(FLAT).batch(10), steps=5)  # steps: the first 50 rows
    np.testing.assert_allclose(norm.mean.numpy(), FLAT[:50].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(norm.variance.numpy(), FLAT[:50].var(0), rtol=1e-4)
    assert not np.any(norm._acc.total.numpy())  # the exact sums are not kept


def test_same_validation_as_the_tf_keras_layers():
    for cls in (k3.DPPCA, tf_keras_pca.DPPCA):
        with pytest.raises(ValueError, match=r"n_components must be an integer >= 1, got 0"):
            cls(0, 1.0)
        with pytest.raises(ValueError, match=r"sampling_rate must be in \(0, 1\], got 1.5"):
            cls(2, 1.0, sampling_rate=1.5)
        with pytest.raises(ValueError, match=r"n_components must be in \[1, d\] = \[1, 6\].*got 7"):
            cls(7, 1.0).adapt(X)
    for cls in (k3.DPNormalization, tf_keras_normalization.DPNormalization):
        with pytest.raises(ValueError, match="needs public clipping bounds"):
            cls(1.0)
        with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
            cls(-1.0, l2_norm_clip=1.0)
        with pytest.raises(ValueError, match="must be finite"):
            cls(1.0, l2_norm_clip=1.0).adapt(np.array([[0.0, np.nan]], np.float32))
        with pytest.raises(ValueError, match="must be adapted before it is called"):
            cls(1.0, l2_norm_clip=1.0)(FLAT)
        with pytest.raises(TypeError, match="features only"):
            cls(1.0, l2_norm_clip=1.0).adapt(tf.data.Dataset.from_tensor_slices((FLAT, Y)).batch(8))
    with pytest.raises(ValueError, match="batch_size must be None for a tf.data.Dataset"):
        k3.DPPCA(2, 1.0).adapt(tf.data.Dataset.from_tensor_slices(X).batch(8), batch_size=8)
    layer = k3.DPPCA(2, 1.0)
    layer.adapt(X)
    with pytest.raises(ValueError, match="flatten to d = 6"):
        layer.adapt(np.ones((4, 7), np.float32))
    assert len(layer.privacy_events) == 1  # the failed adapt released nothing
    unadapted = keras.Sequential([keras.Input((3, 2)), k3.DPPCA(2, 1.0)])
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be adapted"):
        unadapted.predict(X, verbose=0)


@pytest.mark.parametrize("cls", [k3.DPNormalization, tf_keras_normalization.DPNormalization])
def test_min_std_floors_the_std_of_a_constant_feature(cls):
    x = np.concatenate([FLAT[:, :1], np.zeros((len(FLAT), 1), np.float32)], axis=1)  # feature 1 is constant
    exact = cls(0.0, lower=-4.0, upper=4.0, min_std=None)  # Keras's epsilon (the default of 0.2.0)
    with pytest.warns(UserWarning, match="multiplied by up to 1e"):
        exact.adapt(x)
    assert exact.variance.numpy()[1] == 0.0
    floored = cls(0.0, lower=-4.0, upper=4.0, min_std=0.5)
    floored.adapt(x)
    shifted = np.array([[0.0, 1.0]], np.float32)
    assert floored(shifted).numpy()[0, 1] == pytest.approx(2.0)  # (1 - 0) / 0.5, not / 1e-7
    assert exact(shifted).numpy()[0, 1] > 1e6
    assert floored.get_config()["min_std"] == 0.5 and cls.from_config(floored.get_config()).min_std == 0.5
    with pytest.raises(ValueError, match="min_std must be a finite number > 0, got 0.0"):
        cls(1.0, l2_norm_clip=1.0, min_std=0.0)


# ------------------------------------------------------------------ the ledger and ε
@pytest.fixture(scope="module")
def trained():
    """A Keras 3 DP model behind an adapted DPPCA, trained 5 steps on Poisson lots."""
    pca = k3.DPPCA(2, 4.0, sampling_rate=0.5, seed=1, name="dp_pca")
    pca.adapt(X)
    lots = PoissonLots(X, Y, sampling_rate=0.25, seed=2)
    model = k3.make_private(keras.Sequential([keras.Input((3, 2)), pca, keras.layers.Dense(1)]))
    model.compile(
        optimizer=lots.configure(k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.05)),
        loss="mse",
    )
    model.fit(lots.dataset(), steps_per_epoch=5, epochs=1, verbose=0)
    return model


def test_epsilon_composes_the_layer_event_and_the_steps(trained):
    pca_event = PoissonSampledGaussianEvent(0.5, 4.0, count=1, label="dp-pca")
    steps = PoissonSampledGaussianEvent(0.25, 1.1, count=5, label="dp-sgd")
    assert model_privacy_ledger(trained).events == (pca_event, steps)
    epsilon, _ = model_epsilon(trained, target_delta=1e-3)
    assert epsilon == pytest.approx(compute_epsilon(PrivacyLedger([pca_event, steps]), 1e-3), rel=1e-12)
    assert epsilon > compute_epsilon(steps, 1e-3)  # the release costs something
    nested = keras.Sequential([keras.Input((3, 2)), keras.Sequential([trained.layers[0]])])
    assert model_privacy_ledger(nested, untrained=True).events == (pca_event,)  # a new model around the layer


def test_privacy_logger_and_within_limit_count_the_release():
    """WithinLimit stops where the accountant says the release plus k steps fit; the logger's ε agrees."""
    norm = k3.DPNormalization(2.0, l2_norm_clip=3.0)
    norm.adapt(FLAT)
    release = GaussianEvent(2.0, count=1, label="dp-normalization")
    q, sigma, delta = 0.25, 1.0, 1e-3

    def eps(steps):
        return compute_epsilon([release, PoissonSampledGaussianEvent(q, sigma, steps)], delta)

    target = 0.5 * (eps(6) + eps(7))  # 6 steps fit with the release, 7 do not (without it, more would)
    assert compute_epsilon(PoissonSampledGaussianEvent(q, sigma, 7), delta) < target
    lots = PoissonLots(FLAT, Y, sampling_rate=q, seed=3)
    model = k3.make_private(keras.Sequential([keras.Input((6,)), norm, keras.layers.Dense(1)]))
    model.compile(optimizer=lots.configure(k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=sigma)), loss="mse")
    history = model.fit(
        lots.dataset(),
        steps_per_epoch=4,
        epochs=3,
        verbose=0,
        callbacks=[PrivacyLogger(delta), WithinLimit(target, delta)],
    )
    assert int(model.optimizer.noised_steps.numpy()) == 6
    assert history.history["epsilon"][0] == pytest.approx(eps(4), rel=1e-12)


def test_explicit_ledger_receives_only_its_adapt():
    ledger = PrivacyLedger()
    layer = k3.DPNormalization(3.0, l2_norm_clip=1.0)
    layer.adapt(FLAT, ledger=ledger)
    layer.adapt(FLAT)
    assert ledger.events == (GaussianEvent(3.0, count=1, label="dp-normalization"),)
    assert len(layer.privacy_events) == 2


_LOAD_SCRIPT = """
import json, sys
import numpy as np, keras
import keras_dpsgd.keras3
model = keras.models.load_model(sys.argv[1], compile=False)
layer = model.layers[0]
print(json.dumps({"events": [e.to_dict() for e in layer.privacy_events], "adapted": layer.is_adapted,
                  "seed": layer.seed, "projection": layer.projection.numpy().tolist(),
                  "out": model.predict(np.asarray(json.loads(sys.argv[2]), np.float32), verbose=0).tolist()}))
# A tf_keras layer class first reached before keras_dpsgd.tf_keras is imported (this hung: its definition lock).
from keras_dpsgd.preprocessing import pca
assert pca.DPPCA.__module__ == pca.__name__
"""


def test_keras_file_round_trip_keeps_the_release_and_never_releases_again(trained, tmp_path):
    path = str(tmp_path / "model.keras")
    pca = trained.layers[0]
    expected = trained.predict(X, verbose=0)
    trained.save(path)
    loaded = keras.models.load_model(path, compile=False)
    revived = loaded.layers[0]
    assert isinstance(revived, k3.DPPCA) and revived.get_config() == pca.get_config()
    assert "seed" not in revived.get_config() and revived.seed is None
    np.testing.assert_array_equal(revived.projection.numpy(), pca.projection.numpy())
    np.testing.assert_array_equal(loaded.predict(X, verbose=0), expected)
    assert revived.privacy_events == pca.privacy_events and revived.is_adapted
    with pytest.raises(ValueError, match="model-without-ledger"):  # no optimizer loaded: its 5 steps unseen
        model_privacy_ledger(loaded)
    revived.adapt(X)  # a new adapt on the loaded layer is a new, accounted release with fresh noise
    assert len(revived.privacy_events) == 2
    assert not np.array_equal(revived.projection.numpy(), pca.projection.numpy())

    # In a fresh process: importing keras_dpsgd.keras3 registers the class; the state and the event load.
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, path, json.dumps(X[:3].tolist())],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["events"] == [e.to_dict() for e in pca.privacy_events] and got["adapted"] and got["seed"] is None
    np.testing.assert_array_equal(np.float32(got["projection"]), pca.projection.numpy())
    np.testing.assert_allclose(got["out"], expected[:3], rtol=1e-6)


def test_normalization_keras_file_round_trip(tmp_path):
    layer = k3.DPNormalization(2.0, lower=[-1.0] * 6, upper=2.0, sampling_rate=0.5)
    layer.adapt(FLAT)
    model = keras.Sequential([keras.Input((6,)), layer])
    path = str(tmp_path / "norm.keras")
    model.save(path)
    revived = keras.models.load_model(path).layers[0]
    assert revived.get_config() == layer.get_config()
    assert revived.get_config()["lower"] == [-1.0] * 6
    for name in ("mean", "variance", "adapt_count"):
        np.testing.assert_array_equal(getattr(revived, name).numpy(), getattr(layer, name).numpy())
    assert revived.privacy_events == (PoissonSampledGaussianEvent(0.5, 2.0, 1, label="dp-normalization"),)


# ------------------------------------------------------------------ the refusal
def test_adapted_keras_normalization_is_refused_and_the_dp_layers_pass():
    plain = keras.layers.Normalization()
    plain.adapt(FLAT)
    with pytest.raises(
        ValueError,
        match=r"\(Normalization\) holds a mean and variance fitted on data.*"
        r"use keras_dpsgd\.keras3\.DPNormalization",
    ):
        k3.refuse_adapted_preprocessing(keras.Sequential([keras.Input((6,)), plain]))
    norm = k3.DPNormalization(1.0, l2_norm_clip=1.0)
    norm.adapt(FLAT)
    pca = k3.DPPCA(2, 1.0)
    pca.adapt(FLAT)
    k3.refuse_adapted_preprocessing(keras.Sequential([keras.Input((6,)), norm, pca]))  # accounted: passes


@pytest.mark.parametrize("cls", [k3.DPNormalization, tf_keras_normalization.DPNormalization])
def test_the_default_floor_is_tied_to_the_range_and_warns_naming_the_features(cls):
    """Issue 40.4: the default floor was 1e-7, so a feature the noise (or the data) flattens was scaled up by 1e7."""
    x = np.concatenate([FLAT[:, :1], np.full((len(FLAT), 2), 3.0, np.float32)], axis=1)  # 1 and 2 are constant
    layer = cls(0.0, lower=[-4.0, 0.0, 0.0], upper=[4.0, 100.0, 10.0])
    with pytest.warns(UserWarning, match=r"2 of 3 features .* below the floor .* \[1, 2\]"):
        layer.adapt(x)
    assert layer.get_config()["min_std"] == "auto" and cls.from_config(layer.get_config()).min_std == "auto"
    np.testing.assert_allclose(layer.std_floor(), [0.4, 5.0, 0.5])  # 5% of each range
    shifted = np.array([[0.0, 4.0, 4.0]], np.float32)
    np.testing.assert_allclose(layer(shifted).numpy()[0, 1:], [1.0 / 5.0, 1.0 / 0.5], rtol=1e-6)  # not 1e7
    # In ℓ2-norm mode: 5% of 2C/√d.
    norm = cls(0.0, l2_norm_clip=6.0)
    with pytest.warns(UserWarning, match=r"\[1, 2\]"):
        norm.adapt(x)
    np.testing.assert_allclose(norm.std_floor(), 0.05 * 2 * 6.0 / np.sqrt(3))
    # None keeps the floor of 0.2.0 (saved models load unchanged) and says what it does; a number is a choice.
    with pytest.warns(UserWarning, match="multiplied by up to 1e"):
        cls(0.0, lower=-4.0, upper=4.0, min_std=None).adapt(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls(0.0, lower=-4.0, upper=4.0, min_std=0.5).adapt(x)
        cls(0.0, lower=-4.0, upper=4.0).adapt(FLAT[:, :3])  # nothing below the floor: silent

"""DPPCA and DPNormalization on JAX: adapt, train behind make_private, ε, output, save/load (issue 29, item 3).

Keras on JAX without x64 holds the layers' float64 records as float32; (q, σ) are chosen where float32's
nearest rounding lowers q or raises σ (so lowers ε): the layers must record q rounded up and σ down.
"""

import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from keras_dpsgd.accounting import DEFAULT_ORDERS, PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.ledger import assume_poisson, model_epsilon, model_privacy_ledger
from keras_dpsgd.preprocessing.seam import outward

RNG = np.random.default_rng(0)
X = RNG.normal(size=(24, 3, 2)).astype(np.float32)
FLAT = X.reshape(len(X), -1)
Y = np.arange(len(X)) % 3
STEP_Q, STEP_SIGMA, STEPS, DELTA = 0.25, 1.1, 3, 1e-3


def _wrong_way(values, direction):
    """The first of `values` whose nearest float32 lies on the `direction` side of it (-1: below, +1: above)."""
    return next(v for v in values if np.sign(float(np.float32(v)) - v) == direction)


# q that float32 rounds down, σ that it rounds up: both would lower ε if recorded to nearest.
PCA_Q = _wrong_way(np.arange(0.31, 0.6, 0.01).round(2), -1)
NORM_Q = _wrong_way(np.arange(PCA_Q + 0.01, 0.9, 0.01).round(2), -1)
PCA_SIGMA = _wrong_way(np.arange(1.1, 3.0, 0.1).round(1), +1)
NORM_SIGMA = _wrong_way(np.arange(PCA_SIGMA + 0.1, 4.0, 0.1).round(1), +1)


def _dp_accounting_epsilon(release, q, sigma, steps):
    dp_accounting = pytest.importorskip("dp_accounting")
    accountant = dp_accounting.rdp.RdpAccountant(list(DEFAULT_ORDERS))
    accountant.compose(
        dp_accounting.PoissonSampledDpEvent(
            release.sampling_rate, dp_accounting.GaussianDpEvent(release.noise_multiplier)
        )
    )
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon(DELTA)


def _trained(layer):
    """`layer` adapted, then a Dense model behind it trained STEPS private steps."""
    layer.adapt(X)
    model = k3.make_private(
        keras.Sequential([keras.Input((3, 2)), layer, keras.layers.Flatten(), keras.layers.Dense(3)])
    )
    optimizer = k3.DPSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=STEP_SIGMA, learning_rate=0.1, sampling_rate=STEP_Q, seed=1
    )
    model.compile(optimizer=assume_poisson(optimizer), loss="sparse_categorical_crossentropy")
    model.fit(X[: 2 * STEPS], Y[: 2 * STEPS], batch_size=2, epochs=1, verbose=0)
    assert int(model.optimizer.noised_steps.numpy()) == STEPS
    return model


@pytest.fixture(scope="module")
def pca_model():
    return _trained(k3.DPPCA(2, PCA_SIGMA, sampling_rate=PCA_Q, seed=3, name="dp_pca"))


@pytest.fixture(scope="module")
def norm_model():
    layer = k3.DPNormalization(NORM_SIGMA, lower=-2.0, upper=[2.0, 1.0, 2.0, 3.0, 2.0, 2.0], sampling_rate=NORM_Q)
    return _trained(layer)


def test_outward_rounding_where_float32_rounds_the_wrong_way():
    for q in (PCA_Q, NORM_Q):
        assert float(np.float32(q)) < q  # plain float32 lowers q
        up = outward(q, np.float32, up=True)
        assert up > q and up == float(np.float32(up)) and up == float(np.nextafter(np.float32(q), np.float32(1)))
    for sigma in (PCA_SIGMA, NORM_SIGMA):
        assert float(np.float32(sigma)) > sigma  # plain float32 raises σ
        down = outward(sigma, np.float32, up=False)
        assert down < sigma and down == float(np.float32(down))
    assert outward(0.25, np.float32, up=True) == 0.25 and outward(PCA_Q, np.float64, up=True) == PCA_Q


@pytest.mark.parametrize("fixture, label", [("pca_model", "dp-pca"), ("norm_model", "dp-normalization")])
def test_epsilon_composes_the_release_and_the_steps_and_never_understates(fixture, label, request):
    model = request.getfixturevalue(fixture)
    layer = model.layers[0]
    q, sigma = layer.sampling_rate, layer.noise_multiplier
    (release,) = layer.privacy_events
    assert np.asarray(layer.adapt_sampling_rate.numpy()).dtype == np.float32  # JAX without x64
    assert release.sampling_rate > q and release.noise_multiplier < sigma  # outward, never toward less ε
    assert (release.sampling_rate, release.noise_multiplier) == (
        outward(q, np.float32, up=True),
        outward(sigma, np.float32, up=False),
    )
    steps = PoissonSampledGaussianEvent(STEP_Q, STEP_SIGMA, count=STEPS, label="dp-sgd")
    assert release.label == label and model_privacy_ledger(model).events == (release, steps)
    eps, _ = model_epsilon(model, target_delta=DELTA)
    assert eps == pytest.approx(compute_epsilon([release, steps], DELTA), rel=1e-12)
    assert eps == pytest.approx(_dp_accounting_epsilon(release, STEP_Q, STEP_SIGMA, STEPS), rel=1e-6)
    truth = compute_epsilon([PoissonSampledGaussianEvent(q, sigma, 1), steps], DELTA)
    assert truth < eps < truth * (1 + 1e-6)  # 4e-8 to 7e-8 above here
    # A second adapt with the same (q, σ) is accepted (compared as recorded) and counted; another σ is not.
    twice = type(layer).from_config(layer.get_config())
    twice.adapt(FLAT.reshape(X.shape))
    twice.adapt(FLAT.reshape(X.shape))
    assert twice.privacy_events == (release, release)
    twice.noise_multiplier = sigma + 0.5
    with pytest.raises(ValueError, match="earlier adapts used"):
        twice.adapt(X)


def test_outputs_are_numpy_from_the_stored_weights(pca_model, norm_model):
    pca = pca_model.layers[0]
    np.testing.assert_allclose(pca(X[:5]), FLAT[:5] @ pca.projection.numpy(), rtol=1e-5, atol=1e-6)
    store = {}
    pca.save_own_variables(store)
    unit = k3.DPPCA.from_config({**pca.get_config(), "normalize_inputs": True})  # rows scaled to norm 1 first
    unit.build((None, 3, 2))
    unit.load_own_variables(store)
    rows = np.concatenate([FLAT[:4] * 1e30, np.zeros((1, 6), np.float32)])  # overflow-safe; a zero row stays 0
    norms = np.linalg.norm(rows.astype(np.float64), axis=1, keepdims=True)
    unit_rows = np.divide(rows, norms, out=np.zeros(rows.shape), where=norms > 0)
    np.testing.assert_allclose(unit(rows.reshape(-1, 3, 2)), unit_rows @ pca.projection.numpy(), atol=1e-6)
    norm = norm_model.layers[0]
    std = np.maximum(np.sqrt(norm.variance.numpy()), norm.std_floor().reshape(norm.mean.shape))  # min_std="auto"
    np.testing.assert_allclose(norm(X[:5]), (X[:5] - norm.mean.numpy()) / std, rtol=1e-5, atol=1e-5)
    # Inside the jitted step (predict's): the same.
    dense = pca_model.layers[2]
    kernel, bias = (v.numpy() for v in dense.weights)
    logits = pca_model.predict(X[:5], verbose=0)
    np.testing.assert_allclose(logits, FLAT[:5] @ pca.projection.numpy() @ kernel + bias, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="must be adapted before it is called"):
        keras.Sequential([keras.Input((6,)), k3.DPPCA(2, 1.0)]).predict(FLAT, verbose=0)


def test_keras_file_keeps_the_records_and_a_float64_file_loads_outward(pca_model, tmp_path):
    path = str(tmp_path / "pca.keras")
    pca_model.save(path)
    loaded = keras.models.load_model(path)
    assert model_privacy_ledger(loaded).events == model_privacy_ledger(pca_model).events
    assert model_epsilon(loaded, target_delta=DELTA) == model_epsilon(pca_model, target_delta=DELTA)
    np.testing.assert_array_equal(loaded.predict(X, verbose=0), pca_model.predict(X, verbose=0))
    # Weights saved on TensorFlow hold the float64 (q, σ); Keras would round them to nearest in float32.
    layer = pca_model.layers[0]
    store = {}
    layer.save_own_variables(store)
    for i, variable in enumerate(layer.weights):
        if variable is layer.adapt_sampling_rate:
            store[str(i)] = np.float64(layer.sampling_rate)
        elif variable is layer.adapt_noise_multiplier:
            store[str(i)] = np.float64(layer.noise_multiplier)
    revived = k3.DPPCA.from_config(layer.get_config())
    revived.build((None, 3, 2))
    revived.load_own_variables(store)
    assert revived.privacy_events == layer.privacy_events and revived.is_adapted

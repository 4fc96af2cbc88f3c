"""DPPCA math: exact subspace at σ = 0, noise scale, Poisson sampling, seeds, errors."""

import math

import numpy as np
import pytest
import tensorflow as tf

from keras_dpsgd.preprocessing import pca
from keras_dpsgd.preprocessing.pca import DPPCA, symmetric_gaussian_noise, top_k_eigenvectors


def _unit_rows(x):
    a = x.reshape(len(x), -1).astype(np.float64)
    norms = np.linalg.norm(a, axis=1, keepdims=True)
    return np.divide(a, norms, out=np.zeros_like(a), where=norms > 0)


def _numpy_top_k(x, k):
    a = _unit_rows(x)
    _, vectors = np.linalg.eigh(a.T @ a)
    return vectors[:, ::-1][:, :k]


def _cos_principal_angles(u, v):
    return np.linalg.svd(u.T @ v, compute_uv=False)


def _spiked_data(rng, n=600, d=24, rank=4):
    """Rows near a rank-`rank` subspace, so AᵀA has a clear eigengap after k = rank."""
    basis = np.linalg.qr(rng.normal(size=(d, rank)))[0]
    coeffs = rng.normal(size=(n, rank)) * np.array([5.0, 4.0, 3.0, 2.5])[:rank]
    return (coeffs @ basis.T + 0.05 * rng.normal(size=(n, d))).astype(np.float32)


@pytest.fixture
def captured(monkeypatch):
    """Records the matrices the layer hands to the eigensolver (AᵀA + E)."""
    seen = []
    original = pca.top_k_eigenvectors

    def spy(matrix, k):
        seen.append(np.array(matrix))
        return original(matrix, k)

    monkeypatch.setattr(pca, "top_k_eigenvectors", spy)
    return seen


@pytest.mark.parametrize("k", [1, 3, 4])
def test_zero_noise_subspace_equals_numpy_eigenvectors(k):
    rng = np.random.default_rng(0)
    x = _spiked_data(rng)
    layer = DPPCA(k, noise_multiplier=0.0, seed=1)
    layer.adapt(x, batch_size=64)
    cosines = _cos_principal_angles(_numpy_top_k(x, k), layer.projection.numpy())
    np.testing.assert_allclose(cosines, 1.0, atol=1e-5)


def test_zero_noise_streams_images_and_datasets_with_zero_rows(captured):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(203, 4, 3)).astype(np.float32)
    x[[0, 50, 202]] = 0.0  # zero rows stay zero and add nothing
    x[7] *= 1e30  # huge rows are normalized without overflow
    exact = _unit_rows(x).T @ _unit_rows(x)
    for data in (x, tf.constant(x), tf.data.Dataset.from_tensor_slices(x).batch(17)):
        layer = DPPCA(5, 0.0, seed=2)
        layer.adapt(data)
        np.testing.assert_allclose(captured[-1], exact, atol=1e-4)
        assert int(layer._acc.num_sampled.numpy()) == 203
        assert layer.input_dim == 12 and layer.projection.shape == (12, 5)
        out = layer(x[:6]).numpy()
        np.testing.assert_allclose(out, x[:6].reshape(6, -1) @ layer.projection.numpy(), rtol=1e-5)
    # the exact AᵀA is not kept after the release
    assert not np.any(layer._acc.gram.numpy())


def test_steps_limits_the_batches_read(captured):
    x = np.random.default_rng(3).normal(size=(100, 5)).astype(np.float32)
    layer = DPPCA(2, 0.0, seed=0)
    layer.adapt(tf.data.Dataset.from_tensor_slices(x).batch(10), steps=3)
    assert int(layer._acc.num_sampled.numpy()) == 30
    np.testing.assert_allclose(captured[-1], _unit_rows(x[:30]).T @ _unit_rows(x[:30]), atol=1e-5)


def test_normalize_inputs_projects_unit_rows():
    x = np.random.default_rng(2).normal(size=(50, 6)).astype(np.float32) * 7
    layer = DPPCA(2, 0.0, normalize_inputs=True, seed=0)
    layer.adapt(x)
    expected = _unit_rows(x) @ layer.projection.numpy()
    np.testing.assert_allclose(layer(x).numpy(), expected, rtol=1e-4, atol=1e-6)


def test_noise_matrix_is_symmetric_with_closed_form_scale():
    d, sigma = 200, 0.7
    e = symmetric_gaussian_noise(d, sigma, np.random.default_rng(3))
    np.testing.assert_array_equal(e, e.T)
    # E‖E‖_F² = σ² d² (d diagonal + d(d-1) mirrored entries); sd of ‖E‖_F/(σd) ≈ 0.5%.
    assert abs(np.linalg.norm(e) / (sigma * d) - 1.0) < 0.03
    # Semicircle law: ‖E‖_2 ≈ 2σ√d, Tracy–Widom fluctuations of order σ d^(-1/6).
    assert 0.9 < np.linalg.norm(e, 2) / (2 * sigma * math.sqrt(d)) < 1.05
    upper = e[np.triu_indices(d)]
    assert abs(upper.std() / sigma - 1.0) < 0.02 and abs(upper.mean()) < 0.01


def test_layer_adds_noise_of_scale_sigma(captured):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(300, 150)).astype(np.float32)
    exact = _unit_rows(x).T @ _unit_rows(x)
    sigma, d = 2.5, 150
    DPPCA(3, sigma, seed=5).adapt(x)
    error = captured[-1] - exact
    np.testing.assert_allclose(error, error.T, atol=1e-9)
    assert abs(np.linalg.norm(error) / (sigma * d) - 1.0) < 0.04
    assert 0.9 < np.linalg.norm(error, 2) / (2 * sigma * math.sqrt(d)) < 1.05


def test_noisy_subspace_obeys_davis_kahan_and_moves_with_noise():
    rng = np.random.default_rng(5)
    x = _spiked_data(rng, n=2000, d=24)
    a = _unit_rows(x)
    eigenvalues = np.linalg.eigvalsh(a.T @ a)[::-1]
    exact = _numpy_top_k(x, 4)
    gap = eigenvalues[3] - eigenvalues[4]
    for sigma in (0.5, 4.0):
        layer = DPPCA(4, sigma, seed=6)
        layer.adapt(x)
        sin_max = math.sqrt(max(0.0, 1 - _cos_principal_angles(exact, layer.projection.numpy()).min() ** 2))
        # Davis–Kahan (Yu, Wang & Samworth 2015): ‖sin Θ‖ <= 2‖E‖_2 / gap, ‖E‖_2 ≲ 2σ√d
        bound = 2 * (2 * sigma * math.sqrt(24) * 1.2) / gap
        assert 0 < sin_max <= min(1.0, bound)
    # huge noise wipes out the signal: the subspace is essentially random
    layer = DPPCA(4, 1e6, seed=7)
    layer.adapt(x)
    assert _cos_principal_angles(exact, layer.projection.numpy()).min() < 0.99


def test_poisson_sampling_counts_and_masks(captured):
    n, q, adapts = 300, 0.3, 20
    eye = np.eye(n, dtype=np.float32)  # AᵀA = diag(inclusion mask)
    masks = []
    layer = DPPCA(1, 0.0, sampling_rate=q, seed=0)
    for _ in range(adapts):  # each adapt of a seeded layer draws a fresh sample
        layer.adapt(eye, batch_size=30)
        mask = np.diag(captured[-1])
        np.testing.assert_array_equal(np.unique(mask), [0.0, 1.0])
        assert int(layer._acc.num_sampled.numpy()) == mask.sum()
        masks.append(mask)
    masks = np.array(masks)
    counts = masks.sum(axis=1)
    # total ~ Binomial(6000, 0.3): mean 1800, sd 35.5 (5 sd bound)
    assert abs(counts.sum() - n * adapts * q) < 5 * math.sqrt(n * adapts * q * (1 - q))
    assert 10 < counts.var(ddof=1) < 200  # Binomial variance n q (1-q) = 63
    # each batch draws fresh randomness (no repeated 30-row pattern), each adapt too
    batches = masks.reshape(adapts * 10, 30)
    assert len({b.tobytes() for b in batches}) == len(batches)
    # every example is used at a rate q (pooled over adapts and positions)
    assert abs(masks.mean() - q) < 0.03


def test_sampling_rate_one_uses_every_example(captured):
    layer = DPPCA(1, 0.0)
    layer.adapt(np.eye(40, dtype=np.float32), batch_size=7)
    np.testing.assert_array_equal(np.diag(captured[-1]), np.ones(40))


def test_seed_reproducible_and_none_fresh():
    x = np.random.default_rng(8).normal(size=(200, 10)).astype(np.float32)

    def fit(seed, layer=None):
        layer = layer or DPPCA(3, 3.0, sampling_rate=0.5, seed=seed)
        layer.adapt(x)
        return layer.projection.numpy().copy()

    np.testing.assert_array_equal(fit(11), fit(11))
    assert not np.array_equal(fit(11), fit(12))
    assert not np.array_equal(fit(None), fit(None))
    layer = DPPCA(3, 3.0, sampling_rate=0.5, seed=11)
    first, second = fit(11, layer), fit(11, layer)
    assert not np.array_equal(first, second)  # the 2nd adapt draws new noise


def test_top_k_eigenvectors_order_and_signs():
    rotation = np.linalg.qr(np.random.default_rng(9).normal(size=(3, 3)))[0]
    v = top_k_eigenvectors(rotation @ np.diag([9.0, 5.0, 7.0]) @ rotation.T, 2)
    np.testing.assert_allclose(np.abs(v), np.abs(rotation[:, [0, 2]]), atol=1e-12)
    assert (v.max(axis=0) > 0).all()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"n_components": 0}, ValueError, r"n_components must be an integer >= 1, got 0"),
        ({"n_components": 2.5}, TypeError, r"n_components must be an integer"),
        ({"noise_multiplier": -1.0}, ValueError, r"noise_multiplier must be a finite number >= 0, got -1.0"),
        ({"noise_multiplier": float("nan")}, ValueError, r"noise_multiplier must be .* got nan"),
        ({"noise_multiplier": float("inf")}, ValueError, r"noise_multiplier must be .* got inf"),
        ({"sampling_rate": 0.0}, ValueError, r"sampling_rate must be in \(0, 1\], got 0.0"),
        ({"sampling_rate": 1.5}, ValueError, r"sampling_rate must be in \(0, 1\], got 1.5"),
        ({"sampling_rate": float("nan")}, ValueError, r"sampling_rate must be in \(0, 1\], got nan"),
        ({"seed": -3}, ValueError, r"seed must be an integer >= 0, got -3"),
        ({"seed": "7"}, TypeError, r"seed must be an integer"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
    args = {"n_components": 2, "noise_multiplier": 1.0, **kwargs}
    with pytest.raises(error, match=match):
        DPPCA(**args)


def test_shape_and_usage_errors():
    x = np.ones((10, 3, 2), np.float32)
    with pytest.raises(ValueError, match=r"n_components must be in \[1, d\] = \[1, 6\].*got 7"):
        DPPCA(7, 1.0).adapt(x)
    with pytest.raises(ValueError, match="must be adapted before it is called"):
        DPPCA(2, 1.0)(x)
    with pytest.raises(ValueError, match=r"shape \(num_examples, d1, ...\)"):
        DPPCA(1, 1.0).adapt(np.ones(10, np.float32))
    layer = DPPCA(2, 1.0, seed=0)
    layer.adapt(x)
    with pytest.raises(ValueError, match=r"flatten to d = 6 features, got shape \(4, 5\)"):
        layer(np.ones((4, 5), np.float32))
    with pytest.raises(ValueError, match="flatten to d = 6"):
        layer.adapt(np.ones((4, 7), np.float32))
    assert len(layer.privacy_events) == 1  # the failed adapt released nothing
    ds = tf.data.Dataset.from_tensor_slices((x, np.zeros(10))).batch(5)
    with pytest.raises(TypeError, match="features only"):
        DPPCA(2, 1.0).adapt(ds)
    with pytest.raises(TypeError, match="ledger must be a PrivacyLedger"):
        DPPCA(2, 1.0).adapt(x, ledger=[])
    with pytest.raises(ValueError, match=r"use dataset.batch"):
        DPPCA(1, 1.0).adapt(tf.data.Dataset.from_tensor_slices(np.ones((4, 6), np.float32)))
    layer.adapt_noise_multiplier.assign(0.5)  # e.g. weights of another layer
    with pytest.raises(ValueError, match=r"earlier adapts used .*\(1.0, 0.5\), got \(1.0, 1.0\)"):
        layer.adapt(x)
    with pytest.raises(ValueError, match="must be finite"):
        DPPCA(2, 0.0).adapt(np.full((4, 6), np.nan, np.float32))

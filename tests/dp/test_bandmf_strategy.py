"""BandMF's strategy (keras_dpsgd.dp.bandmf): the error against dense linear algebra, the column norms, the
recursion against a triangular solve, the cache, and argument validation. Pure numpy/scipy."""

import json
import os

import numpy as np
import pytest

from keras_dpsgd.dp import bandmf as M


def _dense_error(strategy, workload=None):
    n = strategy.steps
    a = np.tril(np.ones((n, n))) if workload is None else workload
    return float(np.sum((a @ np.linalg.inv(strategy.matrix())) ** 2))


@pytest.mark.parametrize("coefficients", [(1.0,), (0.8, 0.5), (0.6, 0.5, 0.4, -0.1)])
def test_error_equals_dense_computation(coefficients):
    strategy = M.BandedToeplitzStrategy(coefficients, 40)
    assert strategy.error() == pytest.approx(_dense_error(strategy), rel=1e-10)
    workload = M.sgd_workload(40, momentum=0.9, learning_rates=np.linspace(1.0, 0.1, 40))
    assert strategy.error(workload) == pytest.approx(_dense_error(strategy, workload), rel=1e-10)


def test_identity_error_is_the_prefix_sum_closed_form():
    n = 100
    assert M.BandedToeplitzStrategy.identity(n).error() == n * (n + 1) / 2


def test_sgd_workload_is_kerass_momentum_rule():
    n, beta, eta = 6, 0.9, np.array([1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    a = M.sgd_workload(n, momentum=beta, learning_rates=eta)
    g = np.random.default_rng(0).normal(size=n)
    m, theta = 0.0, []
    for t in range(n):  # keras.optimizers.SGD: m = β m − η g; θ += m
        m = beta * m - eta[t] * g[t]
        theta.append((theta[-1] if theta else 0.0) + m)
    np.testing.assert_allclose(-a @ g, theta, rtol=1e-12)


@pytest.mark.parametrize("bands", [2, 4, 8])
def test_optimized_strategy_beats_identity_with_unit_columns(bands):
    n = 64
    strategy = M.optimize_banded_toeplitz(n, bands, cache_dir=None)
    assert strategy.bands == bands and strategy.steps == n
    norms = np.linalg.norm(strategy.matrix(), axis=0)
    assert norms.max() <= strategy.column_norm
    assert strategy.column_norm == pytest.approx(1.0, abs=1e-6)
    assert norms.max() == pytest.approx(strategy.column_norm, rel=1e-12)  # the first columns are full
    assert strategy.error() < 0.7 * M.BandedToeplitzStrategy.identity(n).error()
    banded_sqrt = M.BandedToeplitzStrategy.normalized(M._banded_square_root(bands), n)
    assert strategy.error() <= banded_sqrt.error() * (1 + 1e-9)


def test_more_bands_lower_error():
    errors = [M.optimize_banded_toeplitz(128, b, cache_dir=None).error() for b in (1, 2, 4, 8)]
    assert errors == sorted(errors, reverse=True)


def test_one_band_is_the_identity():
    strategy = M.optimize_banded_toeplitz(10, 1, cache_dir=None)
    assert strategy.coefficients == (1.0,) and strategy.column_norm >= 1.0


def test_recursion_is_the_inverse_of_c():
    n, rng = 30, np.random.default_rng(1)
    strategy = M.optimize_banded_toeplitz(n, 5, cache_dir=None)
    z = rng.normal(size=(n, 3))
    history = [np.zeros(3)] * (strategy.bands - 1)
    w = []
    for t in range(n):
        out, history = M.correlated_noise(z[t], history, strategy.coefficients)
        w.append(out)
    np.testing.assert_allclose(np.array(w), np.linalg.solve(strategy.matrix(), z), rtol=1e-10, atol=1e-12)


def test_recursion_with_one_band_returns_the_draw_bit_for_bit():
    z = np.random.default_rng(2).normal(size=7).astype(np.float32)
    w, history = M.correlated_noise(z, [], (1.0,))
    assert history == [] and np.array_equal(w, z) and w.dtype == np.float32


def test_recursion_refuses_a_wrong_history():
    with pytest.raises(ValueError, match="history must hold b - 1 = 2 past draws, got 1"):
        M.correlated_noise(np.zeros(2), [np.zeros(2)], (1.0, 0.5, 0.2))


def test_cache_round_trip_and_tampered_file(tmp_path):
    first = M.optimize_banded_toeplitz(32, 3, cache_dir=tmp_path)
    (path,) = list(tmp_path.iterdir())
    assert M.optimize_banded_toeplitz(32, 3, cache_dir=tmp_path) == first
    path.write_text(json.dumps({"coefficients": [5.0, 4.0, 3.0]}))  # not normalized: renormalized on load
    loaded = M.optimize_banded_toeplitz(32, 3, cache_dir=tmp_path)
    assert np.linalg.norm(loaded.matrix(), axis=0).max() <= loaded.column_norm <= 1.0 + 1e-6
    path.write_text("not json")  # malformed: recomputed and rewritten
    assert M.optimize_banded_toeplitz(32, 3, cache_dir=tmp_path) == first
    assert json.loads(path.read_text())["coefficients"] == list(first.coefficients)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(steps=0, bands=1), "steps must be an integer >= 1, got 0"),
        (dict(steps=10, bands=0), r"bands must be an integer in \[1, 10\], got 0"),
        (dict(steps=10, bands=11), r"bands must be an integer in \[1, 10\], got 11"),
        (dict(steps=10, bands=True), "bands"),
        (dict(steps=4, bands=2, workload=np.ones((3, 3))), r"workload must be a finite \[4, 4\] matrix"),
    ],
)
def test_optimize_validates_arguments(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        M.optimize_banded_toeplitz(cache_dir=None, **kwargs)


@pytest.mark.parametrize(
    "coefficients, message",
    [
        ((), "coefficients must hold at least one number"),
        ((0.0, 1.0), r"coefficients\[0\] \(the diagonal of C\) must be > 0, got 0.0"),
        ((1.0, float("nan")), r"coefficients\[1\]"),
        ("ab", "coefficients must be a sequence of finite numbers"),
    ],
)
def test_strategy_validates_coefficients(coefficients, message):
    with pytest.raises((ValueError, TypeError), match=message):
        M.BandedToeplitzStrategy(coefficients, 5)


def test_sgd_workload_validates_arguments():
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\), got 1"):
        M.sgd_workload(4, momentum=1)
    with pytest.raises(ValueError, match="learning_rates must be 4 finite numbers"):
        M.sgd_workload(4, learning_rates=[1.0, 2.0])

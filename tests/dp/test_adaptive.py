"""The core's adaptive clipping (keras_dpsgd.dp.adaptive), once per array table (numpy, TensorFlow, JAX, torch).

The bound rules and the release of the bound queries (tables: the ``table`` fixture of tests/dp/conftest.py)
against their closed forms, computed one example at a time in float64 (Three Tools Sec. 3, rule "mean": C ← max(α (Σ_i min(‖g_i‖, βC) + σ_q βC z) / L, floor);
Andrew et al. 2021, rule "quantile": C ← max(C exp(-η (b̃ - q)), floor), b̃ = (Σ_i 1[‖g_i‖ <= C] + σ_q z) / L);
the settings' refusals; the initial bounds; and the core's import with TensorFlow, JAX and Keras blocked.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from keras_dpsgd.dp import adaptive as core


def _float32(a: np.ndarray) -> np.ndarray:
    """The step's dtypes: float32 values, bool masks."""
    return a if a.dtype == bool else a.astype(np.float32)


# Per-example norms ‖g_i^g‖ [B=5, G=3]; example 3 is non-finite (its terms must be 0 in every group).
NORMS = np.array([[0.1, 2.0, 0.7], [0.5, 0.01, 3.0], [1.5, 0.4, 0.2], [np.nan, 1.0, 1.0], [0.3, 0.3, 0.05]], np.float64)
FINITE = np.isfinite(NORMS).all(axis=1, keepdims=True)
BOUNDS = np.array([0.4, 0.5, 0.01])
NOISE = np.array([0.3, -1.2, -3.0])  # the queries' standard normal draws
SIGMAS = np.array([1.0, 0.5, 2.0])
L = 4.0


def _settings(rule: str, **kw):
    kw = {"alpha": 1.3, "beta": 2.0, "min_clip_bound": 0.02, "quantile_learning_rate": 0.2, **kw}
    return core.check_settings(3, list(SIGMAS), rule=rule, target_quantile=0.6, **kw)


def _closed_form(settings) -> np.ndarray:
    """The next bounds one example and one group at a time, in float64."""
    out = []
    for g, c in enumerate(BOUNDS):
        total, sensitivity = 0.0, (1.0 if settings.rule == "quantile" else settings.beta * c)
        for i in range(len(NORMS)):
            if not FINITE[i, 0]:
                continue
            n = NORMS[i, g]
            total += (1.0 if n <= c else 0.0) if settings.rule == "quantile" else min(n, settings.beta * c)
        released = (total + SIGMAS[g] * sensitivity * NOISE[g]) / L
        if settings.rule == "quantile":
            new = c * math.exp(-settings.quantile_learning_rate * (released - settings.target_quantile))
        else:
            new = settings.alpha * released
        out.append(max(new, settings.min_clip_bound))
    return np.array(out)


@pytest.mark.parametrize("rule", ["mean", "quantile"])
def test_next_bounds_from_one_lot_match_the_closed_form(table, rule):
    ops, array = table.ops, lambda a: table.array(_float32(np.asarray(a)))
    settings = _settings(rule)
    groups = [0, 1, 2]  # per layer: one variable per group, its squared norm
    terms = core.example_query_terms(settings, array(NORMS**2), array(BOUNDS), array(FINITE), groups, ops)
    terms = np.asarray(terms)
    assert terms.shape == NORMS.shape and np.all(terms[3] == 0.0)  # the non-finite example adds nothing
    new = core.next_bounds_from_sums(
        settings, array(terms.sum(axis=0)), array(BOUNDS), array(SIGMAS), array(NOISE), lambda n: n / L, ops
    )
    expected = _closed_form(settings)
    assert np.any(expected == settings.min_clip_bound)  # the floor is exercised (group 3)
    # float32 arithmetic over a handful of terms: a few ulps of the largest operand.
    np.testing.assert_allclose(np.asarray(new, np.float64), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", ["mean", "quantile"])
def test_flat_query_reads_the_norm_of_the_whole_gradient(table, rule):
    """One group over three variables: each example's norm is √(Σ_v ‖g_i^v‖²), its term min(‖g_i‖, βC) or
    1[‖g_i‖ <= C]; the non-finite example adds nothing."""
    settings = core.check_settings(1, 1.0, 1.3, 2.0, 1e-6, rule=rule)
    bound = 1.2
    terms = core.example_query_terms(
        settings,
        table.array(_float32(NORMS**2)),
        table.array(np.float32([bound])),
        table.array(FINITE),
        [0, 0, 0],
        table.ops,
    )
    norms = np.sqrt((NORMS**2).sum(axis=1))
    expected = (norms <= bound).astype(float) if rule == "quantile" else np.minimum(norms, 2.0 * bound)
    expected = np.where(FINITE[:, 0], expected, 0.0)[:, None]
    np.testing.assert_allclose(np.asarray(table.numpy(terms), np.float64), expected, rtol=1e-6, atol=1e-7)


def test_quantile_rule_moves_the_bound_geometrically_towards_the_quantile(table):
    """b̃ above the target quantile shrinks C by exp(-η (b̃ - q)); below it, grows it; at it, keeps it."""
    settings = _settings("quantile", min_clip_bound=1e-9)
    bounds = table.array(np.float32([1.0, 1.0, 1.0]))
    new = core.next_bounds(settings, bounds, table.array(np.float32([0.9, 0.6, 0.1])), table.ops)
    np.testing.assert_allclose(table.numpy(new), [math.exp(-0.2 * 0.3), 1.0, math.exp(0.2 * 0.5)], rtol=1e-6)


@pytest.mark.parametrize("rule, expected", [("mean", 2.0 * BOUNDS), ("quantile", 1.0)])
def test_query_sensitivity_is_beta_times_the_bound_or_one_for_a_count(rule, expected):
    np.testing.assert_array_equal(core.query_sensitivity(_settings(rule), BOUNDS), expected)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"rule": "median"}, ValueError, "rule"),
        ({"alpha": 0.0}, ValueError, "alpha"),
        ({"beta": -1.0}, ValueError, "beta"),
        ({"min_clip_bound": 0}, ValueError, "min_clip_bound"),
        ({"target_quantile": 1.5}, ValueError, "target_quantile"),
        ({"quantile_learning_rate": 0.0}, ValueError, "quantile_learning_rate"),
        ({"divide_by_bound": 1}, TypeError, "divide_by_bound"),
        ({"norm_noise_multiplier": [1.0, 1.0]}, ValueError, "one entry per clip bound (3)"),
        ({"norm_noise_multiplier": [1.0, -1.0, 1.0]}, ValueError, "norm_noise_multiplier[1]"),
    ],
)
def test_settings_refuse_bad_values_naming_the_argument(kwargs, error, words):
    args = {"norm_noise_multiplier": 1.0, "alpha": 1.0, "beta": 2.0, "min_clip_bound": 1e-6, **kwargs}
    with pytest.raises(error) as info:
        core.check_settings(3, **args)
    assert words in str(info.value)


def test_settings_one_sigma_for_every_group_and_the_public_settings():
    settings = core.check_settings(3, 0.7, 1.0, 2.0, 1e-6)
    assert settings.norm_sigmas == (0.7, 0.7, 0.7) and settings.norm_noise_multiplier == 0.7
    assert "norm_sigmas" not in core.PUBLIC_SETTINGS and "divide_by_bound" in core.PUBLIC_SETTINGS


def test_composed_noise_multiplier_is_the_inverse_root_of_the_summed_precisions():
    got = core.composed_noise_multiplier([1.0, 2.0], [4.0, 4.0])
    assert got == pytest.approx((1 + 1 / 4 + 2 / 16) ** -0.5, rel=1e-12)
    assert core.composed_noise_multiplier([1.0], [0.0]) == 0.0


def test_initial_bounds_are_the_mean_norms_floored():
    sq = np.array([[4.0, 0.0, 1.0], [16.0, 0.0, 9.0]])
    assert core.initial_bounds(sq) == [3.0, core.MIN_BOUND, 2.0]
    assert core.initial_flat_bound(sq) == pytest.approx((math.sqrt(5.0) + 5.0) / 2, rel=1e-12)
    assert core.initial_flat_bound(np.zeros((2, 3))) == core.MIN_BOUND


def test_the_core_imports_without_tensorflow_jax_or_keras():
    code = textwrap.dedent(
        """
        import sys
        for name in ("tensorflow", "jax", "torch", "keras", "tf_keras"):
            sys.modules[name] = None  # an import of any of them raises ImportError
        import keras_dpsgd.dp.adaptive
        import keras_dpsgd.tools.adaptive_clipping
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

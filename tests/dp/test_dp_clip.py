"""The clip factors and the clipped sum's sensitivity (keras_dpsgd.dp.clip), once per array table,
against a one-example-at-a-time NumPy loop."""

import numpy as np
import pytest

from keras_dpsgd.dp import clip


def _loop_factors(sq, bounds, groups, stability=None):
    """The factors by definition, one example and one group at a time (float64)."""
    sq = np.asarray(sq, np.float64)
    out = np.zeros(sq.shape)
    for i in range(sq.shape[0]):
        if not np.all(np.isfinite(sq[i])):
            continue
        for v, g in enumerate(groups):
            norm = np.sqrt(sum(sq[i, u] for u, h in enumerate(groups) if h == g))
            c = bounds[g]
            out[i, v] = c / (norm + stability) if stability is not None else min(1.0, c / norm if norm else 1.0)
    return out


SQ = np.array([[0.25, 9.0, 1.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1e-6, 16.0, 64.0]], np.float32)


@pytest.mark.parametrize(
    "bounds, groups",
    [([1.0], [0, 0, 0]), ([0.5, 2.0, 3.0], [0, 1, 2]), ([1.5, 0.7], [0, 1, 0])],
    ids=["flat", "per-layer", "two-groups"],
)
def test_clip_factors_match_the_loop(table, bounds, groups):
    got = clip.clip_factors(table.ops, table.array(SQ), table.array(np.float32(bounds)), groups)
    np.testing.assert_allclose(table.numpy(got), _loop_factors(SQ, bounds, groups), rtol=1e-6)
    clipped_norms = np.sqrt(np.asarray(table.numpy(got), np.float64) ** 2 * SQ)  # every group within its bound
    for g, c in enumerate(bounds):
        cols = [v for v, h in enumerate(groups) if h == g]
        assert np.all(np.sqrt((clipped_norms[:, cols] ** 2).sum(1)) <= c * (1 + 1e-6))


def test_normalization_factors(table):
    got = clip.clip_factors(table.ops, table.array(SQ), table.array(np.float32([1.0])), [0, 0, 0], stability=0.01)
    np.testing.assert_allclose(table.numpy(got), _loop_factors(SQ, [1.0], [0, 0, 0], 0.01), rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_get_factor_zero_everywhere(table, bad):
    sq = SQ.copy()
    sq[1, 2] = bad
    finite = clip.finite_rows(table.ops, table.array(sq))
    assert table.numpy(finite).tolist() == [[True], [False], [True], [True]]
    got = table.numpy(
        clip.clip_factors(table.ops, table.array(sq), table.array(np.float32([1.0, 2.0, 3.0])), [0, 1, 2])
    )
    assert np.all(got[1] == 0.0) and np.all(got[[0, 2, 3]] > 0)


def test_overflowing_group_gets_factor_zero(table):
    """Finite columns whose sum overflows to inf: factor C/inf = 0, never 1."""
    sq = np.array([[3e38, 3e38]], np.float32)
    got = clip.clip_factors(table.ops, table.array(sq), table.array(np.float32([1.0])), [0, 0])
    assert np.all(table.numpy(got) == 0.0)


def test_sensitivity_is_the_bound_of_each_variables_group(table):
    bounds = table.array(np.float32([0.5, 2.0]))
    got = [float(table.numpy(s)) for s in clip.sensitivity(bounds, [1, 0, 1])]
    assert got == [2.0, 0.5, 2.0]
    assert clip.clip_groups(3, per_layer=False) == [0, 0, 0] and clip.clip_groups(3, per_layer=True) == [0, 1, 2]

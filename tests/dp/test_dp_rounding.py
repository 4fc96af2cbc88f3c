"""The certified rounding margins of per-example norms (``keras_dpsgd.dp.rounding``), on numpy float32.

Oracles: the float64 norm of the float32 rows (exact to far below the margins). The bounds must hold for any
order of summation, so they are checked on float32 arithmetic done here (numpy's order, whatever it is), and
against the margin they claim: an upper bound that is never below the truth and never above it by more than
twice its (a-priori) margin; where nothing cancels, within 1e-5 of it.
"""

import numpy as np
import pytest

from keras_dpsgd.dp import rounding as R


def _rows(rng, batch, t, width, scale, cancel):
    """[B, T, width] float32 rows; `cancel`: the rows of each example sum to ~1e-7·scale."""
    x = rng.normal(size=(batch, t, width)) * scale
    if cancel:
        x[:, -1] = -x[:, :-1].sum(axis=1) + 1e-7 * scale * rng.normal(size=(batch, width))
    return x.astype(np.float32)


def _parts(a, d, aa, dd, terms):
    """gram_upper's computed inputs (float32): Σ terms, Σ |terms|, S, Σ α|ŷ|, Σ β|x̂|."""
    na, nd = np.sqrt(np.sum(a * a, 2)), np.sqrt(np.sum(d * d, 2))
    weighted_a = np.einsum("bt,bts,bs->b", na, np.abs(dd), na)
    weighted_g = np.einsum("bt,bts,bs->b", nd, np.abs(aa), nd)
    return terms.sum((1, 2)), np.abs(terms).sum((1, 2)), np.sum(na * nd, 1), weighted_a, weighted_g


def _gram_bound(a, d):
    """(the float32 Gram upper bound, the float64 truth, the margin in float64) for rows a [B, T, D], d [B, T, U]."""
    aa, dd = a @ a.transpose(0, 2, 1), d @ d.transpose(0, 2, 1)
    terms = aa * dd
    upper = R.gram_upper(*_parts(a, d, aa, dd, terms), widths=(a.shape[2], d.shape[2]), rows=a.shape[1])
    a64, d64 = a.astype(np.float64), d.astype(np.float64)
    truth = np.sum(np.einsum("bti,btj->bij", a64, d64) ** 2, axis=(1, 2))
    s64 = np.sum(np.linalg.norm(a64, axis=2) * np.linalg.norm(d64, axis=2), 1)
    t2 = a.shape[1] ** 2
    margin = R.gamma(a.shape[2] + d.shape[2] + 1) * s64**2 + R.gamma(t2) * np.abs(terms.astype(np.float64)).sum((1, 2))
    return np.asarray(upper, np.float64), truth, margin


@pytest.mark.parametrize("scale", [1.0, 1e3, 2.0**20])
@pytest.mark.parametrize("t", [2, 9])
def test_the_gram_bound_is_above_the_true_norm_where_rows_cancel(scale, t):
    rng = np.random.default_rng(int(scale) % 97 + t)
    a = _rows(rng, 64, t, 16, scale, cancel=True)
    d = np.repeat(_rows(rng, 64, 1, 8, 1.0, cancel=False), t, axis=1)  # equal rows δ_t (a mean over T)
    upper, truth, margin = _gram_bound(a, d)
    assert (truth < 1e-3 * margin).all()  # the rows cancel below float32's rounding: the case is real
    assert (upper >= truth).all()
    assert (upper <= truth + 2.1 * margin).all()


def test_where_nothing_cancels_the_gram_bound_is_the_norm_within_1e_5():
    rng = np.random.default_rng(1)
    upper, truth, _ = _gram_bound(_rows(rng, 32, 4, 16, 1.0, False), _rows(rng, 32, 4, 8, 1.0, False))
    assert (upper >= truth).all() and (upper <= truth * (1 + 1e-5)).all()


def test_the_relative_and_linear_bounds_are_above_the_true_norm():
    """A sum over T = 3 rows that cancel, materialized in float32, then its squares summed (``linear_upper``);
    and a sum of squares the release sums itself (``positive_upper``)."""
    rng = np.random.default_rng(2)
    r = _rows(rng, 64, 3, 32, 2.0**20, cancel=True)
    summed = r.sum(axis=1)  # float32, off by up to γ_3 Σ_t |r_t| per entry
    truth = np.sum(r.astype(np.float64).sum(axis=1) ** 2, axis=1)
    lengths = np.linalg.norm(r, axis=2).sum(axis=1)
    upper = np.asarray(R.linear_upper(np.sum(summed * summed, axis=1), 32, lengths, 3), np.float64)
    assert (upper >= truth).all()
    assert (upper <= (np.sqrt(truth) + 2 * R.gamma(4) * lengths) ** 2 * 1.001 + 1e-30).all()
    squares = np.sum(summed * summed, axis=1)
    exact = np.sum(summed.astype(np.float64) ** 2, axis=1)
    bound = np.asarray(R.positive_upper(squares, 32), np.float64)
    assert (bound >= exact).all() and (bound <= exact * (1 + 4 * R.gamma(32))).all()


def test_gamma_and_relu():
    assert R.gamma(10) == pytest.approx(10 * 2.0**-24, rel=1e-6)
    x = np.array([-2.0, 0.0, 3.0, np.nan], np.float32)
    np.testing.assert_array_equal(R.relu(x)[:3], [0.0, 0.0, 3.0])
    assert np.isnan(R.relu(x)[3])


def _tf32(x):
    """x with its 13 low mantissa bits cleared: TensorFloat-32's input rounding (truncation, the worse case)."""
    return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def test_the_gram_bound_with_tf32_inputs_is_above_the_true_norm():
    """A GPU's TF32 matmuls round their inputs to 10 mantissa bits (u_in = 2⁻¹⁰), then multiply and add in float32:
    the bound with ``u_in`` still holds for the exact norm of the float32 rows."""
    rng = np.random.default_rng(3)
    a = _rows(rng, 64, 4, 16, 1e3, cancel=True)
    d = np.repeat(_rows(rng, 64, 1, 8, 1.0, cancel=False), 4, axis=1)
    at, dt = _tf32(a), _tf32(d)
    aa, dd = at @ at.transpose(0, 2, 1), dt @ dt.transpose(0, 2, 1)
    terms = _tf32(aa) * _tf32(dd)
    upper = R.gram_upper(*_parts(a, d, aa, dd, terms), widths=(16, 8), rows=4, u_in=R.U_TF32)
    a64, d64 = a.astype(np.float64), d.astype(np.float64)
    truth = np.sum(np.einsum("bti,btj->bij", a64, d64) ** 2, axis=(1, 2))
    assert (np.asarray(upper, np.float64) >= truth).all()

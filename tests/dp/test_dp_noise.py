"""The Gaussian sampler of the DP core (keras_dpsgd.dp.noise), once per array table: statistical bounds,
full tails, keys; and the seeded draws of the TensorFlow and JAX tables equal those of 0.2.0's samplers."""

import dataclasses
import math

import numpy as np
import pytest
import scipy.stats

from keras_dpsgd.dp import noise, release

N = 1_000_001  # odd: the last pair is cut


@pytest.fixture(scope="module")
def draws(table):
    return np.asarray(table.numpy(noise.scaled_normal(table.ops, N, table.key(3, 0, 0), 1.0)), np.float64)


def test_moments_and_independence(table, draws):
    assert draws.shape == (N,) and np.all(np.isfinite(draws))
    assert abs(draws.mean()) < 5 / math.sqrt(N)  # 5 standard errors
    assert abs(draws.var() - 1.0) < 5 * math.sqrt(2.0 / N)
    assert scipy.stats.kstest(draws, "norm").pvalue > 1e-4
    half = N // 2  # the cos and sin halves of the pairs, and neighbours
    assert abs(np.corrcoef(draws[:half], draws[half : 2 * half])[0, 1]) < 5 / math.sqrt(half)
    assert abs(np.corrcoef(draws[:-1], draws[1:])[0, 1]) < 5 / math.sqrt(N)
    # The pair's angle is uniform: no quarter or eighth of the circle is favoured (the polynomial's seams).
    counts = np.histogram(np.arctan2(draws[half : 2 * half], draws[:half]), bins=16, range=(-math.pi, math.pi))[0]
    assert scipy.stats.chisquare(counts).pvalue > 1e-3


def test_tail_frequencies(table, draws):
    """P(|Z| > t) within 5 binomial standard deviations, t up to 4.5."""
    for t in (1.0, 2.0, 3.0, 4.0, 4.5):
        p = 2 * scipy.stats.norm.sf(t)
        assert abs(np.sum(np.abs(draws) > t) - N * p) < 5 * math.sqrt(N * p * (1 - p)) + 1, t


def test_only_pairs_with_a_zero_word_are_refined(table):
    """Refinement words (stream 1) are drawn only when some x0 is 0 (probability ~P·2⁻³²), and refine only
    those pairs: their radius passes sqrt(-2 ln 2⁻³²)."""
    calls = []

    def words(key, shape, stream):
        w = table.ops.random_words(key, shape, stream)
        calls.append(stream)
        if stream == 0 and zeros:
            w = table.numpy(w).copy()
            w[0, zeros] = 0
            w = table.array(w)
        return w

    ops = dataclasses.replace(table.ops, random_words=words)
    zeros = []
    table.numpy(noise.scaled_normal(ops, 10, table.key(7, 8, 0), 1.0))
    assert calls == ([0, 1] if table.ops.name == "jax" else [0])  # no x0 of 0: no refinement words (JAX traces both)
    calls[:], zeros[:] = [], [0, 1, 3]
    z = table.numpy(noise.scaled_normal(ops, 10, table.key(7, 8, 0), 1.0))
    assert calls == [0, 1]
    radius = np.hypot(z[:5], z[5:])  # pair i is (z[i], z[5 + i])
    floor = math.sqrt(-2 * math.log(2.0**-32))
    assert np.all(radius[[0, 1, 3]] > floor) and np.all(radius[[2, 4]] < floor)


def test_refined_pairs_reach_past_the_clamped_samplers(table):
    """x0 = 0 (probability 2⁻³²) is refined by two more words: the radius reaches sqrt(2·97·ln 2) ≈ 11.6,
    past the 5.68 where TensorFlow's own sampler stops."""
    words = [table.array(np.array([0, 0, 123], np.uint32)) for _ in range(2)]
    extra = [table.array(np.array([0, 5, 0], np.uint32)) for _ in range(2)]
    z = np.asarray(table.numpy(noise.box_muller(table.ops, *words, *extra)), np.float64)
    assert z.shape == (2, 3)
    np.testing.assert_allclose(z[0, 0], math.sqrt(-2 * math.log(0.5 * 2.0**-96)), rtol=1e-6)  # θ = 0: r cos 0
    assert abs(z[1, 0]) < 1e-6 and z[0, 0] > 11.5
    coarse = np.asarray(table.numpy(noise.box_muller(table.ops, *words)), np.float64)
    np.testing.assert_allclose(coarse[0, 0], math.sqrt(-2 * math.log(0.5 * 2.0**-32)), rtol=1e-6)


def test_tables_give_the_same_pairs_for_the_same_words(table):
    """Box–Muller from full words, refined where x0 = 0: every table's values agree with float64 math to a few 1e-6
    of the radius (float32 log and sqrt; cos/sin of the float32 angle, or the polynomials); axes at the quarter turns."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=(4, 4096), dtype=np.uint64).astype(np.uint32)
    words[0, :3] = 0  # the refined pairs
    words[2, :3] = [0, 1, 2**31]
    words[1, 3:9] = [0, 2**30, 2**31, 3 * 2**30, 2**32 - 1, 2**29]  # the quarter turns, the last word, π/4
    got = np.asarray(table.numpy(noise.box_muller(table.ops, *[table.array(w) for w in words])), np.float64)
    w = words.astype(np.float64)
    u1 = np.where(w[0] == 0, (w[2] + (w[3] + 0.5) * 2.0**-32) * 2.0**-64, (w[0] + 0.5) * 2.0**-32)
    radius = np.sqrt(-2 * np.log(u1))
    angle = np.float32(words[1].astype(np.float32)).astype(np.float64) * (2 * math.pi * 2.0**-32)
    want = np.stack([radius * np.cos(angle), radius * np.sin(angle)])
    # float32 log, sqrt and angle: a few ulp of r; and u1 near 1 (x0 rounded to float32's 24 bits): ~1e-7/r.
    assert np.all(np.abs(got - want) < 4e-6 * radius + 3e-7 / radius)
    assert np.abs(got).max() > 5.7  # TF's own clamped sampler never goes past 5.68
    r = np.hypot(got[0], got[1])[3:8]
    np.testing.assert_allclose(got[:, 3:8], [[r[0], 0, -r[2], 0, r[4]], [0, r[1], 0, -r[3], 0]], atol=1e-6)


def test_keys_separate_seeds_positions_and_tensors(table):
    def first(seed, position, index):
        return table.numpy(noise.scaled_normal(table.ops, 8, table.key(seed, position, index), 1.0))

    base = first(3, 0, 0)
    np.testing.assert_array_equal(base, first(3, 0, 0))  # a function of the key
    for other in (first(4, 0, 0), first(3, 1, 0), first(3, 0, 1)):
        assert not np.any(other == base)


def test_add_gaussian_scales_and_keeps_shape(table):
    x = table.array(np.full((300, 7), 2.0, np.float32))
    key = table.key(5, 0, 0)
    y = np.asarray(table.numpy(release.add_gaussian(table.ops, x, 0.5, key)), np.float64)
    z = np.asarray(table.numpy(noise.scaled_normal(table.ops, 2100, key, 1.0)), np.float64).reshape(300, 7)
    assert y.shape == (300, 7)
    np.testing.assert_allclose(y, 2.0 + 0.5 * z, rtol=1e-5, atol=1e-5)
    empty = table.array(np.zeros((0, 3), np.float32))
    assert release.add_gaussian(table.ops, empty, 1.0, key) is empty


def test_odd_sizes(table):
    z = table.numpy(noise.scaled_normal(table.ops, 7, table.key(1, 2, 3), 1.0))
    assert z.shape == (7,) and np.all(np.isfinite(z))


def test_quarter_turn_circle_matches_cos_and_sin():
    """The polynomial circle (JAX's) of θ = 2π·w·2⁻³²: cos θ and sin θ to ~1e-7, exact at the quarter turns;
    on float32 numpy arrays, where only the arithmetic is float32."""
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    quarters = np.array([0, 2**30, 2**31, 3 * 2**30, 2**32 - 1], np.uint32)
    w = np.concatenate([words, quarters]).astype(np.float32)
    angle = w.astype(np.float64) * (2 * math.pi * 2.0**-32)  # the float32 word's exact angle
    cos, sin = noise.circle_by_quarter_turns(np.round, np.floor, np.where)(w)
    assert cos.dtype == sin.dtype == np.float32
    assert np.abs(cos - np.cos(angle)).max() < 2e-7 and np.abs(sin - np.sin(angle)).max() < 2e-7
    np.testing.assert_array_equal(cos[-5:], [1, 0, -1, 0, 1])
    np.testing.assert_array_equal(sin[-5:], [0, 1, 0, -1, 0])


# The first 9 draws of 0.2.0's samplers (keras_dpsgd/step/_noise.py on TensorFlow, keras_dpsgd/backends/jax/
# _noise.py on JAX) under the seeded key of (seed 7, ledger position 11, tensor 2), as float32 bits. The core's
# draws under the same key are these, bit for bit where the library's log/sqrt/cos round as on the machine that
# recorded them (checked there against the old modules); elsewhere within a few ulp (libm rounding).
SEEDED_0_2_0 = {
    "tensorflow": [
        0x3FEBD191,
        0xBF29D905,
        0xC0058B45,
        0x3E9D0F70,
        0x3F15D47E,
        0xBE9ADA72,
        0x3E85348E,
        0x3FAE7D3B,
        0xBE51B727,
    ],
    "jax": [0x3F334F21, 0x3F277764, 0xBF00B2BD, 0x3D48A4E8, 0x3FAD0BD4, 0xBE74990C, 0xBF093A4F, 0xBF8F6E9E, 0x3FE01E44],
}


def test_seeded_draws_are_those_of_0_2_0(table):
    if table.ops.name not in SEEDED_0_2_0:
        pytest.skip(f"the {table.ops.name} table has no draws of 0.2.0 to keep (a test reference, or a backend since)")
    got = np.asarray(table.numpy(noise.scaled_normal(table.ops, 9, table.key(7, 11, 2), 1.0)), np.float32)
    want = np.array(SEEDED_0_2_0[table.ops.name], np.uint32).view(np.float32)
    np.testing.assert_array_max_ulp(got, want, maxulp=4)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("zero_in", [None, 0, 3])
def test_a_release_is_one_draw_cut_in_order(table, zero_in, shared):
    """``release.add_gaussians``: the tensors' noise is one draw of P = Σ_k ⌈n_k/2⌉ Box–Muller pairs under the key,
    tensor k's pairs after those of the tensors before it (rows 0 then 1 of its pairs, cut to n_k), times its stddev
    (one stddev object for all, or one each); with a pair refined (an x0 of 0 in tensor `zero_in`'s part) that pair
    takes the refinement words at its place in the release and reaches past the coarse sampler's largest radius."""
    shapes = [(2, 2), (5,), (0,), (4, 3)]  # sizes 4, 5 (odd: a pair cut), 0 (nothing drawn), 12: 2, 3, 0, 6 pairs
    pairs = [(int(np.prod(s)) + 1) // 2 for s in shapes]
    starts = np.cumsum([0] + pairs)
    total = int(starts[-1])

    def words(key, shape, stream):
        w = table.ops.random_words(key, shape, stream)
        if stream == 0 and zero_in is not None:
            w = table.numpy(w).copy()
            w[0, starts[zero_in] + 1] = 0
            w = table.array(w)
        return w

    ops = dataclasses.replace(table.ops, random_words=words)
    xs = [table.array(np.full(s, 0.5, np.float32)) for s in shapes]
    one = table.array(np.float32(1.5))
    stddevs = [one] * 4 if shared else [table.array(np.float32(s)) for s in (1.0, 2.5, 1.0, 0.25)]
    key = table.key(5, 9, 0)
    together = release.add_gaussians(ops, xs, stddevs, key)
    w, fine = (table.numpy(words(key, (2, total), stream)) for stream in (0, 1))
    z = table.numpy(noise.box_muller(table.ops, *(table.array(r) for r in (w[0], w[1], fine[0], fine[1]))))
    for k, (got, shape) in enumerate(zip(together, shapes)):
        assert tuple(got.shape) == shape
        want = z[:, starts[k] : starts[k + 1]].ravel()[: int(np.prod(shape))] * float(table.numpy(stddevs[k])) + 0.5
        np.testing.assert_allclose(table.numpy(got).ravel(), want, rtol=1e-5, atol=1e-6)
    if zero_in is not None:  # the refined pair's radius passes sqrt(-2 ln 2⁻³²) in units of its stddev
        got = (table.numpy(together[zero_in]).ravel() - 0.5) / float(table.numpy(stddevs[zero_in]))
        p = pairs[zero_in]
        assert math.hypot(got[1], got[p + 1]) > math.sqrt(-2 * math.log(2.0**-32))

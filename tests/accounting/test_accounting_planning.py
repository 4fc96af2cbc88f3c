"""Planning: σ calibration never below the exact value, steps within a budget, the lot-size table."""

import math

import pytest

from keras_dpsgd.accounting import (
    GaussianEvent,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    batch_table,
    calibrate_noise_multiplier,
    check_delta,
    compute_epsilon,
    compute_noise_multiplier,
    default_delta,
    effective_noise_multiplier,
    max_steps_within_budget,
    steps_for_epochs,
)

CASES = [(1.0, 1e-5, 0.01, 1000), (0.5, 1e-6, 0.004, 5000), (8.0, 1e-5, 0.1, 100), (3.0, 1e-5, 1.0, 10)]


@pytest.mark.parametrize("target,delta,q,steps", CASES)
@pytest.mark.parametrize("accountant", ["rdp", "moments"])
def test_noise_multiplier_is_never_below_the_exact_value(target, delta, q, steps, accountant):
    sigma = compute_noise_multiplier(
        target_epsilon=target, target_delta=delta, sampling_rate=q, steps=steps, accountant=accountant
    )

    def eps(s):
        return compute_epsilon(PoissonSampledGaussianEvent(q, s, steps), delta, accountant=accountant)

    assert eps(sigma) <= target
    # The exact root lies in [σ(1 - 1e-7), σ]: a hair less noise breaks the budget.
    assert eps(sigma * (1 - 1e-7)) > target


def test_noise_multiplier_is_monotone():
    kw = dict(target_delta=1e-5, sampling_rate=0.01)
    by_eps = [compute_noise_multiplier(target_epsilon=e, steps=1000, **kw) for e in (0.5, 1.0, 2.0, 4.0)]
    assert all(a > b for a, b in zip(by_eps, by_eps[1:]))
    by_steps = [compute_noise_multiplier(target_epsilon=1.0, steps=k, **kw) for k in (10, 100, 1000, 10000)]
    assert all(a < b for a, b in zip(by_steps, by_steps[1:]))


def test_prior_events_need_more_noise_and_stay_within_budget():
    prior = PrivacyLedger([GaussianEvent(10.0, label="dp-pca")])
    kw = dict(target_epsilon=1.0, target_delta=1e-5, sampling_rate=0.01, steps=1000)
    plain = compute_noise_multiplier(**kw)
    with_prior = compute_noise_multiplier(prior_events=prior, **kw)
    assert with_prior > plain
    events = list(prior) + [PoissonSampledGaussianEvent(0.01, with_prior, 1000)]
    assert compute_epsilon(events, 1e-5) <= 1.0
    with pytest.raises(ValueError, match="unreachable"):
        compute_noise_multiplier(prior_events=GaussianEvent(0.1), **kw)


def test_generic_calibration_matches_and_handles_composed_events():
    kw = dict(target_epsilon=2.0, target_delta=1e-5)
    direct = compute_noise_multiplier(sampling_rate=0.02, steps=500, **kw)
    generic = calibrate_noise_multiplier(lambda s: PoissonSampledGaussianEvent(0.02, s, 500), **kw)
    assert generic == pytest.approx(direct, rel=2e-7)

    # Adaptive clipping style: the gradient at σ and a norm query at 10σ per step.
    def make(s):
        return [PoissonSampledGaussianEvent(0.02, s, 500), PoissonSampledGaussianEvent(0.02, 10 * s, 500)]

    sigma = calibrate_noise_multiplier(make, **kw)
    assert sigma > direct
    assert compute_epsilon(make(sigma), 1e-5) <= 2.0 < compute_epsilon(make(sigma * (1 - 1e-7)), 1e-5)


@pytest.fixture
def coarse_pld(monkeypatch):
    """PLD with a 1e-3 grid (still a pessimistic upper bound) so the PLD tests stay fast."""
    from keras_dpsgd.accounting import PldAccountant

    monkeypatch.setattr(PldAccountant.__init__, "__defaults__", (1e-3,))


def test_pld_calibration_is_within_budget(coarse_pld):
    kw = dict(target_epsilon=1.5, target_delta=1e-5, sampling_rate=0.2, steps=20)
    sigma = compute_noise_multiplier(accountant="pld", **kw)

    def eps(s):
        return compute_epsilon(PoissonSampledGaussianEvent(0.2, s, 20), 1e-5, accountant="pld")

    assert eps(sigma) <= 1.5 < eps(sigma * (1 - 2e-4))
    assert sigma <= compute_noise_multiplier(**kw)  # PLD is tighter than RDP


@pytest.mark.parametrize(
    "target,q,sigma,prior",
    [
        (1.0, 0.01, 1.1, ()),
        (3.0, 0.004, 1.1, ()),
        (2.0, 0.02, 0.9, (GaussianEvent(20.0),)),
        (1.0, 0.01, 1.1, (PoissonSampledGaussianEvent(0.01, 1.1, 3000),)),
        (0.5, 1.0, 5.0, ()),
    ],
)
@pytest.mark.parametrize("accountant", ["rdp", "moments"])
def test_max_steps_is_exact(target, q, sigma, prior, accountant):
    k = max_steps_within_budget(
        target_epsilon=target,
        target_delta=1e-5,
        sampling_rate=q,
        noise_multiplier=sigma,
        prior_events=prior,
        accountant=accountant,
    )

    def eps(n):
        return compute_epsilon(list(prior) + [PoissonSampledGaussianEvent(q, sigma, n)], 1e-5, accountant=accountant)

    assert eps(k + 1) > target
    if k > 0:
        assert eps(k) <= target


def test_max_steps_edge_cases(coarse_pld):
    kw = dict(target_delta=1e-5, sampling_rate=0.01)
    # Already over budget, not even one step fits, or no noise at all.
    assert max_steps_within_budget(target_epsilon=1.0, noise_multiplier=1.0, prior_events=GaussianEvent(0.2), **kw) == 0
    assert max_steps_within_budget(target_epsilon=0.01, noise_multiplier=0.5, **kw) == 0
    assert max_steps_within_budget(target_epsilon=10.0, noise_multiplier=0.0, **kw) == 0
    k = max_steps_within_budget(target_epsilon=1.0, noise_multiplier=2.0, accountant="pld", **kw)
    k_rdp = max_steps_within_budget(target_epsilon=1.0, noise_multiplier=2.0, **kw)
    assert k >= k_rdp
    pld = lambda n: compute_epsilon(PoissonSampledGaussianEvent(0.01, 2.0, n), 1e-5, accountant="pld")  # noqa: E731
    assert pld(k) <= 1.0 < pld(k + 1)


def test_batch_table_values_equal_the_accountants():
    rows = batch_table(num_examples=10000, epochs=5, target_epsilon=2.0, target_delta=1e-5, lot_sizes=[32, 100, 1000])
    assert [r["lot_size"] for r in rows] == [32, 100, 1000]
    for r in rows:
        lot = r["lot_size"]
        assert r["sampling_rate"] == lot / 10000
        assert r["steps"] == 5 * math.ceil(10000 / lot)
        assert r["noise_multiplier"] == compute_noise_multiplier(
            target_epsilon=2.0, target_delta=1e-5, sampling_rate=lot / 10000, steps=r["steps"]
        )
        assert r["noise_per_example"] == r["noise_multiplier"] / lot
    # Larger lots need more σ but less noise per example.
    assert rows[0]["noise_multiplier"] < rows[2]["noise_multiplier"]
    assert rows[0]["noise_per_example"] > rows[2]["noise_per_example"]


def test_steps_for_epochs_is_epochs_of_whole_lots():
    """E epochs of ceil(N/L) lots (the lots fit runs per epoch), exact for decimal E."""
    assert steps_for_epochs(60000, 256, 60) == 60 * 235 == 14100  # not TF Privacy's ceil(E·N/B) = 14063
    assert steps_for_epochs(60000, 150, 15) == 6000
    assert steps_for_epochs(1347, 128, 5) == 5 * 11 == 55  # issue 37.3: 53 planned, 55 trained before
    assert steps_for_epochs(100, 30, 0.25) == 1  # 0.25 * 4 lots
    assert steps_for_epochs(100, 10, 0.3) == 3  # 0.3 * 10 is 3.0000000000000004 in floats
    assert steps_for_epochs(100, 30, 1) == 4


def test_delta_helpers():
    assert default_delta(60000) == 1 / 600000
    assert default_delta(455) == 1 / 4550  # 1/N^1.1 gave δ·N = 0.54 here (issue 40.9)
    assert default_delta(10**11) == 1 / (10**11) ** 1.1
    for n in (1, 2, 455, 60000, 10**7, 10**12):
        assert default_delta(n) * n <= 0.1 and default_delta(n) <= n**-1.1
    assert check_delta(1e-5, 60000) == 1e-5
    with pytest.raises(ValueError, match=r"delta must be < 1/num_examples"):
        check_delta(1e-3, 60000)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        check_delta(0.0, 60000)


def test_effective_noise_multiplier():
    assert effective_noise_multiplier([2.0]) == 2.0
    assert effective_noise_multiplier([2.0, 2.0]) == pytest.approx(2.0 / math.sqrt(2))
    assert effective_noise_multiplier([1.0, 2.0, 0.0]) == 0.0
    # Two Gaussian releases at σ1, σ2 have the RDP of one at σ_eff (α/2σ1² + α/2σ2² = α/2σ_eff²).
    s = effective_noise_multiplier([1.5, 3.0])
    assert compute_epsilon(GaussianEvent(s), 1e-5) == pytest.approx(
        compute_epsilon([GaussianEvent(1.5), GaussianEvent(3.0)], 1e-5), rel=1e-12
    )
    with pytest.raises(ValueError, match="non-empty"):
        effective_noise_multiplier([])
    with pytest.raises(ValueError, match=r"noise_multipliers\[1\] must be a finite number >= 0, got -1.0"):
        effective_noise_multiplier([1.0, -1.0])


NAN = float("nan")
BASE = dict(target_epsilon=1.0, target_delta=1e-5, sampling_rate=0.01, steps=100)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"target_epsilon": 0.0}, r"target_epsilon must be a finite number > 0, got 0.0"),
        ({"target_epsilon": -1.0}, r"target_epsilon must be a finite number > 0"),
        ({"target_epsilon": NAN}, r"target_epsilon must be a finite number > 0, got nan"),
        ({"target_delta": 1.0}, r"target_delta must be in \(0, 1\), got 1.0"),
        ({"target_delta": NAN}, r"target_delta must be in \(0, 1\)"),
        ({"sampling_rate": 0.0}, r"sampling_rate must be in \(0, 1\], got 0.0"),
        ({"sampling_rate": 1.5}, r"sampling_rate must be in \(0, 1\]"),
        ({"steps": 0}, r"steps must be an integer >= 1, got 0"),
        ({"steps": 2.5}, r"steps must be an integer >= 1"),
        ({"accountant": "foo"}, r"accountant must be one of"),
    ],
)
def test_compute_noise_multiplier_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        compute_noise_multiplier(**{**BASE, **overrides})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_examples=0, epochs=1, lot_sizes=[1]), r"num_examples must be an integer >= 1, got 0"),
        (dict(num_examples=100, epochs=1, lot_sizes=[200]), r"batch_size must be <= num_examples \(100\), got 200"),
        (dict(num_examples=100, epochs=0, lot_sizes=[10]), r"epochs must be a finite number > 0"),
        (dict(num_examples=100, epochs=1, lot_sizes=[]), r"lot_sizes must be a non-empty"),
        (dict(num_examples=100, epochs=1, lot_sizes=[0]), r"lot_size must be an integer >= 1, got 0"),
    ],
)
def test_batch_table_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        batch_table(target_epsilon=1.0, target_delta=1e-5, **kwargs)


def test_max_steps_validation():
    with pytest.raises(ValueError, match=r"noise_multiplier must be a finite number >= 0, got -1"):
        max_steps_within_budget(target_epsilon=1.0, target_delta=1e-5, sampling_rate=0.1, noise_multiplier=-1)


@pytest.mark.parametrize("n,b,target", [(60000, 256, 3.0), (1000, 30, 2.0), (999, 333, 5.0)])
def test_max_epochs_within_budget(n, b, target):
    from keras_dpsgd.accounting import max_epochs_within_budget

    epochs = max_epochs_within_budget(
        num_examples=n, batch_size=b, target_epsilon=target, target_delta=1e-5, noise_multiplier=1.1
    )
    k = max_steps_within_budget(target_epsilon=target, target_delta=1e-5, sampling_rate=b / n, noise_multiplier=1.1)
    assert epochs > 0 and steps_for_epochs(n, b, epochs) == k
    assert epochs == pytest.approx(k / math.ceil(n / b), rel=1e-12)


@pytest.mark.parametrize("accountant", ["rdp", "moments"])
def test_compute_epsilon_takes_the_keywords_of_compute_noise_multiplier(accountant):
    prior = PoissonSampledGaussianEvent(0.02, 1.5, 50)
    kw = dict(target_delta=1e-5, sampling_rate=0.01, steps=1000, accountant=accountant, prior_events=prior)
    sigma = compute_noise_multiplier(target_epsilon=1.0, **kw)
    eps = compute_epsilon(noise_multiplier=sigma, **kw)
    assert 1.0 - 1e-4 < eps <= 1.0
    events = [prior, PoissonSampledGaussianEvent(0.01, sigma, 1000)]
    assert eps == compute_epsilon(events, 1e-5, accountant=accountant)


def test_compute_epsilon_old_keyword_is_a_deprecated_alias():
    event = PoissonSampledGaussianEvent(0.01, 1.1, 100)
    with pytest.warns(DeprecationWarning, match="target_delta"):
        old = compute_epsilon(event, delta=1e-5)
    assert old == compute_epsilon(event, target_delta=1e-5) == compute_epsilon(events=event, target_delta=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(target_delta=1e-5), "missing"),
        (dict(target_delta=1e-5, noise_multiplier=1.0, sampling_rate=0.1), r"missing \['steps'\]"),
        (dict(events=PoissonSampledGaussianEvent(0.1, 1.0, 1), target_delta=1e-5, steps=3), "not both"),
        (dict(noise_multiplier=1.0, sampling_rate=0.1, steps=3), "target_delta"),
        (dict(target_delta=1e-5, delta=1e-5, noise_multiplier=1.0, sampling_rate=0.1, steps=3), "both"),
        (dict(target_delta=1e-5, noise_multiplier=1.0, sampling_rate=1.5, steps=3), "sampling_rate"),
    ],
)
def test_compute_epsilon_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_epsilon(**kwargs)

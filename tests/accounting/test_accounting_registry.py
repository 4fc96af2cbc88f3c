"""Accountants are a registry: a new one is one class plus one registration line, and calibrates at once."""

import pytest

from keras_dpsgd import accounting as acc
from keras_dpsgd.accounting import accountants as A

_PLAN = dict(target_epsilon=1.0, target_delta=1e-5, sampling_rate=0.01)


class _TwiceRdp(acc.PrivacyAccountant):
    """A toy accountant: every step is charged twice to an RDP accountant (as if each ran two times)."""

    def __init__(self):
        self._rdp = acc.RdpAccountant()

    def _compose_leaf(self, sampling_rate, noise_multiplier, count):
        self._rdp.compose(acc.PoissonSampledGaussianEvent(sampling_rate, noise_multiplier, 2 * count))

    def get_epsilon_and_order(self, delta):
        return self._rdp.get_epsilon_and_order(delta)


@pytest.fixture
def twice():
    acc.register_accountant("twice")(_TwiceRdp)  # the one registration line
    yield "twice"
    del A._REGISTRY["twice"]


def test_a_registered_accountant_is_known_by_name_and_calibrates(twice):
    assert twice in acc.accountant_names() and isinstance(acc.make_accountant(twice), _TwiceRdp)
    event = acc.PoissonSampledGaussianEvent(0.01, 1.1, 100)
    assert acc.compute_epsilon(event, 1e-5, accountant=twice) == acc.compute_epsilon(
        acc.PoissonSampledGaussianEvent(0.01, 1.1, 200), 1e-5
    )
    # σ for 50 doubled steps is σ for 100 RDP steps; the step budget is half the RDP one.
    assert acc.compute_noise_multiplier(**_PLAN, steps=50, accountant=twice) == acc.compute_noise_multiplier(
        **_PLAN, steps=100
    )
    k_rdp = acc.max_steps_within_budget(**_PLAN, noise_multiplier=1.0)
    assert acc.max_steps_within_budget(**_PLAN, noise_multiplier=1.0, accountant=twice) == k_rdp // 2
    rows = acc.batch_table(
        num_examples=1000, epochs=1.0, target_epsilon=2.0, target_delta=1e-5, lot_sizes=[10], accountant=twice
    )
    assert rows[0]["noise_multiplier"] == acc.compute_noise_multiplier(
        target_epsilon=2.0, target_delta=1e-5, sampling_rate=0.01, steps=rows[0]["steps"], accountant=twice
    )


def test_the_cli_offers_registered_accountants(twice, capsys):
    import json

    from keras_dpsgd.cli import main

    assert (
        main(
            [
                "epsilon",
                "--num-examples",
                "1000",
                "--lot-size",
                "10",
                "--epochs",
                "1",
                "--noise-multiplier",
                "1.1",
                "--accountant",
                twice,
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["accountant"] == twice
    assert out["epsilon"] == acc.compute_epsilon(
        acc.PoissonSampledGaussianEvent(0.01, 1.1, 100), out["delta"], accountant=twice
    )


def test_registration_refuses_duplicates_and_non_accountants(twice):
    with pytest.raises(ValueError, match="already registered"):
        acc.register_accountant("rdp")
    with pytest.raises(TypeError, match="PrivacyAccountant subclasses"):
        acc.register_accountant("other")(dict)
    with pytest.raises(ValueError, match=r"accountant must be one of \('rdp', 'moments', 'pld', 'twice'\)"):
        acc.make_accountant("nope")


def test_make_accountant_accepts_an_accountant_object_and_leaves_it_unchanged():
    custom = acc.RdpAccountant(orders=[2.0, 4.0, 8.0], conversion="classic")
    event = acc.PoissonSampledGaussianEvent(0.01, 1.0, 100)
    copied = acc.make_accountant(custom)
    assert copied is not custom and copied.orders.tolist() == [2.0, 4.0, 8.0] and copied.conversion == "classic"
    eps = acc.compute_epsilon(event, 1e-5, accountant=custom)
    assert eps == acc.RdpAccountant(orders=[2.0, 4.0, 8.0], conversion="classic").compose(event).get_epsilon(1e-5)
    assert not custom.rdp.any()  # the caller's object composed nothing
    # What an object already holds is counted (never dropped): calibration spends the rest.
    prior = acc.PoissonSampledGaussianEvent(0.01, 3.0, 10)
    spent = acc.RdpAccountant().compose(prior)
    assert acc.compute_noise_multiplier(**_PLAN, steps=100, accountant=spent) == acc.compute_noise_multiplier(
        **_PLAN, steps=100, prior_events=prior
    )
    assert acc.max_steps_within_budget(**_PLAN, noise_multiplier=3.0, accountant=spent) == (
        acc.max_steps_within_budget(**_PLAN, noise_multiplier=3.0) - 10
    )


def test_get_delta_is_the_inverse_of_get_epsilon():
    accountant = acc.RdpAccountant().compose(acc.PoissonSampledGaussianEvent(0.01, 1.1, 1000))
    eps = accountant.get_epsilon(1e-5)
    assert accountant.get_delta(eps) == pytest.approx(1e-5, rel=1e-6)
    assert accountant.get_delta(eps * 1.1) < 1e-5 < accountant.get_delta(eps * 0.9)
    assert acc.RdpAccountant().get_delta(0.5) == 0.0

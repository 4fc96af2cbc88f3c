"""One contract for every accountant; PLD against dp_accounting; the package imports without TensorFlow."""

import math
import subprocess
import sys
import textwrap

import pytest
from scipy import special

from keras_dpsgd.accounting import (
    ComposedEvent,
    GaussianEvent,
    MomentsAccountant,
    PldAccountant,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    RdpAccountant,
    compute_epsilon,
    compute_epsilon_and_order,
)

dp_accounting = pytest.importorskip("dp_accounting")

FACTORIES = {
    "rdp": RdpAccountant,
    "rdp-classic": lambda: RdpAccountant(conversion="classic"),
    "moments": MomentsAccountant,
    "pld": lambda: PldAccountant(value_discretization_interval=1e-3),  # coarser: fast, still an upper bound
}


def _gaussian_exact_delta(sigma, eps):
    """Exact δ(ε) of the Gaussian mechanism with sensitivity 1 (Balle & Wang 2018, Thm 8)."""
    return special.ndtr(-eps * sigma + 1 / (2 * sigma)) - math.exp(eps) * special.ndtr(-eps * sigma - 1 / (2 * sigma))


@pytest.mark.parametrize("name", list(FACTORIES))
class TestAccountantContract:
    def test_nothing_composed_is_zero(self, name):
        acc = FACTORIES[name]()
        assert acc.get_epsilon(1e-5) == 0.0
        assert acc.compose(PoissonSampledGaussianEvent(0.1, 1.0, count=0)) is acc
        assert acc.get_epsilon(1e-5) == 0.0
        assert acc.compose(PoissonSampledGaussianEvent(0.1, 1.0), count=0).get_epsilon(1e-5) == 0.0

    def test_zero_noise_is_infinite(self, name):
        acc = FACTORIES[name]().compose(PoissonSampledGaussianEvent(0.01, 0.0, count=3))
        assert acc.get_epsilon(1e-5) == math.inf
        assert acc.get_epsilon_and_order(1e-5) == (math.inf, None)

    def test_composition_forms_agree(self, name):
        a, b = PoissonSampledGaussianEvent(0.02, 1.2, 300), GaussianEvent(8.0, 2)
        one = FACTORIES[name]().compose(a).compose(b).get_epsilon(1e-5)
        composed = FACTORIES[name]().compose(ComposedEvent((a, ComposedEvent((b,))))).get_epsilon(1e-5)
        ledger = FACTORIES[name]().compose(PrivacyLedger([a, b])).get_epsilon(1e-5)
        assert composed == pytest.approx(one, rel=1e-9)
        assert ledger == pytest.approx(one, rel=1e-9)
        split = FACTORIES[name]().compose(PoissonSampledGaussianEvent(0.02, 1.2, 100), count=3).compose(b)
        assert split.get_epsilon(1e-5) == pytest.approx(one, rel=1e-3)

    def test_monotone_in_steps_and_delta(self, name):
        eps = [
            FACTORIES[name]().compose(PoissonSampledGaussianEvent(0.01, 1.1, k)).get_epsilon(1e-5)
            for k in (10, 100, 1000)
        ]
        assert eps[0] < eps[1] < eps[2]
        acc = FACTORIES[name]().compose(PoissonSampledGaussianEvent(0.01, 1.1, 100))
        assert acc.get_epsilon(1e-3) < acc.get_epsilon(1e-5) < acc.get_epsilon(1e-8)

    @pytest.mark.parametrize("sigma,count", [(1.0, 1), (3.0, 20)])
    def test_valid_for_the_gaussian_mechanism(self, name, sigma, count):
        eps = FACTORIES[name]().compose(GaussianEvent(sigma, count)).get_epsilon(1e-5)
        assert _gaussian_exact_delta(sigma / math.sqrt(count), eps) <= 1e-5 * (1 + 1e-9)

    @pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, float("nan")])
    def test_bad_delta(self, name, delta):
        with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
            FACTORIES[name]().compose(GaussianEvent(1.0)).get_epsilon(delta)


def test_compose_rejects_non_events():
    with pytest.raises(TypeError):
        RdpAccountant().compose("not an event")
    with pytest.raises(ValueError, match="count must be an integer >= 0"):
        RdpAccountant().compose(GaussianEvent(1.0), count=-1)


def _oracle_pld_epsilon(q, sigma, steps, delta):
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_accounting.GaussianDpEvent(sigma)
    if q < 1:
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    acc.compose(event, steps)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("q,sigma,steps,delta", [(0.0025, 1.3, 6000, 1e-5), (0.1, 2.0, 50, 1e-6), (1.0, 4.0, 10, 1e-3)])
def test_pld_matches_dp_accounting_and_is_below_rdp(q, sigma, steps, delta):
    event = PoissonSampledGaussianEvent(q, sigma, steps)
    eps, order = compute_epsilon_and_order(event, delta, accountant="pld")
    assert order is None
    assert eps == pytest.approx(_oracle_pld_epsilon(q, sigma, steps, delta), rel=1e-9)
    assert eps <= compute_epsilon(event, delta)


def test_pld_without_dp_accounting_names_the_extra(monkeypatch):
    for mod in ["dp_accounting", "dp_accounting.pld"]:
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(ImportError, match=r"pip install keras-dpsgd\[pld\]"):
        PldAccountant()
    with pytest.raises(ImportError, match=r"keras-dpsgd\[pld\]"):
        compute_epsilon(GaussianEvent(1.0), 1e-5, accountant="pld")


def test_unknown_accountant():
    with pytest.raises(ValueError, match="accountant must be one of"):
        compute_epsilon(GaussianEvent(1.0), 1e-5, accountant="opacus")


def test_accounting_imports_without_tensorflow():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["tensorflow"] = None  # makes `import tensorflow` raise ImportError
        sys.modules["tf_keras"] = None
        import keras_dpsgd.accounting as acc
        import keras_dpsgd
        eps = keras_dpsgd.compute_epsilon(acc.PoissonSampledGaussianEvent(0.01, 1.1, 100), 1e-5)
        assert 0 < eps < 10, eps
        print("ok", eps)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_public_names_resolve():
    import keras_dpsgd
    import keras_dpsgd.accounting as accounting

    for name in accounting.__all__:
        assert getattr(accounting, name) is not None
    for name in [
        "RdpAccountant",
        "MomentsAccountant",
        "PldAccountant",
        "compute_epsilon",
        "compute_epsilon_and_order",
        "compute_noise_multiplier",
        "calibrate_noise_multiplier",
        "max_steps_within_budget",
        "batch_table",
        "default_delta",
        "check_delta",
        "effective_noise_multiplier",
    ]:
        assert getattr(keras_dpsgd, name) is getattr(accounting, name)

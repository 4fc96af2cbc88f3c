"""BandMFEvent: ε equals dp_accounting's DP-SGD with the reduced parameters (Choquette-Choo et al. 2023, Thm 4: the
event JAX Privacy's ``accounting.amplified_bandmf_event`` builds, ⌈n/b⌉ Poisson-sampled Gaussian rounds at the rate
within a part, σ over the column norm); b = 1 is DP-SGD's event; serialization; argument validation."""

import json
import math

import pytest

from keras_dpsgd.accounting import (
    BandMFEvent,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    compute_epsilon,
    event_from_dict,
    make_accountant,
)
from keras_dpsgd.accounting.rdp import DEFAULT_ORDERS

dp_accounting = pytest.importorskip("dp_accounting")


def _reference_epsilon(q, sigma, steps, bands, column_norm, delta):
    """dp_accounting's RDP accountant on DP-SGD with ⌈n/b⌉ steps at (q, σ/ζ), composed independently."""
    from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp

    accountant = dpa_rdp.RdpAccountant(list(DEFAULT_ORDERS))
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma / column_norm))
    accountant.compose(event, math.ceil(steps / bands))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(
    "q, sigma, steps, bands, column_norm",
    [(0.1, 1.3, 450, 4, 1.0), (0.3, 2.5, 1000, 7, 1.0000001), (0.02, 0.9, 101, 3, 0.8), (1.0, 5.0, 12, 5, 1.0)],
)
def test_epsilon_equals_dp_accounting_reference(q, sigma, steps, bands, column_norm):
    event = BandMFEvent(q, sigma, steps=steps, bands=bands, column_norm=column_norm)
    ours = compute_epsilon(event, 1e-5)
    assert ours == pytest.approx(_reference_epsilon(q, sigma, steps, bands, column_norm, 1e-5), rel=1e-6)


def test_one_band_is_dpsgd():
    bandmf = BandMFEvent(0.05, 1.1, steps=300, bands=1)
    dpsgd = PoissonSampledGaussianEvent(0.05, 1.1, count=300)
    for name in ("rdp", "moments"):
        assert make_accountant(name).compose(bandmf).get_epsilon(1e-5) == make_accountant(name).compose(
            dpsgd
        ).get_epsilon(1e-5)


def test_more_bands_fewer_rounds_at_a_higher_rate():
    event = BandMFEvent(0.2, 1.0, steps=10, bands=4, column_norm=2.0)
    assert event.rounds == 3
    assert event.dpsgd_parameters() == (0.2, 0.5, 3)


def test_round_trips_through_the_ledger():
    ledger = PrivacyLedger([BandMFEvent(0.1, 1.2, steps=40, bands=4, column_norm=1.0000001, label="x")])
    restored = PrivacyLedger.from_dict(json.loads(json.dumps(ledger.to_dict())))
    assert restored == ledger
    assert compute_epsilon(restored, 1e-5) == compute_epsilon(ledger, 1e-5)


@pytest.mark.parametrize(
    "field, value, error",
    [("bands", 2.0, TypeError), ("steps", True, TypeError), ("column_norm", "1", TypeError), ("extra", 1, ValueError)],
)
def test_serialized_event_is_checked(field, value, error):
    data = BandMFEvent(0.1, 1.2, steps=40, bands=4).to_dict()
    data[field] = value
    with pytest.raises(error):
        event_from_dict(data)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bands=0), "bands must be an integer >= 1, got 0"),
        (dict(column_norm=0.0), "column_norm must be a finite number > 0, got 0.0"),
        (dict(steps=-1), "steps must be an integer >= 0, got -1"),
        (dict(sampling_rate=0.0), r"sampling_rate must be in \(0, 1\], got 0.0"),
    ],
)
def test_validates_arguments(kwargs, message):
    args = dict(sampling_rate=0.1, noise_multiplier=1.0, steps=10, bands=2) | kwargs
    with pytest.raises(ValueError, match=message):
        BandMFEvent(**args)

import json

import pytest

from keras_dpsgd.accounting import (
    ComposedEvent,
    GaussianEvent,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    event_from_dict,
    flatten_events,
)


def test_ledger_round_trips_through_json():
    ledger = PrivacyLedger()
    ledger.record(PoissonSampledGaussianEvent(0.01, 1.1, count=100, label="dp-sgd"))
    ledger.record(GaussianEvent(4.0, label="dp-pca"))
    ledger.record(ComposedEvent((PoissonSampledGaussianEvent(0.5, 2.0, 3),)))
    restored = PrivacyLedger.from_dict(json.loads(json.dumps(ledger.to_dict())))
    assert restored == ledger
    assert [e.count for e in flatten_events(restored)] == [100, 1, 3]


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, float("nan")])
def test_bad_sampling_rate_names_argument(q):
    with pytest.raises(ValueError, match="sampling_rate must be in \\(0, 1\\]"):
        PoissonSampledGaussianEvent(q, 1.0)


@pytest.mark.parametrize("sigma", [-1.0, float("nan")])
def test_bad_noise_multiplier_names_argument(sigma):
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
        GaussianEvent(sigma)


def test_events_are_immutable():
    event = GaussianEvent(1.0)
    with pytest.raises(Exception):
        event.noise_multiplier = 0.1
    assert event.sampling_rate == 1.0


def test_unknown_event_type_is_refused():
    with pytest.raises(ValueError, match="unknown privacy event type"):
        event_from_dict({"type": "laplace"})

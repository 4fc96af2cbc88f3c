"""Loading a ledger from untrusted state: only what keras_dpsgd wrote loads; everything else raises.

An empty ledger has ε = 0: a state that is not a ledger must never load as one.
"""

import json

import pytest

from keras_dpsgd.accounting import (
    ComposedEvent,
    GaussianEvent,
    PoissonSampledComposedGaussianEvent,
    PoissonSampledGaussianEvent,
    PrivacyLedger,
    compute_epsilon,
    event_from_dict,
)

_PSG = {
    "type": "poisson_sampled_gaussian",
    "sampling_rate": 0.01,
    "noise_multiplier": 1.1,
    "count": 100,
    "label": "dp-sgd",
}
_G = {"type": "gaussian", "noise_multiplier": 4.0, "count": 1, "label": "dp-pca"}
_PSCG = {
    "type": "poisson_sampled_composed_gaussian",
    "sampling_rate": 0.01,
    "noise_multipliers": [2.0, 2.0],
    "count": 100,
    "label": "dp-sgd",
}

# _ledger()'s events as version 1 and 0.1.0 wrote them (the composed event before version 2).
_V1_EVENTS = [
    _PSG,
    _G,
    {
        "type": "composed",
        "events": [
            {"type": "poisson_sampled_gaussian", "sampling_rate": 0.5, "noise_multiplier": 2.0, "count": 3, "label": ""}
        ],
    },
]


def _ledger():
    return PrivacyLedger(
        [
            PoissonSampledGaussianEvent(0.01, 1.1, count=100, label="dp-sgd"),
            GaussianEvent(4.0, label="dp-pca"),
            ComposedEvent((PoissonSampledGaussianEvent(0.5, 2.0, 3),)),
        ]
    )


NOT_LEDGERS = {
    "empty dict": {},
    "opacus history": {"history": []},
    "opacus accountant state": {"history": [(1.1, 0.01, 100)], "mechanism": "rdp"},
    "no events key": {"format": "keras_dpsgd.ledger", "version": 1},
    "None": None,
    "list of events": [_PSG],
    "string": json.dumps({"events": [_PSG]}),
    "events not a list": {"events": _PSG},
    "events None": {"events": None},
    "extra top-level key": {"events": [_PSG], "epsilon": 0.0},
    "extra key with format": {"format": "keras_dpsgd.ledger", "version": 1, "events": [_PSG], "closed": []},
    "unknown format": {"format": "opacus", "version": 1, "events": [_PSG]},
    "future version": {"format": "keras_dpsgd.ledger", "version": 4, "events": [_PSG]},
    "version 1 with a version 2 event": {"format": "keras_dpsgd.ledger", "version": 1, "events": [_PSCG]},
    "0.1.0 shape with a version 2 event": {"events": [_PSCG]},
    "version 1 composed of a version 2 event": {
        "format": "keras_dpsgd.ledger",
        "version": 1,
        "events": [{"type": "composed", "events": [_PSCG]}],
    },
    "releases not a list": {"events": [{**_PSCG, "noise_multipliers": 1.1}]},
    "no releases": {"events": [{**_PSCG, "noise_multipliers": []}]},
    "release as string": {"events": [{**_PSCG, "noise_multipliers": ["1.1"]}]},
    "release negative": {"events": [{**_PSCG, "noise_multipliers": [1.1, -1.0]}]},
    "releases with a flat noise": {"events": [{**_PSCG, "noise_multiplier": 1.1}]},
    "version as string": {"format": "keras_dpsgd.ledger", "version": "1", "events": [_PSG]},
    "version as bool": {"format": "keras_dpsgd.ledger", "version": True, "events": [_PSG]},
    "format without version": {"format": "keras_dpsgd.ledger", "events": [_PSG]},
    "unknown event kind": {"events": [{"type": "laplace", "scale": 1.0}]},
    "event without type": {"events": [{k: v for k, v in _PSG.items() if k != "type"}]},
    "event not a dict": {"events": [[0.01, 1.1, 100]]},
    "event missing count": {"events": [{k: v for k, v in _PSG.items() if k != "count"}]},
    "event missing noise": {"events": [{k: v for k, v in _PSG.items() if k != "noise_multiplier"}]},
    "event with extra field": {"events": [{**_PSG, "orders": [2, 3]}]},
    "negative count": {"events": [{**_PSG, "count": -5}]},
    "fractional count": {"events": [{**_PSG, "count": 2.5}]},
    "count as bool": {"events": [{**_PSG, "count": True}]},
    "count as string": {"events": [{**_PSG, "count": "100"}]},
    "sampling rate as string": {"events": [{**_PSG, "sampling_rate": "0.01"}]},
    "noise as bool": {"events": [{**_G, "noise_multiplier": True}]},
    "noise negative": {"events": [{**_G, "noise_multiplier": -1.0}]},
    "sampling rate above one": {"events": [{**_PSG, "sampling_rate": 1.5}]},
    "label not a string": {"events": [{**_PSG, "label": 3}]},
    "gaussian with a sampling rate": {"events": [{**_G, "sampling_rate": 0.5}]},
    "composed without events": {"events": [{"type": "composed"}]},
    "composed of a bad event": {"events": [{"type": "composed", "events": [{"type": "laplace"}]}]},
    "composed events not a list": {"events": [{"type": "composed", "events": _PSG}]},
}


@pytest.mark.parametrize("state", list(NOT_LEDGERS.values()), ids=list(NOT_LEDGERS))
def test_every_non_ledger_state_raises(state):
    with pytest.raises((ValueError, TypeError)):
        PrivacyLedger.from_dict(state)


def test_the_error_says_what_was_expected_and_what_was_got():
    with pytest.raises(ValueError, match=r"not a keras_dpsgd ledger.*'events'.*got keys \['history', 'mechanism'\]"):
        PrivacyLedger.from_dict({"history": [(1.1, 0.01, 100)], "mechanism": "rdp"})
    with pytest.raises(TypeError, match="must be a dict.*got NoneType"):
        PrivacyLedger.from_dict(None)
    with pytest.raises(ValueError, match=r"ledger version must be one of \[1, 2, 3\].*got 4"):
        PrivacyLedger.from_dict({"format": "keras_dpsgd.ledger", "version": 4, "events": []})
    with pytest.raises(ValueError, match="count must be an integer >= 0, got -5"):
        PrivacyLedger.from_dict({"events": [{**_PSG, "count": -5}]})
    with pytest.raises(ValueError, match="exactly the fields.*got"):
        event_from_dict({**_PSG, "orders": [2]})


def test_to_dict_carries_format_and_version():
    data = _ledger().to_dict()
    assert data["format"] == "keras_dpsgd.ledger"
    assert data["version"] == 2
    assert set(data) == {"format", "version", "events"}


def test_round_trip_through_json():
    ledger = _ledger()
    restored = PrivacyLedger.from_dict(json.loads(json.dumps(ledger.to_dict())))
    assert restored == ledger
    assert compute_epsilon(restored, 1e-5) == compute_epsilon(ledger, 1e-5) > 0


def test_empty_ledger_round_trips():
    assert PrivacyLedger.from_dict(PrivacyLedger().to_dict()) == PrivacyLedger()


def test_version_1_files_still_load():
    # What keras_dpsgd wrote before the composed step event (version 2).
    version_1 = {
        "format": "keras_dpsgd.ledger",
        "version": 1,
        "events": _V1_EVENTS,
    }
    assert PrivacyLedger.from_dict(json.loads(json.dumps(version_1))) == _ledger()


def test_a_composed_step_round_trips_as_version_2():
    ledger = PrivacyLedger([PoissonSampledComposedGaussianEvent(0.01, (2.0, 2.0), count=100, label="dp-sgd")])
    data = json.loads(json.dumps(ledger.to_dict()))
    assert data["version"] == 2 and data["events"] == [_PSCG]
    assert PrivacyLedger.from_dict(data) == ledger


def test_legacy_0_1_0_shape_still_loads():
    # What keras_dpsgd 0.1.0 wrote into checkpoints, .keras files and privacy_report.json.
    legacy = {"events": _V1_EVENTS}
    assert PrivacyLedger.from_dict(json.loads(json.dumps(legacy))) == _ledger()
    assert PrivacyLedger.from_dict({"events": []}) == PrivacyLedger()


def test_integer_valued_numbers_from_json_load():
    # JSON writers may drop ".0": σ = 4 and q = 1 are numbers all the same.
    restored = event_from_dict({**_G, "noise_multiplier": 4})
    assert restored == GaussianEvent(4.0, label="dp-pca")
    assert event_from_dict({**_PSG, "sampling_rate": 1}).sampling_rate == 1.0

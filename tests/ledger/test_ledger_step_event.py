"""A step is recorded as a Poisson-sampled composition of Gaussian releases; the accountant derives σ_eff.

The ε of the new events equals, to 1e-12, the ε of the flat event the ledger recorded before
(q, σ_eff by the closed form), for flat, per-layer and adaptive clipping (tf_keras), and σ_eff has one
implementation that the sanitizer (both Kerases), planning and adaptive clipping call.
"""

import math

import numpy as np
import pytest
import tf_keras as keras

from keras_dpsgd.step import settings as _dp_settings
from keras_dpsgd import accounting
from keras_dpsgd.accounting import (
    PoissonSampledComposedGaussianEvent,
    PoissonSampledGaussianEvent,
    compute_epsilon,
    composed_noise_multiplier,
)
from keras_dpsgd import keras3 as k3
from keras_dpsgd.ledger import assume_poisson, model_privacy_ledger, step_noise_multipliers
from keras_dpsgd.tf_keras._optimizer import DPSGDOptimizer
from keras_dpsgd.tools import adaptive_clipping
from keras_dpsgd.tf_keras._adaptive import AdaptiveDPSGDOptimizer

N, LOT, STEPS, SIGMA, SIGMA_NORM, DELTA = 64, 16, 3, 1.1, 3.0, 1e-5
Q = LOT / N


def _old_sigma_eff(sigmas):
    """The closed form the ledger charged before (one flat event at σ_eff)."""
    return float(sum(1.0 / s**2 for s in sigmas) ** -0.5)


def _train(optimizer):
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(LOT * STEPS, 3)).astype(np.float32)
    y = (x[:, :1] > 0).astype(np.float32)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="tanh"), keras.layers.Dense(1)])
    assume_poisson(optimizer)  # the fixed batches stand for Poisson lots at q
    model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True, reduction="none"))
    model.fit(x, y, batch_size=LOT, epochs=1, verbose=0)
    return model


SETUPS = {
    "flat": (lambda: DPSGDOptimizer(1.0, SIGMA, sampling_rate=Q, expected_lot_size=LOT), [SIGMA]),
    "per-layer, one sigma each": (
        lambda: DPSGDOptimizer([1.0, 0.5, 1.0, 0.5], [1.1, 2.0, 3.0, 4.0], sampling_rate=Q),
        [1.1, 2.0, 3.0, 4.0],
    ),
    "adaptive": (
        lambda: AdaptiveDPSGDOptimizer([1.0] * 4, SIGMA, SIGMA_NORM, sampling_rate=Q, expected_lot_size=LOT),
        [SIGMA] * 4 + [SIGMA_NORM] * 4,
    ),
}


@pytest.fixture(scope="module")
def ledgers():
    return {name: model_privacy_ledger(_train(make())) for name, (make, _) in SETUPS.items()}


@pytest.mark.parametrize("name", list(SETUPS))
def test_the_step_event_keeps_its_releases_and_the_old_epsilon(ledgers, name):
    releases = SETUPS[name][1]
    (event,) = ledgers[name].events
    if len(releases) == 1:
        assert event == PoissonSampledGaussianEvent(Q, SIGMA, STEPS, "dp-sgd")
    else:
        assert event == PoissonSampledComposedGaussianEvent(Q, tuple(releases), STEPS, "dp-sgd")
    old = PoissonSampledGaussianEvent(Q, _old_sigma_eff(releases), STEPS, "dp-sgd")
    for accountant in ("rdp", "moments"):
        assert compute_epsilon(ledgers[name], DELTA, accountant=accountant) == pytest.approx(
            compute_epsilon(old, DELTA, accountant=accountant), rel=1e-12, abs=0
        )


def test_the_event_survives_the_ledger_format(ledgers):
    ledger = ledgers["adaptive"]
    assert accounting.PrivacyLedger.from_dict(ledger.to_dict()) == ledger


@pytest.mark.parametrize("sigmas", [[1.1], [2.0, 2.0], [1.1, 2.0, 3.0, 4.0], [0.7, 1e3], [1.0, 0.0]])
def test_one_sigma_eff_for_the_sanitizer_planning_and_adaptive_clipping(sigmas):
    expected = 0.0 if 0.0 in sigmas else _old_sigma_eff(sigmas)
    assert composed_noise_multiplier(sigmas) == pytest.approx(expected, rel=1e-15, abs=0)
    assert _dp_settings.effective_noise_multiplier(sigmas) == composed_noise_multiplier(sigmas)
    assert accounting.effective_noise_multiplier(sigmas) == composed_noise_multiplier(sigmas)
    half = len(sigmas) // 2 or 1
    assert adaptive_clipping.composed_noise_multiplier(sigmas[:half], sigmas[half:] or sigmas) == (
        composed_noise_multiplier(sigmas[:half] + (sigmas[half:] or sigmas))
    )


def test_the_optimizers_sigma_eff_is_their_releases_composed():
    flat = DPSGDOptimizer(1.0, SIGMA)
    per_layer = DPSGDOptimizer([1.0, 1.0, 1.0], SIGMA)
    adaptive = AdaptiveDPSGDOptimizer([1.0, 1.0], SIGMA, SIGMA_NORM)
    assert flat.release_noise_multipliers == (SIGMA,) and flat.effective_noise_multiplier == SIGMA
    assert per_layer.effective_noise_multiplier == pytest.approx(SIGMA / math.sqrt(3), rel=1e-15)
    assert adaptive.release_noise_multipliers == (SIGMA, SIGMA, SIGMA_NORM, SIGMA_NORM)
    assert adaptive.effective_noise_multiplier == composed_noise_multiplier(adaptive.release_noise_multipliers)
    keras3 = k3.DPSGDOptimizer([1.0, 1.0], [1.1, 2.0], learning_rate=0.1)
    assert keras3.release_noise_multipliers == (1.1, 2.0)
    assert keras3.effective_noise_multiplier == pytest.approx(_old_sigma_eff([1.1, 2.0]), rel=1e-15)
    for optimizer in (flat, per_layer, adaptive, keras3):  # what the ledger records for one step
        assert step_noise_multipliers(optimizer) == optimizer.release_noise_multipliers


@pytest.mark.parametrize("bad", [[], "1.1", [True], [-1.0], [float("nan")]])
def test_bad_releases_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        composed_noise_multiplier(bad)
    with pytest.raises((ValueError, TypeError)):
        PoissonSampledComposedGaussianEvent(0.1, bad)

"""DPPCA and DPNormalization on torch: adapt, train behind make_private, ε, output, save/load (issue 39).

The JAX suite's checks (tests/backends/jax/test_jax_dp_layers.py) run here on torch, except its ε check, which
expects JAX's float32 records: torch keeps the layers' records in float64, so the release is recorded exactly
(q and σ as given) and ε is the accountant's of the release and the steps.
"""

import keras
import numpy as np
import pytest

from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.ledger import model_epsilon, model_privacy_ledger
from tests.backends.jax.test_jax_dp_layers import (  # noqa: F401 (the fixtures and the backend-neutral checks)
    DELTA,
    STEP_Q,
    STEP_SIGMA,
    STEPS,
    norm_model,
    pca_model,
    test_keras_file_keeps_the_records_and_a_float64_file_loads_outward,
    test_outputs_are_numpy_from_the_stored_weights,
)


@pytest.mark.parametrize("fixture, label", [("pca_model", "dp-pca"), ("norm_model", "dp-normalization")])
def test_epsilon_composes_the_release_and_the_steps(fixture, label, request):
    assert keras.config.backend() == "torch"
    model = request.getfixturevalue(fixture)
    layer = model.layers[0]
    (release,) = layer.privacy_events
    assert np.asarray(layer.adapt_sampling_rate.numpy()).dtype == np.float64  # torch keeps float64
    assert (release.sampling_rate, release.noise_multiplier) == (layer.sampling_rate, layer.noise_multiplier)
    steps = PoissonSampledGaussianEvent(STEP_Q, STEP_SIGMA, count=STEPS, label="dp-sgd")
    assert release.label == label and model_privacy_ledger(model).events == (release, steps)
    eps, _ = model_epsilon(model, target_delta=DELTA)
    assert eps == pytest.approx(compute_epsilon([release, steps], DELTA), rel=1e-12)

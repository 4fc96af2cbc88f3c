"""Adaptive clipping on JAX: the checks JAX and torch share (tests/_adaptive_checks.py: the bound update against a
one-example loop, a discarded partial lot, the norm query's noise and ε, a hook of one's own refused), and a
.keras file of 0.2.0 with adaptive bounds loaded and continued."""

import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from keras_dpsgd import PoissonLots, model_epsilon
from tests._adaptive_checks import *  # noqa: F403 (the checks JAX and torch share, collected here)


@pytest.mark.parametrize("kind", ["per_layer", "flat"])
def test_adaptive_model_of_0_2_0_loads_with_its_steps_and_bounds_and_continues(kind):
    """A .keras file of 0.2.0 (tests/fixtures/saved_0_2_0/generate.py jax_adaptive) holds every optimizer variable
    but dp_ledger_offset, added since before adaptive_norm_sums: the load keeps noised_steps and the bounds."""
    import json
    import pathlib

    root = pathlib.Path(__file__).parents[2] / "fixtures" / "saved_0_2_0" / "jax_adaptive"
    facts = json.loads((root / "facts.json").read_text())
    model = keras.saving.load_model(root / f"{kind}.keras")
    opt = model.optimizer
    assert int(keras.ops.convert_to_numpy(opt.noised_steps)) == facts[kind]["noised_steps"]
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(opt.clip_bounds), np.float32(facts[kind]["clip_bounds"]))
    assert model_epsilon(model, target_delta=1e-5)[0] == pytest.approx(facts[kind]["epsilon"], rel=1e-9)
    probe = np.asarray(facts["probe"], np.float32)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(model(probe)), facts[kind]["predictions"], rtol=1e-6, atol=1e-6
    )

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    lots = PoissonLots(x, (x[:, :1] > 0).astype("float32"), expected_lot_size=8, seed=11)
    model = k3.make_private(model)
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=1, verbose=0)
    assert int(keras.ops.convert_to_numpy(opt.noised_steps)) == facts[kind]["noised_steps"] + lots.steps_per_epoch
    bounds = keras.ops.convert_to_numpy(opt.clip_bounds)
    assert np.all(bounds >= opt.min_clip_bound) and not np.array_equal(bounds, np.float32(facts[kind]["clip_bounds"]))

"""A Keras 3 JAX model saved by keras_dpsgd 0.2.0 still loads and trains on (see tests/test_saved_0_2_0.py)."""

import json
import pathlib

import keras
import numpy as np
import pytest

import keras_dpsgd
from keras_dpsgd.keras3 import make_private

FIXTURES = pathlib.Path(__file__).parents[2] / "fixtures" / "saved_0_2_0" / "jax"


def test_jax_model_of_0_2_0_loads_and_continues():
    facts = json.loads((FIXTURES / "facts.json").read_text())
    probe = np.asarray(facts["probe"], np.float32)
    model = keras.saving.load_model(FIXTURES / "model.keras")
    assert int(keras.ops.convert_to_numpy(model.optimizer.noised_steps)) == facts["noised_steps"]
    assert keras_dpsgd.model_epsilon(model, target_delta=1e-5)[0] == pytest.approx(facts["epsilon"], rel=1e-9)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(probe)), facts["predictions"], rtol=1e-6, atol=1e-6)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    lots = keras_dpsgd.PoissonLots(x, y, expected_lot_size=8, seed=11)
    model = make_private(model)
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=1, verbose=0)
    assert int(keras.ops.convert_to_numpy(model.optimizer.noised_steps)) == facts["noised_steps"] + lots.steps_per_epoch

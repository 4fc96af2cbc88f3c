"""A Keras 3 JAX model saved by keras_dpsgd 0.2.0 still loads and trains on (the check of tests/test_saved_0_2_0.py
on this process's backend, JAX, with the file 0.2.0 wrote on JAX)."""

import pathlib

from tests.test_saved_0_2_0 import keras3_file_loads_and_continues

FIXTURES = pathlib.Path(__file__).parents[2] / "fixtures" / "saved_0_2_0" / "jax"


def test_jax_model_of_0_2_0_loads_and_continues():
    keras3_file_loads_and_continues(FIXTURES)

"""BandMF on Keras 3 with the JAX backend (issue 42): the checks of tests/_bandmf.py on JAX's front."""

import keras
import pytest

from tests._bandmf import *  # noqa: F403 (the checks, collected here)


@pytest.fixture(autouse=True, scope="module")
def _on_jax():
    assert keras.config.backend() == "jax"

"""BandMF on Keras 3 with the PyTorch backend (issue 42): the checks of tests/_bandmf.py on torch's front."""

import keras
import pytest

from tests._bandmf import *  # noqa: F403 (the checks, collected here)


@pytest.fixture(autouse=True, scope="module")
def _on_torch():
    assert keras.config.backend() == "torch"

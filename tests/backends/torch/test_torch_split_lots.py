"""PoissonLots(max_physical_batch_size=M) on Keras 3 with the torch backend: the checks of
tests/keras3/test_keras3_split_lots.py (one release per split lot, equal to the whole lot's; noise once; ε; a
partial lot never released) on the torch front."""

import keras

from tests.keras3.test_keras3_split_lots import *  # noqa: F403 (the checks, collected here)


def test_the_backend_is_torch():
    assert keras.config.backend() == "torch"

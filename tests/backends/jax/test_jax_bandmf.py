"""BandMF on Keras 3 with the JAX backend (issue 42): the checks of tests/_bandmf.py on JAX's front; DataParallel
refused by name."""

import keras
import numpy as np
import pytest

import keras_dpsgd.keras3 as k3
from keras_dpsgd import CyclicPoissonLots
from keras_dpsgd.dp.bandmf import optimize_banded_toeplitz
from tests._bandmf import *  # noqa: F403 (the checks, collected here)
from tests._bandmf import _compile, _data, _model


@pytest.fixture(autouse=True, scope="module")
def _on_jax():
    assert keras.config.backend() == "jax"


def test_data_parallel_is_refused_by_name_before_any_update():
    """BandMF's noise history across devices is not tested: refused under DataParallel (2 host devices)."""
    x, y = _data(16)
    strategy = optimize_banded_toeplitz(4, 2, cache_dir=None)
    with keras.distribution.DataParallel().scope():
        lots = CyclicPoissonLots(x, y, bands=2, sampling_rate=0.5, seed=0)
        model = _compile(_model(), lots.configure(k3.BandMFSGDOptimizer(1.0, 1.0, strategy=strategy)))
        before = [np.array(v.numpy()) for v in model.trainable_variables]
        with pytest.raises(ValueError, match="BandMFSGDOptimizer under keras.distribution.DataParallel"):
            model.fit(lots.dataset(2), epochs=1, verbose=0)
        for b, v in zip(before, model.trainable_variables):
            np.testing.assert_array_equal(b, np.asarray(v.numpy()))

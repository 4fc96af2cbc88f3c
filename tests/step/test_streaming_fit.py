"""StreamingPoissonLots through fit (issue 40, item 5): the fed-data check takes the streamed lots' rate, and
the ledger's ε after k lots is the in-memory PoissonLots' for the same (N, L, σ, k), exactly.

Run on Keras 3 with TensorFlow and on tf_keras here, on Keras 3 with JAX in the JAX suite
(tests/backends/jax/test_jax_streaming_fit.py imports these checks).
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_dpsgd import PoissonLots, StreamingPoissonLots, model_epsilon
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from tests._behaviour import process_fronts

N, SIGMA, DELTA = 16, 1.1, 1e-3
FRONTS = process_fronts()  # Keras 3 and tf_keras; Keras 3 alone in the JAX and torch suites


@pytest.fixture(scope="module", params=sorted(FRONTS))
def front(request):
    return FRONTS[request.param]()


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 3)).astype(np.float32), rng.integers(0, 2, size=N)


def _model(front):
    K = front.keras
    K.utils.set_random_seed(0)
    model = K.Sequential([K.Input((3,)), K.layers.Dense(2)])
    return front.compiled(model, l2_norm_clip=1.0, noise_multiplier=SIGMA, learning_rate=0.1, seed=1)


def _streamed(tmp_path, source, **kwargs):
    x, y = _data()
    if source == "npy":
        np.save(tmp_path / "x.npy", x)
        np.save(tmp_path / "y.npy", y)
        return StreamingPoissonLots.from_npy(str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), **kwargs)
    return StreamingPoissonLots.from_dataset(tf.data.Dataset.from_tensor_slices((x, y)), **kwargs)


@pytest.mark.parametrize("source", ["dataset", "npy"])
def test_fit_on_streamed_lots_is_charged_as_in_memory_lots(front, tmp_path, source):
    """Configured for L = 2, fed 3 streamed lots of L = 8: the optimizer takes their rate, the weights move, and
    ε is the ledger's for 3 in-memory PoissonLots of L = 8 (same events: exactly equal) and the accountant's."""
    x, y = _data()
    model = _model(front)
    PoissonLots(x, y, expected_lot_size=2, seed=0).configure(model.optimizer)
    before = [np.array(w) for w in model.get_weights()]
    fed = _streamed(tmp_path, source, expected_lot_size=8, seed=1)
    model.fit(fed.dataset(3), epochs=1, verbose=0)
    assert int(model.optimizer.noised_steps.numpy()) == 3
    assert model.optimizer.sampling_rate == fed.sampling_rate and model.optimizer.expected_lot_size == 8
    assert not all(np.array_equal(a, np.array(b)) for a, b in zip(before, model.get_weights()))

    memory = _model(front)
    in_memory = PoissonLots(x, y, expected_lot_size=8, seed=2)
    in_memory.configure(memory.optimizer)
    memory.fit(in_memory.dataset(3), epochs=1, verbose=0)
    eps = model_epsilon(model, target_delta=DELTA)[0]
    assert eps == model_epsilon(memory, target_delta=DELTA)[0]
    assert eps == pytest.approx(compute_epsilon([PoissonSampledGaussianEvent(8 / N, SIGMA, 3)], DELTA), rel=1e-9)


def test_a_dataset_derived_from_streamed_lots_is_refused(front, tmp_path):
    """lots.dataset().map(...) is not the sampler's dataset: refused while the optimizer holds a rate."""
    model = _model(front)
    fed = _streamed(tmp_path, "dataset", expected_lot_size=8, seed=1)
    fed.configure(model.optimizer)
    with pytest.raises(ValueError, match=r"is refused: the optimizer holds the Poisson sampling rate q = 0\.5"):
        model.fit(fed.dataset(2).map(lambda a, b, w: (a, b, w)), steps_per_epoch=2, epochs=1, verbose=0)
    assert int(model.optimizer.noised_steps.numpy()) == 0
